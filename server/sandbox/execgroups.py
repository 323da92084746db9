"""Per-exec cgroups of one sandbox, kept as numbered slots that any process may claim for one exec.

An exec needs a group of its own (to count its CPU time and to pin it to its cores), but making one
costs tens of milliseconds on a busy host, and every action runs in a new forked child. So a
sandbox keeps slots ``<id>.0``, ``<id>.1``, ... made once; an exec claims a free slot with an
exclusive ``flock`` on the slot's lock file (released when it ends, or when its process dies) and
only makes a new slot when all are busy.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass

from tangram_env.server.sandbox.cgroups import CgroupGroup, CgroupLayout

EXEC_CONTROLLERS = ("cpuacct", "cpuset", "cpu")


@dataclass
class Claim:
    """A slot held by this process for one exec."""

    group: CgroupGroup
    lock_fd: int


class ExecSlots:
    """The exec groups of the sandbox ``sandbox_id``; lock files live in ``lock_dir``."""

    def __init__(self, layout: CgroupLayout, sandbox_id: str, lock_dir: str) -> None:
        self.controllers = tuple(c for c in EXEC_CONTROLLERS if layout.has(c))
        self.layout = layout
        self.sandbox_id = sandbox_id
        self.lock_dir = lock_dir

    @property
    def enabled(self) -> bool:
        """Whether any per-exec controller is available."""
        return bool(self.controllers)

    def _group(self, index: int) -> CgroupGroup:
        paths = self.layout.paths(f"{self.sandbox_id}.{index}", self.controllers)
        return CgroupGroup(paths, self.layout.version)

    def prepare(self, count: int = 1) -> None:
        """Make the first ``count`` slots now (a warm sandbox's first exec then pays nothing)."""
        os.makedirs(self.lock_dir, mode=0o700, exist_ok=True)
        for index in range(count):
            self._make(index)

    def _make(self, index: int) -> CgroupGroup:
        group = self.layout.group(f"{self.sandbox_id}.{index}", self.controllers)
        with open(os.path.join(self.lock_dir, f"{index}.lock"), "a"):
            pass
        return group

    def claim(self) -> Claim | None:
        """A free, empty slot, locked for this process (a new slot if every one is busy)."""
        if not self.enabled:
            return None
        index = 0
        while True:
            path = os.path.join(self.lock_dir, f"{index}.lock")
            exists = os.path.exists(path)
            group = self._group(index) if exists else self._make(index)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                index += 1
                continue
            # Free, but the last exec's pid namespace may still be dying in it: wait for it briefly.
            if group.pids() and not group.kill_all(0.5):
                os.close(fd)
                index += 1
                continue
            return Claim(group, fd)

    def reap_unclaimed(self) -> bool:
        """Kill what is left in every slot no process holds (its exec's owner died mid-command).

        False if something survived SIGKILL.
        """
        ok = True
        for index in self._indices():
            try:
                fd = os.open(os.path.join(self.lock_dir, f"{index}.lock"), os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # a running exec's: its owner kills what it leaves
            try:
                group = self._group(index)
                ok = (not group.pids() or group.kill_all(2.0)) and ok
            finally:
                os.close(fd)
        return ok

    @staticmethod
    def release(claim: Claim) -> None:
        """Give the slot back (its processes are dead or dying: the next claim checks)."""
        with contextlib.suppress(OSError):
            fcntl.flock(claim.lock_fd, fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            os.close(claim.lock_fd)

    def groups(self) -> list[CgroupGroup]:
        """Every slot's group."""
        return [self._group(i) for i in self._indices()]

    def remove_all(self) -> bool:
        """Kill what is in any slot and delete every slot's group; False if one could not be removed."""
        ok = True
        for index in self._indices():
            ok = self._group(index).remove() and ok
        return ok

    def _indices(self) -> list[int]:
        found: set[int] = set()
        with contextlib.suppress(FileNotFoundError):
            found.update(int(n.split(".")[0]) for n in os.listdir(self.lock_dir) if n.endswith(".lock"))
        found.update(self.layout.slot_indices(self.sandbox_id))
        return sorted(found)
