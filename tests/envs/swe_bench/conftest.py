"""Fixtures for the swe-bench env: a small prepared offline set and an orchestrator that serves its tools.

The offline set is built from real PyPI source distributions into the user's cache
(``$TANGRAM_CACHE_DIR/swe-bench``, default ``~/.cache/tangram/swe-bench``) the first time, then read
from there; the fixture prepares only two packages, a few instances each.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tangram_env.envs.swe_bench.instance import SweBenchInstance

ROOT = Path(__file__).resolve().parents[3]
PLUGINS = ("tangram_env.envs.tools", "tangram_env.envs.swe_bench.tools")
SUBSET = ["inflection", "isodate"]


@pytest.fixture(scope="session")
def offline_subset() -> list[SweBenchInstance]:
    """Instances of two packages, prepared (with sandbox images) or read from the cache."""
    from tangram_env.envs.swe_bench.prepare import prepare

    report = prepare(SUBSET, limit=6, jobs=2)
    assert report.instances, "prepare validated no instance"
    return report.instances


class Orchestrator:
    """A ``tangram-server`` child on a random loopback port, serving the generic and swe-bench tools."""

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
            "--log-level",
            "WARNING",
            *(a for p in PLUGINS for a in ("--plugin", p)),
            *extra,
        ]
        self.proc = subprocess.Popen(cmd, pass_fds=(write_fd,), cwd=ROOT)
        os.close(write_fd)
        ready, _, _ = select.select([read_fd], [], [], timeout_s)
        line = os.read(read_fd, 4096).decode().strip() if ready else ""
        os.close(read_fd)
        if not line:
            self.proc.kill()
            raise RuntimeError(f"tangram-server did not start (exit code {self.proc.poll()})")
        self.address = line

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def swe_server() -> Iterator[Orchestrator]:
    """One orchestrator for the session's episodes and tool calls."""
    srv = Orchestrator()
    yield srv
    srv.stop()
