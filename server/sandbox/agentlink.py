"""The server's side of a sandbox's exec agent (:mod:`.agent`): start it, and run one command through it.

The agent starts each command (an exec, in a child it forked beforehand, inside the sandbox's
namespaces, made once); the server keeps everything that enforces limits: it creates the command's
pipes and passes them in, opens the command's own exec cgroup for the command's process to join
before it runs (descriptors of that group's ``tasks`` files only), reads capped output, kills on
time-out or flood, and kills what the command leaves behind. Works from any process that can reach
the socket's path (a forked child of the server included): nothing here is tied to the process that
started it.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import selectors
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tangram_env.server.sandbox.procrun import OutputCapture, RunOutcome, close_tracked, tracked_pipe

#: The interpreter that runs the agent: the host's, which every local sandbox sees under ``/usr``.
SYSTEM_PYTHON = "/usr/bin/python3"
AGENT_SOURCE = (Path(__file__).parent / "agent.py").read_text()
_STATUS = struct.Struct("<idd")
_CHUNK = 1 << 16
#: After the command's first process exits and its group is killed, how long to read what is left.
_EXIT_GRACE_S = 0.2
#: How long a command runs before the server watches its output pipes: a shorter one's output is read
#: once, on its exit report (the agent holds the pipes' write ends until it has sent it), so the
#: server wakes once for it, not for every write and each end of file. A longer one is read as it
#: writes (until then a pipe holds 64 KiB; a command that writes more waits at most this long).
_QUIET_S = 0.005
#: After a kill, how long the agent has to report the exit before it counts as gone.
_KILL_GRACE_S = 5.0


#: ``sh -c`` script: ``N FILE... COMMAND...``: write our pid to each FILE, then exec COMMAND. The
#: agent is also the last process an out-of-memory kill in the sandbox should take (where the host
#: lets us lower its score; each command is raised above it before it runs anyway).
_JOIN_THEN_EXEC = (
    'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 126; shift; n=$((n - 1)); done; '
    'echo -1000 > /proc/self/oom_score_adj 2>/dev/null; exec "$@"'
)


@dataclass(frozen=True)
class Placement:
    """What a command's process is put under before it runs (it does so itself, see :mod:`.agent`)."""

    #: The ``tasks`` files of the command's own exec group (opened here, passed as descriptors; the
    #: command's process, single-threaded, writes ``0`` to each: see ``CgroupGroup.join_files``).
    join_files: Sequence[str]
    cores: Sequence[int]
    rlimits: Sequence[tuple[int, tuple[int, int]]]
    oom_score_adj: int


class AgentLost(Exception):
    """The agent is gone or misbehaved: the sandbox cannot run commands any more."""


@dataclass
class AgentProcess:
    """A running agent: its bubblewrap, the socket's path, and the lifeline's write end."""

    proc: subprocess.Popen[bytes]
    socket_path: str
    lifeline: int

    def alive(self, settle_s: float = 0.0) -> bool:
        """Whether its bubblewrap still runs (only in the process that started it); with ``settle_s``,
        whether it still runs that long from now: an agent killed a moment ago takes its namespace
        down at once, but its bubblewrap exits a little after.
        """
        if settle_s <= 0:
            return self.proc.poll() is None
        try:
            self.proc.wait(settle_s)
        except subprocess.TimeoutExpired:
            return True
        return False

    def stop(self) -> None:
        """End the lifeline (the agent exits, and its namespace with it) and reap the bubblewrap."""
        with contextlib.suppress(OSError):
            os.close(self.lifeline)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 9)
        with contextlib.suppress(subprocess.TimeoutExpired, ChildProcessError):
            self.proc.wait(5)
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path)


def available() -> bool:
    """Whether this host has the interpreter the agent runs on."""
    return os.access(SYSTEM_PYTHON, os.X_OK)


