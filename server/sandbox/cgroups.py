"""Linux control groups (v1) for sandboxes: memory, process count, CPU quota and pinning, CPU usage.

Each sandbox gets a group per controller, nested under the group this process already runs in (so
a delegation from a container or service manager is respected); an exec on granted cores gets a
child group in ``cpuset`` and ``cpu`` that pins it and caps its quota. Only v1 hierarchies are used;
where a controller is missing or not writable, callers fall back to rlimits and affinity.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: The controllers a sandbox can use, in the order they are joined.
CONTROLLERS = ("memory", "pids", "cpu", "cpuset", "cpuacct")
#: The period of the CFS quota we write (microseconds); the quota is ``cores * period``.
CFS_PERIOD_US = 100_000


def _parse_mounts(mountinfo: str) -> dict[str, tuple[str, str]]:
    """Controller -> (mount point, root of the mount inside the hierarchy), from ``/proc/self/mountinfo``."""
    found: dict[str, tuple[str, str]] = {}
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] != "cgroup":
            continue
        root, mount_point = fields[3], fields[4]
        for option in tail[2].split(","):
            if option in CONTROLLERS and option not in found:
                found[option] = (mount_point, root)
    return found


def _parse_own(proc_cgroup: str) -> dict[str, str]:
    """Controller -> this process's group path, from ``/proc/self/cgroup``."""
    own: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(","):
            if controller in CONTROLLERS:
                own[controller] = parts[2]
    return own


@dataclass(frozen=True)
class CgroupLayout:
    """Where our sandbox groups live, per controller: ``<mount>/<our group>/tangram``."""

    bases: dict[str, str]

    @classmethod
    def discover(cls) -> CgroupLayout:
        """The v1 controllers mounted here whose sandbox base we can create and write."""
        try:
            with open("/proc/self/mountinfo") as f:
                mounts = _parse_mounts(f.read())
            with open("/proc/self/cgroup") as f:
                own = _parse_own(f.read())
        except OSError:
            return cls({})
        bases: dict[str, str] = {}
        for controller, (mount_point, root) in mounts.items():
            path = own.get(controller, "/")
            # Inside a container the mount's root is our own group's ancestor: strip it.
            if root != "/" and path.startswith(root):
                path = path[len(root) :] or "/"
            base = os.path.join(mount_point, path.lstrip("/"), "tangram")
            if _prepare_base(controller, base):
                bases[controller] = base
        return cls(bases)

    def has(self, controller: str) -> bool:
        """Whether sandbox groups can be made for ``controller``."""
        return controller in self.bases

    def group(self, name: str, controllers: Iterable[str] | None = None) -> CgroupGroup:
        """Create the group ``name`` under our base in each available controller (or those named)."""
        wanted = [c for c in (controllers or CONTROLLERS) if c in self.bases]
        return CgroupGroup.create({c: os.path.join(self.bases[c], name) for c in wanted})


def _prepare_base(controller: str, base: str) -> bool:
    try:
        os.makedirs(base, exist_ok=True)
        if controller == "cpuset":
            _inherit_cpuset(base)
        probe = os.path.join(base, f"probe-{os.getpid()}")
        os.mkdir(probe)
        os.rmdir(probe)
        return True
    except OSError as exc:
        log.debug("cgroup controller %s unusable at %s: %s", controller, base, exc)
        return False


def _inherit_cpuset(path: str) -> None:
    """A new v1 cpuset group starts empty: give it its parent's CPUs and memory nodes."""
    parent = os.path.dirname(path)
    for name in ("cpuset.cpus", "cpuset.mems"):
        with open(os.path.join(path, name)) as f:
            if f.read().strip():
                continue
        with open(os.path.join(parent, name)) as f:
            value = f.read().strip()
        _write(os.path.join(path, name), value)


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def format_cpus(cores: Iterable[int]) -> str:
    """CPU ids in the kernel's list format (``0,2,5``)."""
    return ",".join(str(c) for c in sorted(set(cores)))


class CgroupGroup:
    """One group, present in several controllers (``controller -> directory``)."""

    def __init__(self, paths: dict[str, str]) -> None:
        self.paths = dict(paths)
        self._written: dict[tuple[str, str], str] = {}

    @classmethod
    def create(cls, paths: dict[str, str]) -> CgroupGroup:
        """Make the directories (a leftover group of the same name is reused)."""
        group = cls(paths)
        try:
            for controller, path in paths.items():
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path)
                if controller == "cpuset":
                    _inherit_cpuset(path)
        except OSError:
            group.remove()
            raise
        return group

    def has(self, controller: str) -> bool:
        """Whether this group exists in ``controller``."""
        return controller in self.paths

    def write(self, controller: str, name: str, value: str | int) -> None:
        """Write one control file."""
        _write(os.path.join(self.paths[controller], name), str(value))

    def configure(self, controller: str, name: str, value: str | int) -> None:
        """Write a control file unless this object already wrote that value there."""
        key = (controller, name)
        if self._written.get(key) != str(value):
            self.write(controller, name, value)
            self._written[key] = str(value)

    def read(self, controller: str, name: str) -> str:
        """Read one control file ('' if the group or file is gone)."""
        try:
            with open(os.path.join(self.paths[controller], name)) as f:
                return f.read()
        except (OSError, KeyError):
            return ""

    def counter(self, controller: str, name: str, key: str) -> int:
        """A ``key value`` line from a flat-keyed file such as ``memory.oom_control`` (0 if absent)."""
        for line in self.read(controller, name).splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == key:
                return int(parts[1])
        return 0

    def procs_files(self, controllers: Iterable[str] | None = None) -> list[str]:
        """The ``cgroup.procs`` files to write a pid to, to move it into this group (in ``controllers``)."""
        wanted = self.paths if controllers is None else [c for c in controllers if c in self.paths]
        return [os.path.join(self.paths[c], "cgroup.procs") for c in wanted]

    def pids(self) -> set[int]:
        """Processes in the group, in any of its controllers."""
        found: set[int] = set()
        for path in self.paths.values():
            with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.procs")) as f:
                found.update(int(x) for x in f.read().split())
        return found

    def kill_all(self, timeout_s: float = 2.0) -> bool:
        """SIGKILL every process in the group until it is empty; False if some survived ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.pids()
            if not pids:
                return True
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)

    def remove(self, timeout_s: float = 2.0) -> bool:
        """Delete the group's directories (killing what is left in it); False if one stayed."""
        ok = True
        for path in self.paths.values():
            deadline = time.monotonic() + timeout_s
            while os.path.isdir(path):
                try:
                    os.rmdir(path)
                except OSError as exc:
                    if exc.errno == errno.ENOENT:
                        break
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        log.warning("cannot remove cgroup %s: %s", path, exc)
                        ok = False
                        break
                    # Busy: processes are still leaving (or a child group exists).
                    self.kill_all(0.1)
                    time.sleep(0.002)
        return ok
