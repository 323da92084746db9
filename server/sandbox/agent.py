"""The exec agent: the one long-lived process of a local sandbox, which starts its commands.

It runs inside the sandbox's bubblewrap (started once, when the sandbox is made) as the sandbox's
root, holding only the capabilities it needs to become the commands' user (``CAP_SETUID``,
``CAP_SETGID``, ``CAP_SETPCAP``, ``CAP_DAC_READ_SEARCH``); commands run as the sandbox's own uid, so
no command can signal, trace or read it. Standard library only: the server runs this file's source
with the host's ``/usr/bin/python3 -I -S -c`` (the sandbox sees the host's ``/usr``), with the
arguments ``LISTEN_FD LIFELINE_FD UID GID``.

Protocol, over a unix stream socket that only the server can reach (the listening socket is bound on
the host, outside the sandbox's view, and handed in as ``LISTEN_FD``); one connection per command:

1. server -> agent, in one message: a 4-byte little-endian length ``n``, carrying file descriptors
   (``SCM_RIGHTS``: the command's stdin, stdout and stderr, then the ``tasks`` files of the
   command's own exec group, opened by the server for writing; on cgroup v2 its ``cgroup.procs``),
   then ``n`` bytes of JSON ``{"argv": [...], "env": {...}, "cwd": "...", "join": N, "cores": [...],
   "rlimits": [[RESOURCE, SOFT, HARD], ...], "oom_score_adj": N}`` (``join``: how many ``tasks``
   descriptors came), and ``"as_root": true`` for a command that keeps the agent's uid and
   capabilities (asked only by the server's own tools). The connection is accepted by the agent's
   spare child, forked before the command arrived (so no fork is on the command's path), which
   becomes the command's process.
2. The child places itself before it runs anything of the command: it writes ``0`` (its own, only
   thread) to each ``tasks`` descriptor (the kernel checks a move against the credentials of the
   file's opener: the server, which opened only this exec's group; moving itself, one thread, the
   kernel takes no global lock, where moving a process waits for an RCU grace period after a quiet
   spell; v2 moves whole processes only, and since Linux 5.16 checks the opener's cgroup namespace,
   not the child's, which is rooted at the agent's group), closes them, raises its OOM score, pins
   itself to ``cores`` and sets its rlimits (no higher than the agent's own hard limits). It then
   hands the connection and its ends of the output pipes to the agent (a socket pair, and an eventfd
   to wake the agent: see ``Spare``), whatever happens next, so that the agent can report. Then it
   drops to the commands' uid (no groups, no capabilities in any set, ``no_new_privs``; with
   ``as_root`` only ``no_new_privs``), closes every other descriptor and execs the command. If the
   server has closed the connection by then (it gave up on the command), the child exits instead; if
   placing fails, it sends ``F`` and why, and exits without running anything.
3. agent -> server: ``X`` and the wait status, user and system CPU seconds (``<idd``) once the
   command's first process has exited; the agent then closes the connection and its ends of the
   output pipes (so the report comes before their end of file, and the server can read a short
   command's output once, on the report).

Time limits, output caps and the killing of what a command leaves behind stay with the server, which
holds the other ends of the pipes and the cgroups. When the lifeline (a pipe whose write end only the
server holds) reaches its end, the server is gone, and nothing enforces a command's limits any more:
the agent kills every process of the sandbox but the namespace's init (see ``end_sandbox``), then
exits; the init, bubblewrap's, which waits for every process of the namespace, then has none left
and ends the namespace. (Exiting alone would not do: a running command, or what it left, kept the
namespace and its mounts alive, past every limit.) The host's side (mounts, cgroups, the sandbox's
directory) is removed by the next server that starts on the same state directory. A spare that dies
without a command ends the agent too: the sandbox is then broken (the server, alive, kills the rest).
"""

