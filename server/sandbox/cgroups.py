"""Linux control groups for sandboxes: memory, process count, CPU quota and pinning, CPU usage.

Each sandbox gets a group nested under the group this process already runs in (so a delegation from
a container or service manager is respected); an exec on granted cores gets a group of its own that
pins it and caps its quota. Callers speak cgroup v1's file names; on a v2 (unified) hierarchy a
:class:`CgroupGroup` writes and reads the v2 files instead (``memory.max``, ``cpu.max``,
``memory.events``, ``cpu.stat`` ...), an exec's group ``<sandbox>.<n>`` is nested as
``<sandbox>/<n>`` (a process is in one group only), and the controllers are enabled down the tree
through ``cgroup.subtree_control``. Where a controller is missing or not writable, callers fall back
to rlimits and affinity.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
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


#: v2 controllers a sandbox uses (v1's ``cpuacct`` is ``cpu.stat``, present in every v2 group).
V2_CONTROLLERS = ("memory", "pids", "cpu", "cpuset")
#: Controllers an exec's own group uses (nested under its sandbox's group on v2).
EXEC_CONTROLLERS_V2 = ("cpu", "cpuset")


def _parse_v2_mount(mountinfo: str) -> tuple[str, str] | None:
    """(mount point, root of the mount) of the cgroup2 hierarchy, if one is mounted."""
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and tail and tail[0] == "cgroup2":
            return fields[4], fields[3]
    return None


def _parse_own_v2(proc_cgroup: str) -> str | None:
    """The group of this process in the unified hierarchy (the ``0::`` line of ``/proc/self/cgroup``)."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:] or "/"
    return None


