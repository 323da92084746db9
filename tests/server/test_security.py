"""Binding rules and CurveZMQ: remote binds need keys; peers without them are never heard."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq

from tangram_env import Client, ServerUnavailable, wire
from tangram_env.protocol import Heartbeat
from tangram_env.server.security import check_bind_allowed, keygen, read_public_key
from tests.conftest import ServerProcess


def test_loopback_is_allowed_and_remote_needs_keys() -> None:
    for bind in ("tcp://127.0.0.1:5555", "tcp://localhost:1", "ipc:///tmp/x.sock", "tcp://[::1]:5"):
        check_bind_allowed(bind, curve=False, allow_remote=False)
    with pytest.raises(PermissionError, match="CurveZMQ"):
        check_bind_allowed("tcp://0.0.0.0:5555", curve=False, allow_remote=True)
    with pytest.raises(PermissionError, match="--allow-remote"):
        check_bind_allowed("tcp://10.1.2.3:5555", curve=True, allow_remote=False)
    check_bind_allowed("tcp://0.0.0.0:5555", curve=True, allow_remote=True)


def test_server_refuses_a_public_bind_without_keys() -> None:
    # The launcher says why at once: the server's own cause, and the fix.
    with pytest.raises(RuntimeError, match=r"non-loopback address needs CurveZMQ keys.*keygen"):
        ServerProcess("--bind", "tcp://0.0.0.0:0", timeout_s=20)


def test_curve_server_serves_keyed_clients_and_drops_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    public, secret = keygen(str(tmp_path))
    srv = ServerProcess("--curve-secret-key-file", str(secret))
    try:
        key = read_public_key(str(public))
        with Client(srv.address, curve_server_key=key) as client:
            assert client.call("echo", {"value": "secret"}) == "secret"
        # A peer without the handshake is dropped by ZeroMQ: no reply ever comes.
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(srv.address)
        sock.send(wire.encode(Heartbeat()))
        assert sock.poll(1500) == 0
        sock.close(linger=0)
        with pytest.raises(ServerUnavailable):
            Client(srv.address, connect_timeout_s=1.5)
        time.sleep(0.1)
    finally:
        assert srv.stop() == 0
