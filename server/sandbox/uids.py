"""Leases on user ids for sandboxes: each live sandbox runs its code as a uid no other process uses.

A lease is an exclusive ``flock`` on a file named after the uid. The lock dies with its holder, so a
crashed server's uids become free again without any clean-up, and forked children keep it alive.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile

from tangram_env.sandbox import SandboxUnavailable


class UidLeases:
    """Hands out uids in ``[base, base + count)``; ``lease`` returns the uid and the lock's fd."""

    def __init__(self, base: int = 3_000_000, count: int = 4096, lock_dir: str | None = None) -> None:
        if base <= 0 or count <= 0 or base + count > 2**31:
            raise ValueError(f"bad uid range {base}..{base + count}")
        self.base = base
        self.count = count
        self.lock_dir = lock_dir or os.path.join(tempfile.gettempdir(), f"tangram-uids-{os.geteuid()}")
        os.makedirs(self.lock_dir, mode=0o700, exist_ok=True)
        self._next = 0

    def lease(self) -> tuple[int, int]:
        """A free uid and the fd that holds it (close it, or call :meth:`release`, to free the uid).

        Free means unlocked and run by no process: a crashed server's lock is gone at once, but the
        processes its sandboxes left may run on until they are cleaned up, and a sandbox given their
        uid could be signalled, traced and read by them.
        """
        running = _uids_running()
        for step in range(self.count):
            uid = self.base + (self._next + step) % self.count
            if uid in running:
                continue
            fd = os.open(os.path.join(self.lock_dir, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._next = (self._next + step + 1) % self.count
            return uid, fd
        raise SandboxUnavailable(f"all {self.count} sandbox uids from {self.base} are in use")

    @staticmethod
    def release(fd: int) -> None:
        """Give the uid held by ``fd`` back."""
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            os.close(fd)


def _uids_running() -> set[int]:
    """The uids processes on this host run as now (the owner of ``/proc/PID`` is its effective uid)."""
    found = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):  # it ended meanwhile
                found.add(entry.stat(follow_symlinks=False).st_uid)
    return found