@dataclass(frozen=True)
class CgroupLayout:
    """Where our sandbox groups live, per controller: ``<mount>/<our group>/tangram`` (one directory
    for every controller on v2).
    """

    bases: dict[str, str]
    version: int = 1

    @classmethod
    def discover(
        cls, mountinfo_path: str = "/proc/self/mountinfo", cgroup_path: str = "/proc/self/cgroup"
    ) -> CgroupLayout:
        """The controllers here whose sandbox base we can create and write: v1's, else v2's."""
        try:
            with open(mountinfo_path) as f:
                mountinfo = f.read()
            with open(cgroup_path) as f:
                proc_cgroup = f.read()
        except OSError:
            return cls({})
        mounts = _parse_mounts(mountinfo)
        v2 = _parse_v2_mount(mountinfo)
        own_v2 = _parse_own_v2(proc_cgroup)
        if not mounts and v2 is not None and own_v2 is not None:
            return cls._discover_v2(v2[0], v2[1], own_v2)
        own = _parse_own(proc_cgroup)
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

    @classmethod
    def _discover_v2(cls, mount_point: str, root: str, own: str) -> CgroupLayout:
        """The v2 base under our own group, with the controllers delegated to us enabled down to it.

        Enabling controllers for child groups needs a group without processes of its own. So when
        this process sits alone in its group, it first moves into a leaf ``tangram-server`` beside
        the base (what a service manager's delegation expects); when it runs as root at the top of
        its cgroup namespace (a container's group, which holds every process of the container), the
        group's processes all move into a leaf ``init`` (as Docker-in-Docker does). Another group
        shared with other processes (a login session's, where root starts a server from a shell) is
        left alone: as root, the base goes under the hierarchy's root instead, as container engines
        make their own groups; otherwise the sandboxes fall back to rlimits.
        """
        if root != "/" and own.startswith(root):
            own = own[len(root) :] or "/"
        own_dir = os.path.join(mount_point, own.lstrip("/"))
        base = os.path.join(own_dir, "tangram")
        try:
            with open(os.path.join(own_dir, "cgroup.controllers")) as f:
                offered = f.read().split()
            wanted = [c for c in V2_CONTROLLERS if c in offered]
            if not _enable(own_dir, wanted):
                shared = _procs(own_dir) - {os.getpid()}
                at_top = os.path.normpath(own_dir) == os.path.normpath(mount_point)
                if shared and os.geteuid() == 0 and not at_top:
                    log.info(
                        "cgroup v2: group %s is shared with other processes; sandbox groups go under "
                        "the hierarchy's root, %s",
                        own_dir,
                        mount_point,
                    )
                    return cls._discover_v2(mount_point, "/", "/")
                if shared and not (os.geteuid() == 0 and at_top):
                    log.info("cgroup v2: group %s is shared with other processes; not delegating", own_dir)
                    return cls({}, version=2)
                leaf = os.path.join(own_dir, "init" if shared else "tangram-server")
                if shared:
                    log.info("cgroup v2: moving the processes of %s into %s, to delegate", own_dir, leaf)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(leaf)
                if not _move_all(own_dir, leaf) or not _enable(own_dir, wanted):
                    return cls({}, version=2)
            with contextlib.suppress(FileExistsError):
                os.mkdir(base)
            enabled = wanted if _enable(base, wanted) else []
        except OSError as exc:
            log.debug("cgroup v2 unusable under %s: %s", own_dir, exc)
            return cls({}, version=2)
        # cpu.stat (v1's cpuacct.usage) is in every v2 group, with or without the cpu controller.
        return cls({c: base for c in [*enabled, "cpuacct"]}, version=2)

    def has(self, controller: str) -> bool:
        """Whether sandbox groups can be made for ``controller``."""
        return controller in self.bases

    def paths(self, name: str, controllers: Iterable[str] | None = None) -> dict[str, str]:
        """Where the group ``name`` lives per controller. A sandbox's part ``<sandbox>.<part>`` (an
        exec's ``<n>``, its agent, what it keeps in the background) nests as ``<sandbox>/<part>`` on
        v2, inside the sandbox's memory and process limits; on v1 it sits beside the sandbox's group.
        """
        wanted = [c for c in (controllers or CONTROLLERS) if c in self.bases]
        if self.version == 2:
            name = name.replace(".", "/", 1)
        return {c: os.path.join(self.bases[c], name) for c in wanted}

    def group(self, name: str, controllers: Iterable[str] | None = None) -> CgroupGroup:
        """Create the group ``name`` under our base in each available controller (or those named).

        On v2, a sandbox's group (a name without a ``.<part>``) hands the exec controllers down to
        its parts' groups, and so holds no process itself.
        """
        paths = self.paths(name, controllers)
        if self.version == 1:
            return CgroupGroup.create(paths)
        delegate = [] if "." in name else [c for c in EXEC_CONTROLLERS_V2 if c in self.bases]
        return CgroupGroup.create(paths, version=2, delegate=delegate)

    def moves_by_opener(self) -> bool:
        """v2: whether the kernel checks a move into a group against the credentials and cgroup
        namespace of whoever opened the group's ``cgroup.procs``, not of the process writing to it
        (Linux 5.16, and the stable kernels the fix went to). An exec agent's child joins its exec's
        group that way, from inside the sandbox's cgroup namespace. Probed once per base.
        """
        base = next(iter(self.bases.values()), None)
        return self.version == 2 and base is not None and _moves_by_opener(base)

    def slot_indices(self, sandbox_id: str) -> set[int]:
        """The ``n`` of every exec group ``<sandbox_id>.<n>`` that exists."""
        found: set[int] = set()
        if self.version == 2:
            for path in set(self.paths(sandbox_id).values()):
                with contextlib.suppress(OSError):
                    found.update(int(n) for n in os.listdir(path) if n.isdigit())
            return found
        for base in self.bases.values():
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(base):
                    head, _, tail = name.rpartition(".")
                    if head == sandbox_id and tail.isdigit():
                        found.add(int(tail))
        return found


#: The probe: join group A, take a cgroup namespace rooted there, stop being root, then move into A's
#: sibling B through the file the parent opened; exit 0 only if that move succeeded. Its arguments:
#: the descriptors of A's and B's ``cgroup.procs``.
_OPENER_PROBE = """
import ctypes, os, sys
a, b = int(sys.argv[1]), int(sys.argv[2])
os.write(a, b"0")
if ctypes.CDLL(None, use_errno=True).unshare(0x02000000) != 0:
    sys.exit(3)
os.setgroups([])
os.setresgid(65534, 65534, 65534)
os.setresuid(65534, 65534, 65534)
try:
    os.write(b, b"0")
except OSError:
    sys.exit(1)
"""


