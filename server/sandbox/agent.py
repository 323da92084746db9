"""The exec agent: the one long-lived process of a local sandbox, which starts its commands.

It runs inside the sandbox's bubblewrap (started once, when the sandbox is made) as the sandbox's
root, holding only the capabilities it needs to become the commands' user (``CAP_SETUID``,
``CAP_SETGID``, ``CAP_SETPCAP``, ``CAP_DAC_READ_SEARCH``); commands run as the sandbox's own uid, so
no command can signal, trace or read it. Standard library only: the server runs this file's source
with the host's ``/usr/bin/python3 -I -S -c`` (the sandbox sees the host's ``/usr``), with the
arguments ``LISTEN_FD LIFELINE_FD UID GID``.

Protocol, over a unix stream socket that only the server can reach (the listening socket is bound on
the host, outside the sandbox's view, and handed in as ``LISTEN_FD``); one connection per command:

1. server -> agent: a 4-byte little-endian length ``n``, carrying four file descriptors
   (``SCM_RIGHTS``: the command's stdin, stdout and stderr, and a "go" pipe's read end), then ``n``
   bytes of JSON ``{"argv": [...], "env": {...}, "cwd": "..."}``, and ``"as_root": true`` for a
   command that keeps the agent's uid and capabilities (asked only by the server's own tools).
2. The agent forks. The child sends ``P`` (the kernel attaches its pid, as the server sees it, with
   ``SCM_CREDENTIALS``) and waits on the go pipe while the server moves it into the exec's cgroups,
   pins it to its cores and sets its rlimits from outside.
3. server -> child: ``G`` on the go pipe. The child drops to the commands' uid (no groups, no
   capabilities in any set, ``no_new_privs``; with ``as_root`` only ``no_new_privs``), closes every
   other descriptor and execs the command.
   End of file on the go pipe instead: the child exits without running anything.
4. agent -> server: ``X`` and the wait status, user and system CPU seconds (``<idd``) once the
   command's first process has exited; the agent then closes the connection.

Time limits, output caps and the killing of what a command leaves behind stay with the server, which
holds the other ends of the pipes and the cgroups. When the lifeline (a pipe whose write end only the
server holds) reaches its end, the server is gone: the agent exits, and with it the sandbox's pid
namespace and everything in it.
"""

import ctypes
import errno
import json
import os
import selectors
import signal
import socket
import struct
import sys

_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CAP_VERSION_3 = 0x20080522
_STATUS = struct.Struct("<idd")


def drop_privileges(libc: ctypes.CDLL, uid: int, gid: int) -> None:
    """Become ``uid``/``gid`` with no supplementary groups and no capabilities, for good."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    for cap in range(64):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            if ctypes.get_errno() == errno.EINVAL:
                break  # past the last capability this kernel knows
            raise OSError(ctypes.get_errno(), "cannot drop the capability bounding set")
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    os.setresuid(uid, uid, uid)
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:
        raise OSError(ctypes.get_errno(), "cannot clear capabilities")
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "cannot set no_new_privs")
    if os.getuid() != uid or os.geteuid() != uid or os.getgid() != gid:
        raise OSError(errno.EPERM, "still privileged after dropping")


def read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """The next command's request and its four descriptors (see the protocol above)."""
    fds = []
    head, ancillary, _flags, _addr = conn.recvmsg(4, socket.CMSG_SPACE(4 * 4))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += list(struct.unpack(f"<{len(data) // 4}i", data[: len(data) - len(data) % 4]))
    if len(head) < 4:
        head += conn.recv(4 - len(head), socket.MSG_WAITALL)
    (size,) = struct.unpack("<I", head)
    body = bytearray()
    while len(body) < size:
        chunk = conn.recv(min(1 << 20, size - len(body)))
        if not chunk:
            raise EOFError("request cut short")
        body += chunk
    if len(fds) != 4:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected 4 descriptors, got {len(fds)}")
    return json.loads(body), fds


def child(libc: ctypes.CDLL, conn: socket.socket, request: dict, fds: list[int], uid: int, gid: int) -> None:
    """In the forked child: wait to be placed, drop privileges, exec the command. Never returns."""
    code = 126
    argv = request["argv"]
    try:
        os.setsid()
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        go = fds[3]
        conn.sendall(b"P")  # the kernel attaches this process's credentials
        if os.read(go, 1) != b"G":
            os._exit(125)
        os.closerange(3, 1 << 16)  # the connection, the listening socket, the lifeline, the go pipe
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        if request.get("as_root"):  # a trusted tool's own helper (the code env's judge): keeps the
            # agent's uid and capabilities, so that the commands' uid cannot signal or trace it
            if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "cannot set no_new_privs")
        else:
            drop_privileges(libc, uid, gid)
        try:
            os.chdir(request["cwd"])
        except OSError as exc:
            code = 1
            raise OSError(exc.errno, f"cannot enter {request['cwd']}: {exc.strerror}") from None
        code = 127
        os.execvpe(argv[0], argv, request["env"])
    except BaseException as exc:  # reported on the command's stderr, like a shell would
        try:
            os.write(2, f"tangram-agent: {argv[0] if code == 127 else 'exec'}: {exc}\n".encode())
        finally:
            os._exit(code)


def main(args: list[str]) -> None:
    """Accept commands until the lifeline ends."""
    listen_fd, lifeline, uid, gid = (int(a) for a in args)
    libc = ctypes.CDLL(None, use_errno=True)
    listener = socket.socket(fileno=listen_fd)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(lifeline, selectors.EVENT_READ, "lifeline")
    running: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)
    while True:
        for key, _ in sel.select():
            if key.data == "lifeline":
                return
            if key.data == "accept":
                conn, _ = listener.accept()
                conn.settimeout(10.0)  # only the server connects; never hang on a half-sent request
                try:
                    request, fds = read_request(conn)
                except (OSError, ValueError, EOFError) as exc:
                    sys.stderr.write(f"tangram-agent: bad request: {exc}\n")
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    child(libc, conn, request, fds, uid, gid)
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                running[pidfd] = (pid, conn)
                sel.register(pidfd, selectors.EVENT_READ, "exit")
            else:
                pid, conn = running.pop(key.fd)
                sel.unregister(key.fd)
                os.close(key.fd)
                _, status, usage = os.wait4(pid, 0)
                try:
                    conn.sendall(b"X" + _STATUS.pack(status, usage.ru_utime, usage.ru_stime))
                except OSError:
                    pass  # the server stopped waiting (it killed the command, or died)
                conn.close()


if __name__ == "__main__":
    main(sys.argv[1:])
