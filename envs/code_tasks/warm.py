"""A warm judge per local sandbox: the harness kept running, so a grading costs forks, not a new interpreter.

The ``code`` env's tool grades through :func:`grade_warm` when its sandbox has an exec agent (the
local provider as root); elsewhere, or when a warm judge cannot be had, it runs the harness afresh
per grading, as before. Both read the same signed reports with :func:`.grading.read_report`.

How a warm judge is made, and why a submission cannot reach it (see ``harness.serve``):

- The tool binds a unix socket in the sandbox's ``/tmp`` from the host (root's, mode 0600: the
  sandbox's user cannot connect to it), then starts the harness in serve mode through the agent
  as the sandbox's root (``as_root``), in the background. The judge connects and checks that the
  listener is outside the sandbox (its pid there is 0) and root's; the tool accepts only a peer of
  uid 0 (the judge; the agent is the only other root there) and then removes the socket's name.
  From then on the connection is the only way in, and only the two ends hold it.
- The judge keeps root as its real and saved uid: solution processes, which run as the sandbox's
  user with no capabilities, cannot signal it, trace it or read its memory; neither can anything
  they leave behind, and nothing is left behind: after each grading every process of the
  sandbox's user is killed (``kill(-1)`` as that user) before the tool hears the grading's end.
- Each grading's spec, with its own nonce, arrives over the connection; the zygote that forks
  solution processes was forked before the first one, so they hold no nonce of any grading.

A judge found gone before a grading (the sandbox was reset or closed) is started again; one that
ends during a grading counts as the harness process ending there, as a cold harness would.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import struct
import threading
import time
import weakref
from typing import Any

from tangram_env.envs.code_tasks.grading import HarnessSpec, serve_invocation
from tangram_env.sandbox import ExecResult, SandboxBroken

log = logging.getLogger(__name__)

#: How long the judge may take to start (an interpreter, the harness, its zygote) and connect.
LAUNCH_TIMEOUT_S = 10.0
#: After the judge died mid-grading unexplained, how long its sandbox's agent has to show it was killed
#: (its bubblewrap exits a little after the namespace goes): its death is then the sandbox's, no grade.
AGENT_DEATH_SETTLE_S = 2.0
_SOCKET_PATH_MAX = 100  # a unix socket's path has room for 107 bytes


class JudgeLost(Exception):
    """The warm judge was gone before the grading began (its sandbox was reset): start another."""


class WarmJudge:
    """The tool's end of one sandbox's judge: one grading at a time (``lock``)."""

    def __init__(self, conn: socket.socket | None = None, pidfd: int = -1) -> None:
        self.conn = conn
        self.pidfd = pidfd  # the judge's process (a pidfd: no pid reuse can misdirect a kill)
        self.lock = threading.Lock()
        self.refused = False  # none could be started: this sandbox grades cold from now on
        self._inbox = bytearray()

    @property
    def usable(self) -> bool:
        """Whether it is connected (not refused, lost or closed)."""
        return self.conn is not None

    def close(self, kill: bool = False) -> None:
        """Drop the connection: the judge kills what is left of its grading and exits (``kill``: it is
        killed now, and its zygote then kills what is left).
        """
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.close()
            self.conn = None
        self._inbox.clear()
        if self.pidfd >= 0:
            if kill:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            os.close(self.pidfd)
            self.pidfd = -1

    def grade(
        self, spec: HarnessSpec, cores: tuple[int, ...], timeout_s: float
    ) -> tuple[bytes | None, ExecResult]:
        """The last signed report of ``spec``'s grading (None if none came) and how the run went."""
        assert self.conn is not None
        started = time.monotonic()
        request = b'{"cores":%s,"spec":%s}' % (json.dumps(list(cores)).encode(), spec.to_json().encode())
        try:
            self.conn.sendall(b"G" + len(request).to_bytes(4, "big") + request)
        except OSError:
            self.close()
            raise JudgeLost("the warm judge is gone") from None
        last: bytes | None = None
        deadline = started + timeout_s
        while True:
            try:
                frame = self._read_frame(deadline)
            except TimeoutError:
                self.close(kill=True)  # its tests run no further than the action's time
                return last, ExecResult(exit_code=-9, killed_by="timeout", wall_s=time.monotonic() - started)
            except OSError:
                frame = None
            if frame is None:
                self.close()
                if last is None:
                    raise JudgeLost("the warm judge ended before it began the grading")
                return last, ExecResult(exit_code=-9, wall_s=time.monotonic() - started)
            kind, body = frame
            if kind == b"R":
                last = body
            elif kind == b"D":
                return last, ExecResult(exit_code=0, wall_s=time.monotonic() - started, cpu_s=float(body))
            else:
                self.close()
                raise RuntimeError(f"the warm judge refused the spec: {body[:500].decode(errors='replace')}")

    def _read_frame(self, deadline: float) -> tuple[bytes, bytes] | None:
        """The next frame (a kind byte, a 4-byte length, the body); None at end of file."""
        assert self.conn is not None
        inbox = self._inbox
        while len(inbox) < 5 or len(inbox) < 5 + int.from_bytes(inbox[1:5], "big"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.conn.settimeout(left)
            chunk = self.conn.recv(1 << 16)
            if not chunk:
                return None
            inbox += chunk
        size = int.from_bytes(inbox[1:5], "big")
        kind, body = bytes(inbox[:1]), bytes(inbox[5 : 5 + size])
        del inbox[: 5 + size]
        return kind, body


#: Sandbox id -> (the sandbox, weakly, and its judge). Only the process that made a judge uses it.
_judges: dict[str, tuple[weakref.ref[Any], WarmJudge]] = {}
_lock = threading.Lock()


def _forget_in_child() -> None:
    """A forked child must not talk over its parent's connections: it closes its copies."""
    for _, judge in _judges.values():
        if judge.conn is not None:
            with contextlib.suppress(OSError):
                judge.conn.close()
    _judges.clear()
    _lock.release()


os.register_at_fork(before=_lock.acquire, after_in_parent=_lock.release, after_in_child=_forget_in_child)


def supported(sandbox: Any) -> bool:
    """Whether ``sandbox`` can keep a warm judge: a local sandbox with an exec agent, us as root, and no
    CPU-time rlimit (it would count the judge's whole life).
    """
    return (
        getattr(sandbox, "agent", None) is not None
        and callable(getattr(sandbox, "host_path", None))
        and callable(getattr(sandbox, "pin_helpers", None))
        and getattr(getattr(sandbox, "spec", None), "cpu_time_s", None) is None
        and os.geteuid() == 0
    )


def grade_warm(
    sandbox: Any, spec: HarnessSpec, cores: tuple[int, ...], timeout_s: float
) -> tuple[bytes | None, ExecResult] | None:
    """Grade ``spec`` with ``sandbox``'s warm judge (started if need be): the last signed report and how
    the run went, as :func:`.grading.read_report` takes them; None when no warm judge can do it now
    (the caller runs the harness afresh).
    """
    if not supported(sandbox):
        return None
    for _attempt in range(2):  # a judge found gone (a reset since) is started again, once
        judge = _take(sandbox, cores, time.monotonic() + timeout_s)
        if judge is None:
            return None
        try:
            sandbox.pin_helpers(cores)  # the judge's solutions run on this grading's grant alone
            data, run = judge.grade(spec, cores, timeout_s)
        except JudgeLost as exc:
            log.info("sandbox %s: %s; starting another", sandbox.id, exc)
            continue
        finally:
            judge.lock.release()
        if run.exit_code == -9 and not run.killed_by:  # the judge ended mid-grading: was it the sandbox?
            # Its agent killed from outside ends the judge before its bubblewrap exits: wait for that.
            problem = sandbox.health(settle_s=AGENT_DEATH_SETTLE_S)
            if problem is not None:  # an infrastructure failure, never a grade (as a cold exec raises)
                raise SandboxBroken(problem, sandbox.id)
        return data, run
    return None


def _take(sandbox: Any, cores: tuple[int, ...], deadline: float) -> WarmJudge | None:
    """The sandbox's judge, locked for one grading (started now if it has none); None if it cannot be
    had. Gradings of one sandbox wait for each other: a harness run beside the judge's grading would
    be killed by its end (every process of the sandbox's user is).
    """
    launch_s = min(LAUNCH_TIMEOUT_S, deadline - time.monotonic())
    with _lock:
        for key, (ref, held) in list(_judges.items()):
            if ref() is None and not held.lock.locked():  # its sandbox is gone
                held.close()
                del _judges[key]
        entry = _judges.get(sandbox.id)
        if entry is not None and entry[0]() is sandbox:
            judge = entry[1]
        elif launch_s < 1.0:
            return None  # too little time left to start one (not a refusal: the next grading may)
        else:
            judge = WarmJudge(None)
            judge.lock.acquire()
            _judges[sandbox.id] = (weakref.ref(sandbox), judge)
            entry = None
    if entry is not None:
        if not judge.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return None
        if judge.usable:
            return judge
        if judge.refused or min(LAUNCH_TIMEOUT_S, deadline - time.monotonic()) < 1.0:
            judge.lock.release()
            return None
    try:
        launched = _launch(sandbox, cores, min(LAUNCH_TIMEOUT_S, deadline - time.monotonic()))
    except BaseException:
        judge.lock.release()
        raise
    if launched is not None:
        judge.conn, judge.pidfd = launched
    else:
        judge.refused = True
        judge.lock.release()
        return None
    return judge


def _launch(sandbox: Any, cores: tuple[int, ...], timeout_s: float) -> tuple[socket.socket, int] | None:
    """Start a judge in ``sandbox``: the connection to it and its pidfd (None if it cannot be had)."""
    inner = f"/tmp/.tangram-judge-{secrets.token_hex(8)}.sock"
    host = sandbox.host_path(inner)
    if len(host.encode()) > _SOCKET_PATH_MAX:
        return None
    owner = os.stat(sandbox.host_path("/tmp"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(host)
        os.chmod(host, 0o600)  # root's: the sandbox's user cannot connect
        listener.listen(4)
        argv, stdin = serve_invocation(inner, owner.st_uid, owner.st_gid)
        run = sandbox.exec(argv, stdin=stdin, timeout_s=timeout_s, cores=cores, background=True, as_root=True)
        if not run.ok:
            log.warning("no warm judge in %s (exit %s): %s", sandbox.id, run.exit_code, run.stderr[-300:])
            return None
        listener.settimeout(1.0)  # the judge connected before its first process exited
        while True:
            conn, _ = listener.accept()
            pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid == 0:
                conn.settimeout(None)
                log.info("a warm judge started in sandbox %s (%.0f ms)", sandbox.id, 1e3 * run.wall_s)
                return conn, os.pidfd_open(pid)
            conn.close()
    except (OSError, TimeoutError) as exc:
        log.warning("sandbox %s: no warm judge: %s", sandbox.id, exc)
        return None
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(host)