def launch(
    bwrap_prefix: Sequence[str],
    *,
    socket_path: str,
    uid: int,
    gid: int,
    seccomp_fd: int | None,
    log_path: str,
    join_files: Sequence[str],
) -> AgentProcess:
    """Start the agent in a bubblewrap made from ``bwrap_prefix`` (the sandbox's namespaces and mounts).

    A shell writes its own pid to each of ``join_files`` (the sandbox's ``cgroup.procs``), then
    becomes bubblewrap: the agent and every command it forks are counted from the first instant.
    The shell, not a ``preexec_fn``, so that the server's process is never copied whole to start it.
    """
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    life_r, life_w = os.pipe()
    passed = [listener.fileno(), life_r]
    try:
        listener.bind(socket_path)
        os.chmod(socket_path, 0o600)
        listener.listen(128)
        # The agent outlives the thread that starts it: no --die-with-parent; the lifeline ends it.
        prefix = [a for a in bwrap_prefix if a != "--die-with-parent"]
        sync = [] if seccomp_fd is None else ["--seccomp", str(seccomp_fd)]
        argv = ["/bin/sh", "-c", _JOIN_THEN_EXEC, "sh", str(len(join_files)), *join_files]
        argv += [*prefix, *sync, "--chdir", "/", "--", SYSTEM_PYTHON, "-I", "-S", "-c", AGENT_SOURCE]
        argv += [str(listener.fileno()), str(life_r), str(uid), str(gid)]
        if seccomp_fd is not None:
            passed.append(seccomp_fd)
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                cwd="/",
                pass_fds=tuple(passed),
                start_new_session=True,
            )
    except BaseException:
        os.close(life_w)
        raise
    finally:
        listener.close()  # the agent holds it now: once the agent is gone, connecting fails at once
        os.close(life_r)
        if seccomp_fd is not None:
            os.close(seccomp_fd)
    return AgentProcess(proc, socket_path, life_w)


def run_command(
    socket_path: str,
    *,
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    stdin: bytes | None,
    timeout_s: float,
    max_output_bytes: int,
    output_kill_bytes: int,
    placement: Placement,
    kill: Callable[[], object],
    on_exit: Callable[[], object] | None = None,
    as_root: bool = False,
) -> RunOutcome:
    """Run one command through the agent listening at ``socket_path`` (see the protocol in :mod:`.agent`).

    The command's process puts itself under ``placement`` before it runs; ``kill()`` ends the command
    and everything it started; ``on_exit()`` deals with what is left once its first process has
    exited (default: ``kill()``; it must leave no process that holds the command's pipes).
    ``as_root``: the command keeps the agent's uid and capabilities (the server's own trusted helpers
    only). Raises :class:`AgentLost` when the agent does not answer, cannot place the command or dies
    mid-command (the command is killed first).
    """
    start = time.monotonic()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ours: list[int] = []  # our ends of the pipes
    try:
        theirs: list[int] = []
        try:
            if stdin:
                in_r, in_w = tracked_pipe()
                ours.append(in_w)
            else:
                in_r, in_w = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC), -1
            theirs.append(in_r)
            for _ in range(2):  # stdout, stderr
                r, w = tracked_pipe()
                ours.append(r)
                theirs.append(w)
            for path in placement.join_files:
                theirs.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
            request: dict[str, object] = {
                "argv": argv,
                "env": env,
                "cwd": cwd,
                "join": len(placement.join_files),
                "cores": list(placement.cores),
                "rlimits": [[which, soft, hard] for which, (soft, hard) in placement.rlimits],
                "oom_score_adj": placement.oom_score_adj,
            }
            if as_root:
                request["as_root"] = True
            body = json.dumps(request).encode()
            message = struct.pack("<I", len(body)) + body  # one message: the spare takes it in one read
            fds = array.array("i", theirs)
            # Connecting wakes the spare: only now, with the request ready, so that it is not woken
            # onto this core to wait there while this thread prepares.
            try:
                conn.connect(socket_path)
            except OSError as exc:
                raise AgentLost(f"the exec agent does not answer ({exc.strerror or exc})") from None
            sent = conn.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            if sent < len(message):  # never an empty send: the command may have ended and its report come
                conn.sendall(memoryview(message)[sent:])
        except OSError as exc:
            raise AgentLost(f"cannot send the command to the exec agent: {exc}") from None
        finally:
            close_tracked(*theirs[:3])
            for fd in theirs[3:]:
                os.close(fd)
        out_r, err_r = ours[-2:]
        feeder = _Stdin(in_w, stdin or b"")
        if in_w >= 0:
            ours.remove(in_w)
        try:
            return _supervise(
                conn,
                start,
                feeder,
                out_r,
                err_r,
                timeout_s,
                max_output_bytes,
                output_kill_bytes,
                kill,
                on_exit or kill,
            )
        finally:
            feeder.close()

    finally:
        conn.close()
        close_tracked(*ours)


