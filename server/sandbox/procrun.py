"""Run one process with a wall-clock limit and capped output, in the calling thread (no helper threads).

Used by every local provider: the caller builds the command line and says how to kill it; this
module feeds stdin, keeps the first bytes of stdout and stderr, stops a flood, and measures wall and
CPU time. No threads are started, so it works the same in a forked child of a threaded process.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

_CHUNK = 1 << 16
#: After the main process exits, how long to keep reading pipes a leftover process may still hold.
_EXIT_GRACE_S = 0.2


@dataclass
class _Capture:
    """The first ``limit`` bytes of one stream, and how many were dropped after them."""

    limit: int
    chunks: list[bytes] = field(default_factory=list)
    kept: int = 0
    dropped: int = 0

    def add(self, data: bytes) -> None:
        room = self.limit - self.kept
        if room > 0:
            piece = data[:room]
            self.chunks.append(piece)
            self.kept += len(piece)
        self.dropped += max(0, len(data) - max(room, 0))

    def value(self) -> bytes:
        return b"".join(self.chunks)


@dataclass
class RunOutcome:
    """What happened to one process run by :func:`run_captured`."""

    returncode: int
    signal: int | None
    stdout: bytes
    stderr: bytes
    stdout_dropped: int
    stderr_dropped: int
    wall_s: float
    cpu_s: float
    timed_out: bool
    output_exceeded: bool
    status: bytes = b""


def run_captured(
    argv: Sequence[str],
    *,
    env: dict[str, str],
    cwd: str | None,
    stdin: bytes | None,
    timeout_s: float,
    max_output_bytes: int,
    output_kill_bytes: int,
    kill: Callable[[int], None],
    preexec_fn: Callable[[], None] | None = None,
    status_pipe: bool = False,
) -> RunOutcome:
    """Run ``argv`` until it exits, ``timeout_s`` passes or its output passes ``output_kill_bytes``.

    ``kill(pid)`` must end the process and everything it started. With ``status_pipe``, the child
    gets a pipe's write end as fd 3 (for ``bwrap --json-status-fd 3``) and its content is returned.
    """
    status_r = status_w = -1
    if status_pipe:
        status_r, status_w = os.pipe()
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            preexec_fn=_with_fd3(preexec_fn, status_w) if status_pipe else preexec_fn,
            pass_fds=(status_w,) if status_pipe else (),
            start_new_session=True,
        )
    except BaseException:
        if status_pipe:
            os.close(status_r)
            os.close(status_w)
        raise
    if status_pipe:
        os.close(status_w)
    try:
        return _supervise(proc, start, stdin, timeout_s, max_output_bytes, output_kill_bytes, kill, status_r)
    finally:
        if status_r >= 0:
            os.close(status_r)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def _with_fd3(preexec_fn: Callable[[], None] | None, fd: int) -> Callable[[], None]:
    def run() -> None:
        if fd != 3:
            os.dup2(fd, 3)
        if preexec_fn is not None:
            preexec_fn()

    return run


def _supervise(
    proc: subprocess.Popen[bytes],
    start: float,
    stdin: bytes | None,
    timeout_s: float,
    max_output_bytes: int,
    output_kill_bytes: int,
    kill: Callable[[int], None],
    status_fd: int,
) -> RunOutcome:
    assert proc.stdout is not None and proc.stderr is not None
    deadline = start + timeout_s
    out, err = _Capture(max_output_bytes), _Capture(max_output_bytes)
    status = bytearray()
    sel = selectors.DefaultSelector()
    pidfd = os.pidfd_open(proc.pid)
    sel.register(pidfd, selectors.EVENT_READ, "exit")
    sel.register(proc.stdout.fileno(), selectors.EVENT_READ, out)
    sel.register(proc.stderr.fileno(), selectors.EVENT_READ, err)
    if status_fd >= 0:
        sel.register(status_fd, selectors.EVENT_READ, status)
    pending = memoryview(stdin or b"")
    if stdin and proc.stdin is not None:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "stdin")
    open_streams = 2
    exited_at: float | None = None
    timed_out = exceeded = killed = False
    try:
        while open_streams > 0 or exited_at is None:
            now = time.monotonic()
            if exited_at is not None and now - exited_at > _EXIT_GRACE_S:
                break  # a leftover process holds the pipes: stop waiting for it
            if not killed and now >= deadline:
                timed_out = killed = True
                kill(proc.pid)
            wait = (_EXIT_GRACE_S if exited_at is not None or killed else max(0.0, deadline - now)) + 0.001
            for key, _ in sel.select(timeout=wait):
                tag = key.data
                if tag == "exit":
                    sel.unregister(pidfd)
                    exited_at = time.monotonic()
                elif tag == "stdin":
                    pending = _feed(proc, sel, pending)
                else:
                    data = os.read(key.fd, _CHUNK)
                    if not data:
                        sel.unregister(key.fd)
                        if isinstance(tag, _Capture):
                            open_streams -= 1
                        continue
                    if isinstance(tag, bytearray):
                        tag.extend(data)
                        continue
                    tag.add(data)
                    if not killed and out.kept + out.dropped + err.kept + err.dropped > output_kill_bytes:
                        exceeded = killed = True
                        kill(proc.pid)
    finally:
        sel.close()
        os.close(pidfd)
    if exited_at is not None and open_streams > 0:
        kill(proc.pid)
    _, wait_status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(wait_status)
    if status_fd >= 0:
        with contextlib.suppress(OSError):
            while chunk := os.read(status_fd, _CHUNK):
                status.extend(chunk)
    sig = os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else None
    return RunOutcome(
        returncode=proc.returncode,
        signal=sig,
        stdout=out.value(),
        stderr=err.value(),
        stdout_dropped=out.dropped,
        stderr_dropped=err.dropped,
        wall_s=time.monotonic() - start,
        cpu_s=usage.ru_utime + usage.ru_stime,
        timed_out=timed_out,
        output_exceeded=exceeded,
        status=bytes(status),
    )


def _feed(proc: subprocess.Popen[bytes], sel: selectors.BaseSelector, pending: memoryview) -> memoryview:
    assert proc.stdin is not None
    fd = proc.stdin.fileno()
    try:
        sent = os.write(fd, pending[:_CHUNK])
        pending = pending[sent:]
    except BlockingIOError:
        return pending
    except (BrokenPipeError, OSError):
        pending = pending[:0]
    if not pending:
        sel.unregister(fd)
        with contextlib.suppress(OSError):
            proc.stdin.close()
    return pending


def kill_session(pid: int) -> None:
    """SIGKILL the process group that ``pid`` leads (it was started in its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
