"""The client's half of CurveZMQ: what a trainer or a worker needs to reach a keyed orchestrator.

The orchestrator's half (its secret key, the accepted clients, ``tangram-server keygen``) lives in
:mod:`tangram_env.server.security`.
"""

from __future__ import annotations

import os
from typing import Any

import zmq
import zmq.auth
from zmq.utils import z85

from tangram_env.errors import SettingsError


def configure_client_curve(sock: zmq.Socket[Any], server_public_key: str) -> None:
    """Make ``sock`` a CurveZMQ client of the server with this public key (z85), with a fresh key pair
    (or the pair in ``TANGRAM_CURVE_CLIENT_KEY_FILE`` when the server only accepts known clients).
    """
    check_public_key(server_public_key)
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


def check_public_key(key: str | bytes) -> str | bytes:
    """``key`` if it is a CurveZMQ public key (a :class:`~tangram_env.errors.SettingsError` otherwise:
    ZeroMQ would only say "Invalid argument").
    """
    try:
        if len(z85.decode(key)) == 32:
            return key
    except (ValueError, TypeError):
        pass
    raise SettingsError(
        f"the orchestrator's public key {key!r} (TANGRAM_CURVE_SERVER_KEY) is not a CurveZMQ public key: "
        "40 characters of z85, as `tangram-server keygen` prints"
    )