def _supervise(
    conn: socket.socket,
    start: float,
    feeder: _Stdin,
    out_r: int,
    err_r: int,
    timeout_s: float,
    max_output_bytes: int,
    output_kill_bytes: int,
    kill: Callable[[], object],
    on_exit: Callable[[], object],
) -> RunOutcome:
    deadline = start + timeout_s

    def stop() -> None:
        # The connection first: a command's process still placing itself (on cgroup v2 its move can
        # wait for an RCU grace period) is not in the group that ``kill`` empties yet; it checks the
        # connection once placed, and exits unrun. One that checked before is placed, and killed.
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_WR)
        kill()

    out, err = OutputCapture(max_output_bytes), OutputCapture(max_output_bytes)
    streams = {out_r: out, err_r: err}  # not at their end yet
    watch_at: float | None = start + _QUIET_S  # until then, the pipes are read only on the exit report
    sel = selectors.DefaultSelector()
    sel.register(conn, selectors.EVENT_READ, "status")
    if feeder.fd >= 0:
        os.set_blocking(feeder.fd, False)
        sel.register(feeder.fd, selectors.EVENT_WRITE, feeder)
    status = b""
    exited_at: float | None = None
    killed_at: float | None = None
    timed_out = exceeded = False
    try:
        while streams or exited_at is None:
            now = time.monotonic()
            if watch_at is not None and now >= watch_at:
                watch_at = None
                for fd, capture in streams.items():
                    sel.register(fd, selectors.EVENT_READ, capture)
            if exited_at is not None and now - exited_at > _EXIT_GRACE_S:
                break  # a pipe passed on elsewhere: what the command wrote is in
            if killed_at is None and now >= deadline:
                timed_out, killed_at = True, now
                stop()
            if killed_at is not None and exited_at is None and now - killed_at > _KILL_GRACE_S:
                raise AgentLost("the exec agent did not report a killed command's exit")
            if exited_at is not None:
                wait = _EXIT_GRACE_S
            elif killed_at is not None:
                wait = _KILL_GRACE_S
            else:
                wait = max(0.0, deadline - now)
            if watch_at is not None:
                wait = min(wait, max(0.0, watch_at - now))
            for key, _ in sel.select(timeout=wait + 0.001):
                tag = key.data
                if tag == "status":
                    try:
                        data = conn.recv(1024)
                    except OSError as exc:  # reset: the agent died with the connection open
                        stop()
                        raise AgentLost(f"the exec agent's connection failed: {exc}") from None
                    status += data
                    if status[:1] == b"F":  # the command's process could not place itself: it never ran
                        stop()
                        reason = status[1:].decode(errors="replace")
                        raise AgentLost(f"the command's process could not be placed: {reason}")
                    if len(status) >= 1 + _STATUS.size:
                        sel.unregister(conn)
                        exited_at = time.monotonic()
                        on_exit()  # whatever the command left behind goes (or is kept, declared)
                        # Every writer is gone now: what they wrote is in the pipes, end of file or not.
                        for fd, capture in streams.items():
                            if watch_at is None:
                                sel.unregister(fd)
                            _drain(fd, capture)
                        streams.clear()
                        break  # the other events of this round are for pipes read just now
                    elif not data:
                        stop()
                        raise AgentLost("the exec agent died during the command")
                elif isinstance(tag, _Stdin):
                    if tag.feed():
                        sel.unregister(key.fd)
                        tag.close()
                else:
                    data = os.read(key.fd, _CHUNK)
                    if not data:
                        sel.unregister(key.fd)
                        del streams[key.fd]
                        continue
                    tag.add(data)
                    if killed_at is None and out.total + err.total > output_kill_bytes:
                        exceeded, killed_at = True, time.monotonic()
                        stop()
    finally:
        sel.close()
    if status[:1] != b"X":
        raise AgentLost(f"the exec agent sent {status[:16]!r}, not an exit status")
    wait_status, utime, stime = _STATUS.unpack(status[1 : 1 + _STATUS.size])
    returncode = os.waitstatus_to_exitcode(wait_status)
    return RunOutcome(
        returncode=returncode,
        signal=os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else None,
        stdout=out.value(),
        stderr=err.value(),
        stdout_dropped=out.dropped,
        stderr_dropped=err.dropped,
        wall_s=time.monotonic() - start,
        cpu_s=utime + stime,
        timed_out=timed_out,
        output_exceeded=exceeded,
    )


def _drain(fd: int, capture: OutputCapture) -> None:
    """Everything buffered in the pipe ``fd`` (whose writers are all dead), without waiting for its end."""
    os.set_blocking(fd, False)
    with contextlib.suppress(BlockingIOError):
        while data := os.read(fd, _CHUNK):
            capture.add(data)


class _Stdin:
    """The command's stdin: what is left to write, and our end of the pipe (closed once, at the end)."""

    def __init__(self, fd: int, data: bytes) -> None:
        self.fd = fd
        self.pending = memoryview(data)

    def feed(self) -> bool:
        """Write what the pipe takes now; True when everything is written (or the reader is gone)."""
        try:
            self.pending = self.pending[os.write(self.fd, self.pending[:_CHUNK]) :]
        except BlockingIOError:
            return False
        except OSError:
            return True
        return not self.pending

    def close(self) -> None:
        """Close our end (the command then reads end of file)."""
        if self.fd >= 0:
            close_tracked(self.fd)
            self.fd = -1