import contextlib
import ctypes
import errno
import json
import os
import resource
import select
import selectors
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
_PR_CAPBSET_READ = 23
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CAP_VERSION_3 = 0x20080522
_STATUS = struct.Struct("<idd")
#: Descriptors a request may carry: stdin, stdout, stderr and a few cgroup ``tasks`` files.
_MAX_FDS = 8
#: What a spare reads of a request at first: all of a usual one.
_FIRST_READ = 1 << 16
#: The longest report of a failed placement.
_MAX_FAILURE = 500
#: How long a command runs before its spare's successor is forked anyway (for commands that overlap):
#: a short command ends first, and the fork then does not compete with it for a core.
_SPARE_DELAY_S = 0.005
#: After a failed fork (the sandbox at its pids limit), when to try again.
_SPARE_RETRY_S = 0.05
#: Once the server is gone, how long the agent goes on killing what is left of the sandbox (processes in
#: uninterruptible sleep die when they wake) before it exits anyway.
_END_S = 5.0
#: A request of a usual shape and size: decoded once by each spare as it starts (see ``rehearse``).
_WARM_UP = json.dumps(
    {
        "argv": ["bash", "-c", "a" * 64],
        "env": {f"NAME_{i}": "v" * 48 for i in range(12)},
        "cwd": "/workspace",
        "join": 2,
        "cores": [0, 1],
        "rlimits": [[r, 1 << 30, 1 << 30] for r in range(8)],
        "oom_score_adj": 500,
    }
).encode()


class Privileges:
    """Dropping to the commands' user, prepared once in the agent so that each forked child only runs
    the system calls (no library look-ups, no probing of capabilities the agent never had).
    """

    def __init__(self, uid: int, gid: int) -> None:
        self.uid, self.gid = uid, gid
        libc = ctypes.CDLL(None, use_errno=True)
        self.prctl = libc.prctl
        self.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        self.capset = libc.capset
        self.cap_header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
        self.cap_data = (ctypes.c_uint32 * 6)()
        # Nothing the agent lacks can come back through its bounding set (the agent never execs):
        # shrinking it once here leaves each child only the agent's own few capabilities to drop.
        permitted, bounding = capability_sets()
        for cap in bounding - permitted:
            self._drop_bounding(cap)
        self.bounding = sorted(bounding & permitted)

    def _drop_bounding(self, cap: int) -> None:
        if self.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "cannot drop the capability bounding set")

    def drop(self) -> None:
        """Become ``uid``/``gid`` with no supplementary groups and no capabilities, for good."""
        os.setgroups([])
        os.setresgid(self.gid, self.gid, self.gid)
        for cap in self.bounding:
            self._drop_bounding(cap)
        self.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        os.setresuid(self.uid, self.uid, self.uid)
        if self.capset(self.cap_header, self.cap_data) != 0:
            raise OSError(ctypes.get_errno(), "cannot clear capabilities")
        self.forbid_new_privileges()
        if os.getuid() != self.uid or os.geteuid() != self.uid or os.getgid() != self.gid:
            raise OSError(errno.EPERM, "still privileged after dropping")

    def forbid_new_privileges(self) -> None:
        """``no_new_privs``: no exec of this process or its children can gain a privilege."""
        if self.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "cannot set no_new_privs")


def capability_sets() -> tuple[set[int], set[int]]:
    """The permitted and bounding capability sets of the agent, from ``/proc/self/status``."""
    masks = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("CapPrm", "CapBnd"):
                masks[key] = int(value, 16)
    permitted, bounding = masks["CapPrm"], masks["CapBnd"]
    return {c for c in range(64) if permitted >> c & 1}, {c for c in range(64) if bounding >> c & 1}


def exec_command(argv: list[str], env: dict[str, str]) -> None:
    """``os.execvpe`` without its per-call imports: look ``argv[0]`` up in the command's own PATH."""
    name = argv[0]
    if "/" in name:
        os.execve(name, argv, env)
    first_error: OSError | None = None
    last_error: OSError | None = None
    for directory in env.get("PATH", os.defpath).split(os.pathsep):
        try:
            os.execve(os.path.join(directory, name), argv, env)
        except (FileNotFoundError, NotADirectoryError) as exc:
            last_error = exc
        except OSError as exc:  # found but not runnable: say so rather than "not found"
            last_error = exc
            first_error = first_error or exc
    raise first_error or last_error or FileNotFoundError(errno.ENOENT, "empty PATH", name)


