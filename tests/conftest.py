"""Fixtures that own real processes and sockets: an orchestrator subprocess, clients, raw sockets."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = "tests.plugins"  # tools the tests register, imported by every test server


class ServerProcess:
    """A ``tangram-server`` child on a random loopback port."""

    def __init__(self, *extra: str, timeout_s: float = 60.0) -> None:
        read_fd, write_fd = os.pipe()
        cmd = [
            sys.executable,
            "-m",
            "tangram_env.server",
            "--bind",
            "tcp://127.0.0.1:0",
            "--ready-fd",
            str(write_fd),
            "--plugin",
            PLUGINS,
            "--log-level",
            "WARNING",
            *extra,
        ]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(cmd, pass_fds=(write_fd,), env=env, cwd=ROOT)
        os.close(write_fd)
        ready, _, _ = select.select([read_fd], [], [], timeout_s)
        line = os.read(read_fd, 4096).decode().strip() if ready else ""
        os.close(read_fd)
        if not line:
            self.proc.kill()
            raise RuntimeError(f"tangram-server did not start (exit code {self.proc.poll()})")
        self.address = line

    def stop(self) -> int:
        """SIGTERM, wait, and return the exit code (SIGKILL if it does not stop)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """One orchestrator shared by the session's tests (it must keep serving through bad input)."""
    srv = ServerProcess()
    yield srv
    srv.stop()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[object]:
    from tangram_env import Client

    c = Client(server.address)
    yield c
    c.close()


@pytest.fixture
def raw_socket(server: ServerProcess) -> Iterator[zmq.Socket[bytes]]:
    """A bare DEALER socket to the server, for sending hand-made frames."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(server.address)
    yield sock
    sock.close(linger=0)
