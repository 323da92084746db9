"""Linux calls Python lacks, through libc: tmpfs mounts, and emptying an IPC namespace (microseconds
each).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

_MS_NOSUID = 2
_MS_NODEV = 4
_MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_CLONE_NEWIPC = 0x08000000
_IPC_RMID = 0


def mount_tmpfs(target: str, *, size_bytes: int, uid: int, gid: int, mode: int = 0o700) -> None:
    """Mount a fresh tmpfs of at most ``size_bytes`` at ``target``, owned by ``uid:gid``."""
    options = f"size={size_bytes},uid={uid},gid={gid},mode={mode:o},nr_inodes={max(1024, size_bytes // 4096)}"
    rc = _libc.mount(b"tangram", target.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options.encode())
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {target}: {os.strerror(err)}")


def unmount(target: str) -> None:
    """Detach the mount at ``target`` (lazily, so a file still open there cannot block it)."""
    rc = _libc.umount2(target.encode(), _MNT_DETACH)
    if rc != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # not a mount point (any more): nothing to do
            raise OSError(err, f"umount {target}: {os.strerror(err)}")


def is_mount_point(path: str) -> bool:
    """Whether ``path`` is a mount point (its device differs from its parent's)."""
    try:
        return os.path.ismount(path)
    except OSError:
        return False


def can_mount_tmpfs(scratch_dir: str) -> bool:
    """Whether this process can mount (and unmount) a tmpfs under ``scratch_dir`` (tried once)."""
    probe = os.path.join(scratch_dir, f".mount-probe-{os.getpid()}")
    try:
        os.makedirs(probe, exist_ok=True)
        mount_tmpfs(probe, size_bytes=1 << 20, uid=os.getuid(), gid=os.getgid())
        unmount(probe)
        return True
    except OSError:
        return False
    finally:
        try:
            os.rmdir(probe)
        except OSError:
            pass


def clear_sysv_ipc(pid: int) -> int:
    """Remove every SysV shared memory segment, message queue and semaphore set of the IPC namespace
    ``pid`` is in; return how many. This thread enters that namespace for the while (a namespace of a
    thread alone), and needs the privileges to remove other users' objects there (root on the host).
    """
    own = os.open("/proc/thread-self/ns/ipc", os.O_RDONLY)
    try:
        target = os.open(f"/proc/{pid}/ns/ipc", os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            removed = 0
            for table, remove in (
                ("shm", lambda i: _libc.shmctl(i, _IPC_RMID, None)),
                ("msg", lambda i: _libc.msgctl(i, _IPC_RMID, None)),
                ("sem", lambda i: _libc.semctl(i, 0, _IPC_RMID)),
            ):
                with open(f"/proc/sysvipc/{table}") as listing:  # this thread's namespace's
                    ids = [int(line.split()[1]) for line in listing.readlines()[1:] if line.strip()]
                for ipc_id in ids:
                    if remove(ipc_id) != 0 and ctypes.get_errno() not in (errno.EINVAL, errno.EIDRM):
                        err = ctypes.get_errno()
                        raise OSError(err, f"removing {table} {ipc_id}: {os.strerror(err)}")
                    removed += 1
            return removed
        finally:
            _setns(own)
    finally:
        os.close(own)


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWIPC) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")