def read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """The next command's request and its descriptors (see the protocol above), close-on-exec."""
    fds = []
    # The server sends the whole request in one message: one read takes it (and its descriptors).
    data, ancillary, _flags, _addr = conn.recvmsg(
        _FIRST_READ, socket.CMSG_SPACE(4 * _MAX_FDS), socket.MSG_CMSG_CLOEXEC
    )
    for level, kind, chunk in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += list(struct.unpack(f"<{len(chunk) // 4}i", chunk[: len(chunk) - len(chunk) % 4]))
    try:
        message = bytearray(data)
        while len(message) < 4 or len(message) < 4 + struct.unpack_from("<I", message)[0]:
            chunk = conn.recv(1 << 20)
            if not chunk:
                raise EOFError("request cut short")
            message += chunk
        request = json.loads(message[4:])  # nothing follows a request on its connection
        if len(fds) != 3 + request.get("join", -1):
            raise ValueError(f"expected 3 + {request.get('join')} descriptors, got {len(fds)}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return request, fds


def place(request: dict, cgroup_tasks: list[int]) -> None:
    """Put this process under its exec's limits (see the protocol above), before it runs the command."""
    for fd in cgroup_tasks:
        os.write(fd, b"0")  # this thread (the process's only one) into the group the server opened
        os.close(fd)
    fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, str(request["oom_score_adj"]).encode())
    finally:
        os.close(fd)
    if request["cores"]:
        os.sched_setaffinity(0, request["cores"])
    for which, soft, hard in request["rlimits"]:
        _, ceiling = resource.getrlimit(which)  # raising it would need CAP_SYS_RESOURCE
        if ceiling != resource.RLIM_INFINITY:
            hard = ceiling if hard == resource.RLIM_INFINITY else min(hard, ceiling)
            soft = hard if soft == resource.RLIM_INFINITY else min(soft, hard)
        resource.setrlimit(which, (soft, hard))


def abandoned(conn: socket.socket) -> bool:
    """Whether the server closed the connection (it gave up on the command): nothing else comes on it."""
    poller = select.poll()
    poller.register(conn, select.POLLIN | select.POLLRDHUP)
    return bool(poller.poll(0))


def child(
    privileges: Privileges, conn: socket.socket, request: dict, fds: list[int], hand_over: Callable[[], None]
) -> None:
    """In the command's process: place itself, hand its connection to the agent, drop privileges and
    exec the command. Never returns.
    """
    code = 126
    argv = request["argv"]
    try:
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        try:
            place(request, fds[3:])
        except BaseException as exc:  # nothing of the command has run: the server's failure, not its
            conn.sendall(f"F{exc}".encode(errors="replace")[:_MAX_FAILURE], socket.MSG_NOSIGNAL)
            hand_over()
            os._exit(125)
        # Only now, on the command's own cores: the agent, woken by this, runs on another core if one
        # is idle, not on the one this process moved to (where it would hold up the exec).
        hand_over()
        if abandoned(conn):
            os._exit(125)
        os.closerange(3, 1 << 16)  # the connection, the listening socket, the lifeline
        if request.get("as_root"):  # a trusted tool's own helper (the code env's judge): keeps the
            # agent's uid and capabilities, so that the commands' uid cannot signal or trace it
            privileges.forbid_new_privileges()
        else:
            privileges.drop()
        try:
            os.chdir(request["cwd"])
        except OSError as exc:
            code = 1
            raise OSError(exc.errno, f"cannot enter {request['cwd']}: {exc.strerror}") from None
        code = 127
        exec_command(argv, request["env"])
    except BaseException as exc:  # reported on the command's stderr, like a shell would
        try:
            hand_over()
            os.write(2, f"tangram-agent: {argv[0] if code == 127 else 'exec'}: {exc}\n".encode())
        finally:
            os._exit(code)


def rehearse(privileges: Privileges, listener: socket.socket) -> None:
    """In a spare, before its command arrives: run what the command's process will run, harmlessly.

    A fresh fork shares every page with the agent; the first write to one (an object's reference
    count, an allocation) copies it, a page fault each. Taken here, those faults are off the clock:
    the request's decoding and the placement then run at the speed of a warm process.
    """
    json.loads(bytearray(_WARM_UP))  # as a request comes: bytes, their encoding to detect
    for which in (resource.RLIMIT_CORE, resource.RLIMIT_NOFILE, resource.RLIMIT_FSIZE, resource.RLIMIT_NPROC):
        resource.getrlimit(which)
    os.sched_getaffinity(0)
    poller = select.poll()
    poller.register(listener, select.POLLIN | select.POLLRDHUP)
    poller.poll(0)
    for cap in privileges.bounding:
        privileges.prctl(_PR_CAPBSET_READ, cap, 0, 0, 0)
    os.getuid(), os.geteuid(), os.getgid()


