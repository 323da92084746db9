"""Linux calls Python lacks, through libc: tmpfs mounts (microseconds each)."""

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