@functools.cache
def _moves_by_opener(base: str) -> bool:
    made: list[str] = []
    fds: list[int] = []
    with contextlib.suppress(OSError):  # the groups of a probe whose server died mid-probe (empty now)
        for name in os.listdir(base):
            if name.startswith("opener-probe-") and not os.path.exists(f"/proc/{name.split('-')[2]}"):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(base, name))
    try:
        for name in ("a", "b"):
            path = os.path.join(base, f"opener-probe-{os.getpid()}-{name}")
            with contextlib.suppress(FileExistsError):
                os.mkdir(path)
            made.append(path)
            fds.append(os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC))
        probe = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _OPENER_PROBE, str(fds[0]), str(fds[1])],
            pass_fds=tuple(fds),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
            check=False,
        )
        ok = probe.returncode == 0
        if not ok:
            log.info(
                "cgroup v2: this kernel checks a move into a group against the writer, not the opener "
                "of cgroup.procs (before Linux 5.16): sandboxes start a bubblewrap per command, "
                "without an exec agent"
            )
        return ok
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("cgroup v2: cannot probe moves by the opener under %s: %s", base, exc)
        return False
    finally:
        for fd in fds:
            os.close(fd)
        for path in made:
            CgroupGroup({"cpuacct": path}, version=2).remove()


def _procs(path: str) -> set[int]:
    """The processes of the v2 group ``path`` itself (not of its children)."""
    return {int(p) for p in _read(os.path.join(path, "cgroup.procs")).split()}


def drain(pids: Callable[[], set[int]], move: Callable[[int], None], rounds: int = 100) -> bool:
    """Move every process ``pids()`` lists with ``move`` until it lists none: one may fork while its
    siblings move. False if some are left after ``rounds`` (still forking faster than they move).
    ``move`` may raise ``OSError`` for a process gone meanwhile.
    """
    for _ in range(rounds):
        left = pids()
        if not left:
            return True
        for pid in left:
            with contextlib.suppress(OSError):  # gone meanwhile
                move(pid)
    return not pids()


def _move_all(source: str, leaf: str) -> bool:
    """Move every process of the v2 group ``source`` into ``leaf``."""
    return drain(
        functools.partial(_procs, source), lambda pid: _write(os.path.join(leaf, "cgroup.procs"), str(pid))
    )


def _enable(path: str, controllers: Iterable[str]) -> bool:
    """Enable ``controllers`` for the children of the v2 group ``path``; False if it has processes."""
    wanted = " ".join(f"+{c}" for c in controllers)
    if not wanted:
        return True
    try:
        _write(os.path.join(path, "cgroup.subtree_control"), wanted)
    except OSError as exc:
        if exc.errno == errno.EBUSY:  # "no internal processes": the group holds some
            return False
        raise
    return True


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


def _read(path: str) -> str:
    """A control file's text, read with plain system calls (a command reads several: no text layer)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode()


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)  # as a shell's `echo >` does; cgroupfs ignores the trunc
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def format_cpus(cores: Iterable[int]) -> str:
    """CPU ids in the kernel's list format (``0,2,5``)."""
    return ",".join(str(c) for c in sorted(set(cores)))


#: v1 file names and their v2 counterparts (the rest are the same in both, or computed below).
_V2_NAMES = {
    "memory.limit_in_bytes": "memory.max",
    "memory.memsw.limit_in_bytes": "memory.swap.max",
    "memory.oom_control": "memory.events",
    "memory.usage_in_bytes": "memory.current",
    "memory.max_usage_in_bytes": "memory.peak",  # Linux 5.19
}