def spare(
    privileges: Privileges, listener: socket.socket, channel: socket.socket, bell: int, agent: int
) -> None:
    """In a spare child, forked before its command arrives: accept the next connection, hand it to the
    agent (which reports the exit), and become the command. Never returns.
    """
    try:
        os.setsid()
        # Gone with the agent (the sandbox's init waits for every process before it exits); dropping
        # to the commands' user clears this again, so a command is not killed by the agent's death.
        privileges.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != agent:
            os._exit(125)
        rehearse(privileges, listener)
        while True:
            try:
                conn, _ = listener.accept()
            except ConnectionAbortedError:
                continue  # reset by its client before it was accepted
            conn.settimeout(10.0)  # only the server connects; never hang on a half-sent request
            try:
                request, fds = read_request(conn)
                break
            except (OSError, ValueError, EOFError) as exc:
                sys.stderr.write(f"tangram-agent: bad request: {exc}\n")
                conn.close()
    except BaseException as exc:
        sys.stderr.write(f"tangram-agent: spare failed: {exc}\n")
        os._exit(125)
    # The connection, and the ends of the output pipes the agent holds until it has reported.
    held = struct.pack("3i", conn.fileno(), fds[1], fds[2])
    handed = False

    def hand_over() -> None:
        nonlocal handed
        if not handed:
            handed = True
            channel.sendmsg([b"T"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, held)])
            if bell >= 0:
                os.eventfd_write(bell, 1)

    child(privileges, conn, request, fds, hand_over)


def survivors() -> dict[int, int]:
    """The processes of the sandbox's pid namespace still alive, but its init and the agent: pid to
    real uid. Zombies are left out (their reaper, the init or the agent, collects them).
    """
    found = {}
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (1, me):
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rpartition(b")")[2].split()[0]
            if state in (b"Z", b"X"):
                continue
            with open(f"/proc/{name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        found[int(name)] = int(line.split()[1])
                        break
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return found


def end_sandbox(uid: int) -> None:
    """The server is gone: kill every process of the sandbox (but the namespace's init), so that the
    namespace ends once the agent exits.

    ``kill(-1, SIGKILL)`` reaches every process of the caller's pid namespace (and those below it)
    that the caller may signal, except the init and itself, and, like a fork, is atomic with respect
    to the process list: a fork bomb cannot outrun it. The agent holds no ``CAP_KILL``; a signal is
    allowed where the sender's real or effective uid is the target's real or saved uid. With its real
    uid still root and its effective uid the commands', one call reaches both the agent's own
    children (spares, trusted helpers) and everything run as the commands' uid, whatever reparented
    where. A process left of another uid (a trusted helper may change its own) is reached the same
    way, with that uid as the effective one. Repeated until nothing is left alive, at most
    ``_END_S``; nothing here waits on anything a command does. Only as the first process of a pid
    namespace of its own (bubblewrap's ``--unshare-pid``, the agent's pid 2 under the namespace's
    init): anywhere else ``kill(-1)`` would reach far beyond the sandbox.
    """
    if os.getpid() != 2 or os.getppid() != 1:
        sys.stderr.write("tangram-agent: not in a pid namespace of its own: killing nothing\n")
        return
    targets = {uid}
    deadline = time.monotonic() + _END_S
    while True:
        for target in sorted(targets):
            try:
                os.setresuid(-1, 0, -1)  # the effective uid back to root (its real uid), capabilities too
                os.setresuid(-1, target, -1)  # the real uid stays root: its processes are reached as well
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                return  # no other process in the namespace at all
            except OSError:
                pass  # PermissionError: none of these uids left, another may be
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        left = survivors()
        if not left:
            return
        if time.monotonic() >= deadline:
            sys.stderr.write(f"tangram-agent: still alive after the server died: {sorted(left)}\n")
            return
        targets.update(left.values())
        time.sleep(0.01)  # killed processes die as they are next scheduled


class Spare:
    """A forked child of the agent: waiting for a command, or running the one it took."""

    def __init__(self, privileges: Privileges, listener: socket.socket) -> None:
        self.channel, theirs = socket.socketpair()
        # Rung by the spare once it has handed its command over on ``channel``. An eventfd wakes the
        # agent on an idle core; the socket's own wake-up would pull it onto the command's (a wake-up
        # by a socket tells the scheduler the sender is about to sleep, which a command is not).
        self.bell = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK) if hasattr(os, "eventfd") else -1
        agent = os.getpid()
        self.pid = os.fork()
        if self.pid == 0:
            self.channel.close()
            spare(privileges, listener, theirs, self.bell, agent)
        theirs.close()
        self.pidfd = os.pidfd_open(self.pid)
        self.conn: socket.socket | None = None
        self.outputs: list[int] = []  # the command's stdout and stderr: closed once it is reported
        self.reported = False

    @property
    def took_fd(self) -> int:
        """Readable once the spare has taken a command."""
        return self.bell if self.bell >= 0 else self.channel.fileno()

    def take(self) -> bool:
        """Collect the connection of the command this spare took; False if it took none (it died)."""
        if self.conn is None:
            with contextlib.suppress(BlockingIOError, InterruptedError):
                _, ancillary, _flags, _addr = self.channel.recvmsg(
                    1, socket.CMSG_SPACE(3 * 4), socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC
                )
                for level, kind, data in ancillary:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS and len(data) >= 12:
                        conn, *self.outputs = struct.unpack("3i", data[:12])
                        self.conn = socket.socket(fileno=conn)
        return self.conn is not None

    def report(self) -> bool:
        """Reap the process and send its exit to the server; False if it had taken no command."""
        _, status, usage = os.wait4(self.pid, 0)
        self.reported = True
        took = self.take()
        if self.conn is not None:  # the report first: the server is waiting for it
            with contextlib.suppress(OSError):  # the server stopped waiting (it killed the command, or died)
                self.conn.sendall(
                    b"X" + _STATUS.pack(status, usage.ru_utime, usage.ru_stime), socket.MSG_NOSIGNAL
                )
            self.conn.close()
        for fd in self.outputs:
            os.close(fd)
        os.close(self.pidfd)
        if self.bell >= 0:
            os.close(self.bell)
        self.channel.close()
        return took


