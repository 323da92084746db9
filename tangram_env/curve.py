"""The client's half of CurveZMQ: what a trainer or a worker needs to reach a keyed orchestrator.

The orchestrator's half (its secret key, the accepted clients, ``tangram-server keygen``) lives in
:mod:`tangram_env.server.security`.
"""

from __future__ import annotations

import os
from typing import Any

import zmq
import zmq.auth


def configure_client_curve(sock: zmq.Socket[Any], server_public_key: str) -> None:
    """Make ``sock`` a CurveZMQ client of the server with this public key (z85), with a fresh key pair
    (or the pair in ``TANGRAM_CURVE_CLIENT_KEY_FILE`` when the server only accepts known clients).
    """
    key_file = os.environ.get("TANGRAM_CURVE_CLIENT_KEY_FILE")
    if key_file:
        public, secret = zmq.auth.load_certificate(key_file)
        assert secret is not None, f"{key_file} holds no secret key"
    else:
        public, secret = zmq.curve_keypair()
    sock.curve_serverkey = (
        server_public_key.encode() if isinstance(server_public_key, str) else server_public_key
    )
    sock.curve_publickey = public
    sock.curve_secretkey = secret
