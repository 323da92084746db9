"""Start a ``tangram-server`` child process and learn its address.

The child writes its bound address to a pipe once it serves (``--ready-fd``), so callers never guess
ports or poll for readiness. The embedded orchestrator, the test suite and the benchmarks all start
their servers here.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from tangram_env.errors import ServerUnavailable


class ServerProcess:
    """A running ``tangram-server`` child; ``address`` is where it serves.

    ``args`` are extra command-line flags (``--plugin``, ``--cpus`` ...). ``env`` replaces the child's
    environment (default: this process's); ``new_session`` puts it in its own process group so that a
    terminal's Ctrl-C reaches only the parent, which then stops it.
    """

    def __init__(
        self,
        *args: str,
        bind: str = "tcp://127.0.0.1:0",
        log_level: str = "WARNING",
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        new_session: bool = False,
        timeout_s: float = 60.0,
    ) -> None:
        read_fd, write_fd = os.pipe()
        cmd = [
            sys.executable,
            "-m",
            "tangram_env.server",
            "--bind",
            bind,
            "--ready-fd",
            str(write_fd),
            "--log-level",
            log_level,
            *args,
        ]
        try:
            self.process = subprocess.Popen(
                cmd,
                pass_fds=(write_fd,),
                env=None if env is None else dict(env),
                cwd=cwd,
                start_new_session=new_session,
            )
        finally:
            os.close(write_fd)
        try:
            ready, _, _ = select.select([read_fd], [], [], timeout_s)
            line = os.read(read_fd, 4096).decode().strip() if ready else ""
        finally:
            os.close(read_fd)
        if not line:
            self.stop()
            raise ServerUnavailable(
                f"tangram-server did not start within {timeout_s:g} s (exit code {self.process.poll()}); "
                f"run `{' '.join(['tangram-server', '--bind', bind, *args])}` by hand to see why"
            )
        self.address = line

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.process.pid

    def stop(self, grace_s: float = 15.0) -> int:
        """SIGTERM, wait up to ``grace_s``, SIGKILL if still running; the exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                return self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
