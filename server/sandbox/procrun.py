"""Run one process with a wall-clock limit and capped output, in the calling thread (no helper threads).

Used by every local provider: the caller builds the command line and says how to kill it; this
module feeds stdin, keeps the first bytes of stdout and stderr, stops a flood, and measures wall and
CPU time. No threads are started, so it works the same in a forked child of a threaded process.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO

_CHUNK = 1 << 16
_SHELL = "/bin/sh"
#: A gated command's shell: wait for the caller's newline on stdin, then become the command.
_GATE = 'read -r _ && exec "$@"'
#: After the main process exits, how long to keep reading pipes a leftover process may still hold.
_EXIT_GRACE_S = 0.2

#: Our ends of the pipes of commands in flight, closed in any child forked meanwhile (an executor's
#: action child, a pool's reset child): a copy held there would keep a stream from ending, a command
#: from reading the end of its stdin or its caller from seeing the end of its output, until that
#: child exits. Pipes are made, and processes spawned with them, under the lock, which a fork takes.
_in_flight: set[int] = set()
_in_flight_lock = threading.Lock()


def _close_in_flight_copies() -> None:
    for fd in _in_flight:
        with contextlib.suppress(OSError):
            os.close(fd)
    _in_flight.clear()
    _in_flight_lock.release()


os.register_at_fork(
    before=_in_flight_lock.acquire,
    after_in_parent=_in_flight_lock.release,
    after_in_child=_close_in_flight_copies,
)


#: Signals whose inherited "ignore" this process keeps as is: the interpreter ignores SIGPIPE and
#: SIGXFSZ itself and ``subprocess`` restores them in children; an ignored SIGCHLD means children are
#: reaped by the kernel; a caught job-control signal would turn a background write to a terminal into
#: an endless retry.
_KEEP_IGNORED = frozenset(
    {signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGTTIN, signal.SIGTTOU, signal.SIGTSTP}
)


def _still_ignored(signum: int, frame: object) -> None:
    """Catch a signal the process was started ignoring: still ignored here, default after an exec."""


def default_signals_for_children() -> list[str]:
    """Let the commands this process spawns start with every signal at its default and none blocked.

    A server started under ``nohup``, or as a script's background job, inherits SIGHUP (or SIGINT and
    SIGQUIT) ignored, and an exec keeps an ignored signal ignored: every sandbox command would too.
    A caught signal is reset by exec, so each inherited "ignore" becomes a handler that does nothing
    (the process itself still ignores it); and the main thread's mask is cleared before any thread
    copies it. Call it from the main thread of a process we own, first thing. Returns the names of the
    signals it changed.
    """
    changed = []
    for sig in signal.valid_signals():
        if sig in _KEEP_IGNORED or sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(OSError, ValueError):  # those the C library keeps for itself
            if signal.getsignal(sig) is signal.SIG_IGN:
                signal.signal(sig, _still_ignored)
                changed.append(_signal_name(sig))
    blocked = signal.pthread_sigmask(signal.SIG_SETMASK, ())
    return changed + [f"{_signal_name(sig)} (blocked)" for sig in sorted(blocked)]


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; return the limit now.

    Every client connection, running action and sandbox holds descriptors, and a common soft default
    (1,024) is reached long before the hard one. Commands in sandboxes get their own limit.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(OSError, ValueError):  # above the kernel's nr_open: keep what we have
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    return soft


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:  # a real-time signal
        return f"signal {sig}"


def tracked_pipe() -> tuple[int, int]:
    """A pipe (read, write) whose ends a forked child closes (see :data:`_in_flight`)."""
    with _in_flight_lock:
        read_fd, write_fd = os.pipe()
        _in_flight.update((read_fd, write_fd))
    return read_fd, write_fd


def close_tracked(*pipes: int | IO[bytes] | None) -> None:
    """Close tracked pipes (descriptors or file objects), each taken off the list first, under the
    lock: a closed number can be reused at once, and a forked child must not close another's.
    """
    with _in_flight_lock:
        for pipe in pipes:
            if pipe is None or (not isinstance(pipe, int) and pipe.closed):
                continue
            with contextlib.suppress(OSError):
                if isinstance(pipe, int):
                    _in_flight.discard(pipe)
                    os.close(pipe)
                else:
                    _in_flight.discard(pipe.fileno())
                    pipe.close()


@dataclass
class OutputCapture:
    """The first ``limit`` bytes of one stream, and how many were dropped after them."""

    limit: int
    chunks: list[bytes] = field(default_factory=list)
    kept: int = 0
    dropped: int = 0

    @property
    def total(self) -> int:
        """Bytes seen so far, kept or not."""
        return self.kept + self.dropped

    def add(self, data: bytes) -> None:
        """Take the next piece of the stream."""
        room = self.limit - self.kept
        if room > 0:
            piece = data[:room]
            self.chunks.append(piece)
            self.kept += len(piece)
        self.dropped += max(0, len(data) - max(room, 0))

    def value(self) -> bytes:
        """The kept bytes."""
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
    argv: Sequence[str] | Callable[[int, int], Sequence[str]],
    *,
    env: dict[str, str],
    cwd: str | None,
    stdin: bytes | None,
    timeout_s: float,
    max_output_bytes: int,
    output_kill_bytes: int,
    kill: Callable[[int], None],
    on_spawn: Callable[[int], None] | None = None,
    gated: bool = False,
    on_child: Callable[[int], None] | None = None,
    give_fds: tuple[int, ...] = (),
) -> RunOutcome:
    """Run ``argv`` until it exits, ``timeout_s`` passes or its output passes ``output_kill_bytes``.

    ``kill(pid)`` must end the process and everything it started. With ``on_child`` (the bubblewrap
    hand-shake), ``argv`` is a function of two inherited fds, ``(status_fd, block_fd)``, for
    ``--json-status-fd`` and ``--block-fd``: once the status names the sandbox's first process,
    ``on_child(pid)`` is called while that process waits, then it is let go. What arrives on the
    status fd comes back as ``status``. ``on_spawn(pid)`` runs as soon as the process exists.
    ``gated``: the command waits behind a shell until ``on_spawn(pid)`` has returned, so that what it
    applies to the process (rlimits, CPU affinity, both kept across ``exec``) binds the command from
    its first instruction: what a ``preexec_fn`` would do, without one. ``give_fds`` are inherited by
    the child and closed here once it is started.
    There is no ``preexec_fn``: without one the child is spawned with vfork, which costs the same
    however large the calling process is, whereas a fork copies its page tables while holding the
    GIL (milliseconds in a server of some hundred MB, for every thread of it).
    """
    if gated:
        assert on_spawn is not None and on_child is None, "a gate waits for on_spawn (bubblewrap has its own)"
        # The gate's newline goes first down the command's stdin, after on_spawn: the shell's `read`
        # takes it a byte at a time, leaving the rest of stdin to the command. No newline (on_spawn
        # failed, or this process died): `read` fails and the command never runs.
        stdin = b"\n" + (stdin or b"")
    start = time.monotonic()
    with _in_flight_lock:
        proc, fds = _spawn(argv, env, cwd, bool(stdin), on_child is not None, gated, give_fds)
    try:
        if on_spawn is not None:
            try:
                on_spawn(proc.pid)
            except BaseException:
                kill(proc.pid)
                os.wait4(proc.pid, 0)
                proc.returncode = -9
                raise
        if on_child is not None:
            status_r, status_w, block_r, block_w = fds
            close_tracked(status_w, block_r)
            fds = [status_r, block_w]
            hand = _Handshake(status_r, block_w, on_child)
        else:
            hand = None
        return _supervise(proc, start, stdin, timeout_s, max_output_bytes, output_kill_bytes, kill, hand)
    finally:
        close_tracked(*fds, proc.stdin, proc.stdout, proc.stderr)


def _spawn(
    argv: Sequence[str] | Callable[[int, int], Sequence[str]],
    env: dict[str, str],
    cwd: str | None,
    has_stdin: bool,
    handshake: bool,
    gated: bool,
    give_fds: tuple[int, ...],
) -> tuple[subprocess.Popen[bytes], list[int]]:
    """Start the process (under ``_in_flight_lock``); its pipes and the handshake's are tracked."""
    fds: list[int] = []
    if handshake:
        status_r, status_w = os.pipe()
        block_r, block_w = os.pipe()
        fds = [status_r, status_w, block_r, block_w]
        assert callable(argv)
        command = list(argv(status_w, block_r))
        pass_fds: tuple[int, ...] = (status_w, block_r)
    else:
        assert not callable(argv)
        command, pass_fds = list(argv), ()
    if gated:
        command = [_SHELL, "-c", _GATE, "sh", *command]
    try:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE if has_stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            pass_fds=(*pass_fds, *give_fds),
            start_new_session=True,
        )
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        for fd in give_fds:
            os.close(fd)
    _in_flight.update(fds)
    _in_flight.update(s.fileno() for s in (proc.stdin, proc.stdout, proc.stderr) if s is not None)
    return proc, fds


