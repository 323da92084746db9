"""Fixtures that own real processes and sockets: an orchestrator subprocess, clients, raw sockets."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from tangram_env import launch

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = "tests.plugins"  # tools the tests register, imported by every test server


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(every_s)


def run_module(
    module: str, *args: str, env: dict[str, str], timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` from the repository root, with ``env`` (and this checkout on its
    path), as a user runs a console script; its output captured as text.
    """
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
    )


class ServerProcess(launch.ServerProcess):
    """A ``tangram-server`` child on a random loopback port, serving the tools in :mod:`tests.plugins`."""

    def __init__(self, *extra: str, timeout_s: float = 60.0, pythonpath: tuple[str, ...] = ()) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *pythonpath])}
        super().__init__("--plugin", PLUGINS, *extra, env=env, cwd=ROOT, timeout_s=timeout_s)


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
