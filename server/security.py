"""Who may talk to the orchestrator: loopback by default, CurveZMQ for anything else.

``tangram-server keygen DIR`` writes a key pair; the server loads the secret key, clients and workers
are given the public key (``TANGRAM_CURVE_SERVER_KEY``). Peers that do not complete the CurveZMQ
handshake are dropped by ZeroMQ before any message reaches the loop; with ``curve_clients_dir`` only
clients whose public keys are in that folder are accepted.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
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


def check_curve_settings(secret_key_file: str | None, clients_dir: str | None) -> None:
    """Refuse, at start, CurveZMQ settings that would not do what they say: a clients folder without
    a secret key (no client would show a key: the folder would be ignored), one that is missing (every
    peer refused, said only in a log line), a secret key file that is not there.
    """
    if clients_dir is not None and secret_key_file is None:
        raise ValueError(
            f"--curve-clients-dir {clients_dir} needs --curve-secret-key-file: without CurveZMQ no peer "
            "shows a key to check (create one with `tangram-server keygen DIR`)"
        )
    if secret_key_file is not None and not Path(secret_key_file).is_file():
        raise FileNotFoundError(
            f"--curve-secret-key-file {secret_key_file}: no such file (create a key pair with "
            "`tangram-server keygen DIR` and give it DIR/server.key_secret)"
        )
    if clients_dir is None:
        return
    folder = Path(clients_dir)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"--curve-clients-dir {clients_dir}: no such folder (create it and copy each client's and "
            "worker's public key, NAME.key from `tangram-server keygen DIR --name NAME`, into it)"
        )
    if not any(folder.glob("*.key")):
        log.warning("%s holds no public keys (*.key): every client and worker will be refused", clients_dir)


def configure_server_curve(
    sock: zmq.Socket[Any], secret_key_file: str, clients_dir: str | None, context: zmq.Context[Any]
) -> Any:
    """Make ``sock`` a CurveZMQ server; returns the authenticator thread (or None) to stop at close."""
    public, secret = zmq.auth.load_certificate(secret_key_file)
    if secret is None:
        raise PermissionError(f"{secret_key_file} holds no secret key")
    mode = stat.S_IMODE(os.stat(secret_key_file).st_mode)
    if mode & 0o077:  # whoever can read it can impersonate this server to every client and worker
        log.warning(
            "the secret key %s is open to other users (mode %04o): chmod 600 %s",
            secret_key_file,
            mode,
            secret_key_file,
        )
    authenticator = None
    if clients_dir:
        from zmq.auth.thread import ThreadAuthenticator

        # The keys in the folder, and the orchestrator's own (its local reward-model worker's).
        accepted = {*zmq.auth.load_certificates(clients_dir), public}
        authenticator = ThreadAuthenticator(context)
        authenticator.start()
        authenticator.configure_curve_callback(domain="*", credentials_provider=_Accepted(accepted))
        log.info("accepting only the client keys in %s", clients_dir)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return authenticator


class _Accepted:
    """The authenticator's test of a client's public key (pyzmq's credentials provider)."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def keygen(directory: str, name: str = "server", *, force: bool = False) -> tuple[Path, Path]:
    """Create ``NAME.key`` (public) and ``NAME.key_secret`` in ``directory``; an existing pair is
    replaced only with ``force`` (the peers that trust its public key would be locked out).
    """
    folder = Path(directory)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{directory} is a file: give keygen a folder to write the key pair into")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"cannot create the folder {directory}: {exc.strerror}") from None
    pair = [folder / f"{name}.key", folder / f"{name}.key_secret"]
    existing = [str(path) for path in pair if path.exists()]
    if existing and not force:
        raise FileExistsError(
            f"{' and '.join(existing)} already exist: replacing them locks out every peer given the "
            "public key; pass --force to replace them, or choose another --name or folder"
        )
    for path in pair:
        path.unlink(missing_ok=True)  # written anew below: an old file would keep its old mode
    old_umask = os.umask(0o077)  # the secret is never readable by others, not even for a moment
    try:
        public, secret = zmq.auth.create_certificates(str(folder), name)
    finally:
        os.umask(old_umask)
    Path(public).chmod(0o644)  # the public half is meant to be handed out
    return Path(public), Path(secret)


def read_public_key(path: str) -> str:
    """The z85 public key in a key file (either half of a pair)."""
    public, _ = zmq.auth.load_certificate(path)
    return public.decode()