class CgroupGroup:
    """One group, present in several controllers (``controller -> directory``; one directory on v2).

    Its methods take v1 file names; on v2 they are written and read as their v2 counterparts (see
    the module's description). ``delegate`` (v2) is what the group hands down to child groups,
    which then hold its processes.
    """

    def __init__(self, paths: dict[str, str], version: int = 1, delegate: Iterable[str] = ()) -> None:
        self.paths = dict(paths)
        self.version = version
        self.delegate = tuple(delegate)
        self._written: dict[tuple[str, str], str] = {}
        self._cfs_period_us = CFS_PERIOD_US
        self._usage_base_us = 0

    @classmethod
    def create(cls, paths: dict[str, str], version: int = 1, delegate: Iterable[str] = ()) -> CgroupGroup:
        """Make the directories (a leftover group of the same name is reused)."""
        group = cls(paths, version, delegate)
        try:
            for controller, path in paths.items():
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path)
                if controller == "cpuset" and version == 1:
                    _inherit_cpuset(path)  # a v2 cpuset group inherits its parent's CPUs by itself
            for path in set(paths.values()) if group.delegate else ():
                _enable(path, group.delegate)
        except OSError:
            group.remove()
            raise
        return group

    def has(self, controller: str) -> bool:
        """Whether this group exists in ``controller``."""
        return controller in self.paths

    def write(self, controller: str, name: str, value: str | int) -> None:
        """Write one control file (named as on v1)."""
        if self.version == 2:
            self._write_v2(controller, name, int(value) if str(value).lstrip("-").isdigit() else value)
            return
        _write(os.path.join(self.paths[controller], name), str(value))

    def _write_v2(self, controller: str, name: str, value: str | int) -> None:
        path = self.paths[controller]
        if name == "cpu.cfs_period_us":  # v2 writes period and quota together, in cpu.max
            self._cfs_period_us = int(value)
            return
        if name == "cpu.cfs_quota_us":
            quota = int(value)
            _write(os.path.join(path, "cpu.max"), f"{quota if quota > 0 else 'max'} {self._cfs_period_us}")
            return
        if name == "cpuacct.usage":  # v2 usage cannot be reset: remember where it stood
            self._usage_base_us = self._usage_us()
            return
        if name == "memory.memsw.limit_in_bytes":  # v1: memory + swap; v2: swap alone
            memory = int(self._written.get(("memory", "memory.limit_in_bytes"), value))
            value = max(0, int(value) - memory)
        _write(os.path.join(path, _V2_NAMES.get(name, name)), str(value))
        self._written[(controller, name)] = str(value)

    def _usage_us(self) -> int:
        return self._flat(self._read_file("cpuacct", "cpu.stat"), "usage_usec")

    def configure(self, controller: str, name: str, value: str | int) -> None:
        """Write a control file unless this object already wrote that value there."""
        key = (controller, name)
        if self._written.get(key) != str(value):
            self.write(controller, name, value)
            self._written[key] = str(value)

    def _read_file(self, controller: str, name: str) -> str:
        try:
            return _read(os.path.join(self.paths[controller], name))
        except (OSError, KeyError):
            return ""

    @staticmethod
    def _flat(text: str, key: str) -> int:
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == key:
                return int(parts[1])
        return 0

    def read(self, controller: str, name: str) -> str:
        """Read one control file, named as on v1 ('' if the group or file is gone)."""
        if self.version == 2 and name == "cpuacct.usage":  # nanoseconds, from v2's microseconds
            return (
                str(max(0, self._usage_us() - self._usage_base_us) * 1000) if controller in self.paths else ""
            )
        return self._read_file(controller, _V2_NAMES.get(name, name) if self.version == 2 else name)

    def counter(self, controller: str, name: str, key: str) -> int:
        """A ``key value`` line from a flat-keyed file such as ``memory.oom_control`` (0 if absent)."""
        return self._flat(self.read(controller, name), key)

    def procs_files(self, controllers: Iterable[str] | None = None) -> list[str]:
        """The ``cgroup.procs`` files to write a pid to, to move it into this group (in ``controllers``).

        On v2 that is one file, or none for a group that delegates (its children hold processes).
        """
        wanted = self.paths if controllers is None else [c for c in controllers if c in self.paths]
        files = [os.path.join(self.paths[c], "cgroup.procs") for c in wanted]
        if self.version == 2:
            return [] if self.delegate else list(dict.fromkeys(files))
        return files

    def join_files(self, controllers: Iterable[str]) -> list[str]:
        """The files a single-threaded process writes ``0`` to, to move itself into this group.

        v1: the ``tasks`` files. The process joins with its one thread, and the kernel skips the
        global lock that moving a whole process (``cgroup.procs``) takes: after a quiet spell that
        lock waits for an RCU grace period, 7-15 ms on the development host, where this write takes
        0.04 ms. v2 moves whole processes only: its ``cgroup.procs`` (``0`` names the writer too).
        """
        if self.version == 2:
            return self.procs_files(controllers)
        return [os.path.join(self.paths[c], "tasks") for c in controllers if c in self.paths]

    def _dirs(self) -> list[str]:
        """The group's directories and, on v2, those nested in them (deepest first)."""
        if self.version == 1:  # v1 groups are made side by side (``<sandbox>.<n>``), never nested
            return list(dict.fromkeys(self.paths.values()))
        found: list[str] = []
        for path in dict.fromkeys(self.paths.values()):
            for parent, children, _files in os.walk(path, topdown=False):
                found.extend(os.path.join(parent, c) for c in children)
            found.append(path)
        return found

    def pids(self) -> set[int]:
        """Processes in the group (and in its nested groups), in any of its controllers."""
        found: set[int] = set()
        for path in self._dirs():
            with contextlib.suppress(OSError):
                found.update(int(x) for x in _read(os.path.join(path, "cgroup.procs")).split())
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
        for path in self._dirs():  # nested groups first: a group with children cannot go
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