class _Handshake:
    """Reads bubblewrap's status lines; on the first ``child-pid``, runs the callback and unblocks."""

    def __init__(self, status_fd: int, block_fd: int, on_child: Callable[[int], None]) -> None:
        self.status_fd = status_fd
        self.block_fd = block_fd
        self.on_child = on_child
        self.data = bytearray()
        self.done = False

    def feed(self, chunk: bytes) -> None:
        self.data.extend(chunk)
        if self.done or b"\n" not in self.data:
            return
        first = bytes(self.data).split(b"\n", 1)[0]
        self.done = True
        try:
            pid = int(json.loads(first)["child-pid"])
        except (ValueError, KeyError, TypeError):
            # Never let it go unconfigured: the caller kills it.
            raise RuntimeError(f"unexpected bubblewrap status {first!r}") from None
        self.on_child(pid)
        os.write(self.block_fd, b"x")


def _supervise(
    proc: subprocess.Popen[bytes],
    start: float,
    stdin: bytes | None,
    timeout_s: float,
    max_output_bytes: int,
    output_kill_bytes: int,
    kill: Callable[[int], None],
    hand: _Handshake | None,
) -> RunOutcome:
    assert proc.stdout is not None and proc.stderr is not None
    deadline = start + timeout_s
    out, err = OutputCapture(max_output_bytes), OutputCapture(max_output_bytes)
    sel = selectors.DefaultSelector()
    pidfd = os.pidfd_open(proc.pid)
    sel.register(pidfd, selectors.EVENT_READ, "exit")
    sel.register(proc.stdout.fileno(), selectors.EVENT_READ, out)
    sel.register(proc.stderr.fileno(), selectors.EVENT_READ, err)
    if hand is not None:
        sel.register(hand.status_fd, selectors.EVENT_READ, hand)
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
                        if isinstance(tag, OutputCapture):
                            open_streams -= 1
                        continue
                    if isinstance(tag, _Handshake):
                        try:
                            tag.feed(data)
                        except BaseException:
                            kill(proc.pid)
                            os.wait4(proc.pid, 0)
                            proc.returncode = -9
                            raise
                        continue
                    tag.add(data)
                    if not killed and out.total + err.total > output_kill_bytes:
                        exceeded = killed = True
                        kill(proc.pid)
    finally:
        sel.close()
        os.close(pidfd)
    if exited_at is not None and open_streams > 0:
        kill(proc.pid)
    _, wait_status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(wait_status)
    if hand is not None:
        with contextlib.suppress(OSError):
            os.set_blocking(hand.status_fd, False)
            while chunk := os.read(hand.status_fd, _CHUNK):
                hand.data.extend(chunk)
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
        status=bytes(hand.data) if hand is not None else b"",
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
        close_tracked(proc.stdin)
    return pending


def kill_session(pid: int) -> None:
    """SIGKILL the process group that ``pid`` leads (it was started in its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