def main(args: list[str]) -> None:
    """Keep a spare child waiting for the next command until the lifeline ends."""
    listen_fd, lifeline, uid, gid = (int(a) for a in args)
    privileges = Privileges(uid, gid)
    # Every signal at its default and unblocked here already, so that no child has to reset one
    # before its exec (the agent's own writes to a closed connection are sent with MSG_NOSIGNAL
    # instead). Not only Python's own handlers: a server started under nohup, or as a background job
    # of a script, ignores SIGHUP, SIGINT or SIGQUIT, and commands would inherit that (a test that
    # interrupts itself would then fail, and its reward with it).
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            with contextlib.suppress(OSError, ValueError):  # signals the C library keeps for itself
                signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    listener = socket.socket(fileno=listen_fd)
    sel = selectors.DefaultSelector()
    sel.register(lifeline, selectors.EVENT_READ, None)
    waiting: Spare | None = None
    due = 0.0  # when to fork the next spare, while none waits
    failing = False  # the last fork failed (logged once per spell)
    while True:
        if waiting is None and time.monotonic() >= due:
            try:
                waiting = Spare(privileges, listener)
            except OSError as exc:  # at the pids limit: again once a command ends, or shortly
                if not failing:
                    sys.stderr.write(f"tangram-agent: cannot fork a spare: {exc}\n")
                failing = True
                due = time.monotonic() + _SPARE_RETRY_S
            else:
                failing = False
                sel.register(waiting.took_fd, selectors.EVENT_READ, waiting)
                sel.register(waiting.pidfd, selectors.EVENT_READ, waiting)
        timeout = None if waiting else max(0.0, due - time.monotonic())
        for key, _ in sel.select(timeout):
            process: Spare | None = key.data
            if process is None:  # the lifeline ended: the server is gone, and no limit holds any more
                end_sandbox(uid)
                return
            if process.reported:
                continue  # it took its command and exited within one round: reported already
            if key.fd == process.pidfd:
                sel.unregister(process.pidfd)
                with contextlib.suppress(KeyError):  # unless its hand-over was seen first
                    sel.unregister(process.took_fd)
                if process is waiting:
                    waiting = None
                if not process.report():
                    sys.stderr.write("tangram-agent: a spare died before it took a command\n")
                    return  # killed from outside, or broken: the sandbox is, too
                due = 0.0  # a command ended: the next spare now, while the server reads its output
                # The report woke the server with a hint that this process would now sleep: often onto
                # this core, where it would wait for the fork below. Let it run first.
                os.sched_yield()
                continue
            sel.unregister(process.took_fd)  # it took a command: the next spare once it ends
            process.take()
            if process is waiting:
                waiting = None
                due = time.monotonic() + _SPARE_DELAY_S


if __name__ == "__main__":
    main(sys.argv[1:])
