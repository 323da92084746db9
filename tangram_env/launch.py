"""Start a ``tangram-server`` child process and learn its address.

The child writes its bound address to a pipe once it serves (``--ready-fd``), so callers never guess
ports or poll for readiness; a child that cannot start writes ``error <cause and fix>`` there
instead, which the caller raises at once. The embedded orchestrator, the test suite and the
benchmarks all start their servers here.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from tangram_env.errors import ServerUnavailable

#: What starts the line a server that cannot start writes to its ready pipe (the cause follows).
START_FAILED = "error "


def report_start_failure(ready_fd: int | None, pipe_inode: int | None, cause: str) -> None:
    """Tell the launcher why this server cannot start, if its ready pipe is still open.

    ``pipe_inode`` is the pipe's inode when the server began: a number closed after readiness (and
    perhaps reused by another file since) is left alone.
    """
    if ready_fd is None or pipe_inode is None:
        return
    try:
        if os.fstat(ready_fd).st_ino != pipe_inode:
            return
        line = START_FAILED + " ".join(cause.split())  # one line, however the cause was written
        os.write(ready_fd, (line[:8000] + "\n").encode())
    except OSError:
        pass


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
        if line.startswith(START_FAILED) or not line:
            self.stop()
            by_hand = f"run `{' '.join(['tangram-server', '--bind', bind, *args])}` by hand to see more"
            if line:
                raise ServerUnavailable(f"tangram-server could not start: {line[len(START_FAILED) :]}")
            code = self.process.poll()
            if ready:  # the pipe closed without a word: the child ended (or closed it) early
                raise ServerUnavailable(f"tangram-server exited before serving (exit code {code}); {by_hand}")
            raise ServerUnavailable(f"tangram-server did not start within {timeout_s:g} s; {by_hand}")
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
