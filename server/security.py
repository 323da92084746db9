"""Who may talk to the orchestrator: loopback by default, CurveZMQ for anything else.

``tangram-server keygen DIR`` writes a key pair; the server loads the secret key, clients and workers
are given the public key (``TANGRAM_CURVE_SERVER_KEY``). Peers that do not complete the CurveZMQ
handshake are dropped by ZeroMQ before any message reaches the loop; with ``curve_clients_dir`` only
clients whose public keys are in that folder are accepted.
"""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.auth

log = logging.getLogger(__name__)


def is_loopback(bind: str) -> bool:
    """Whether ``bind`` can only be reached from this host (ipc/inproc, or a loopback TCP address)."""
    if not bind.startswith("tcp://"):
        return True
    host = urlsplit(bind).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or "*": may be reachable from anywhere


def check_bind_allowed(bind: str, *, curve: bool, allow_remote: bool) -> None:
    """Refuse a bind that other hosts could reach unless it is authenticated and explicitly wanted."""
    if is_loopback(bind):
        return
    if not curve:
        raise PermissionError(
            f"refusing to bind {bind}: a non-loopback address needs CurveZMQ keys "
            "(create them with `tangram-server keygen DIR`, "
            "then pass --curve-secret-key-file DIR/server.key_secret)"
        )
    if not allow_remote:
        raise PermissionError(f"refusing to bind {bind}: pass --allow-remote to accept remote peers")


def configure_server_curve(
    sock: zmq.Socket[Any], secret_key_file: str, clients_dir: str | None, context: zmq.Context[Any]
) -> Any:
    """Make ``sock`` a CurveZMQ server; returns the authenticator thread (or None) to stop at close."""
    public, secret = zmq.auth.load_certificate(secret_key_file)
    if secret is None:
        raise PermissionError(f"{secret_key_file} holds no secret key")
    authenticator = None
    if clients_dir:
        from zmq.auth.thread import ThreadAuthenticator

        authenticator = ThreadAuthenticator(context)
        authenticator.start()
        authenticator.configure_curve(domain="*", location=clients_dir)
        log.info("accepting only the client keys in %s", clients_dir)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return authenticator


def keygen(directory: str, name: str = "server") -> tuple[Path, Path]:
    """Create ``NAME.key`` (public) and ``NAME.key_secret`` in ``directory``."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(folder), name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def read_public_key(path: str) -> str:
    """The z85 public key in a key file (either half of a pair)."""
    public, _ = zmq.auth.load_certificate(path)
    return public.decode()
