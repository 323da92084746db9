"""What isolation this host offers the local provider, found by trying each protection once.

:func:`detect_protections` is what the orchestrator logs at start; :func:`host_protections` is the
full record the local provider builds its sandboxes from. Nothing is assumed from the kernel
version: bubblewrap is run, cgroups are created, a tmpfs is mounted.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field

from tangram_env.server.sandbox.cgroups import CgroupLayout
from tangram_env.server.sandbox.linux import can_mount_tmpfs
from tangram_env.server.sandbox.seccomp import supported as seccomp_supported

log = logging.getLogger(__name__)

#: The namespaces a sandbox is put in, by bubblewrap flag.
NAMESPACE_FLAGS = {
    "pid_namespace": "--unshare-pid",
    "net_namespace": "--unshare-net",
    "ipc_namespace": "--unshare-ipc",
    "uts_namespace": "--unshare-uts",
}


@dataclass(frozen=True)
class Protections:
    """The protections found on this host, and the tools that give them."""

    bwrap: str | None
    setpriv: str | None  # drops root to the sandbox's uid; ties bubblewrap's life to its caller's
    privileged: bool  # root: bubblewrap runs as root and drops to a per-sandbox uid
    namespaces: dict[str, bool]
    cgroups: CgroupLayout
    tmpfs: bool
    affinity: bool
    problems: list[str] = field(default_factory=list)

    @property
    def isolated(self) -> bool:
        """Whether untrusted code can run here: bubblewrap with every namespace, and setpriv."""
        return bool(self.bwrap) and all(self.namespaces.values()) and bool(self.setpriv)

    def as_dict(self) -> dict[str, bool]:
        """Protection name -> available (what :func:`detect_protections` returns)."""
        return {
            "bwrap": bool(self.bwrap),
            "mount_namespace": bool(self.bwrap) and any(self.namespaces.values()),
            **self.namespaces,
            "user_namespace": bool(self.bwrap) and not self.privileged,
            "uid_drop": self.privileged and bool(self.setpriv),
            **{f"cgroup_{c}": self.cgroups.has(c) for c in ("memory", "pids", "cpu", "cpuset", "cpuacct")},
            "seccomp": bool(self.bwrap) and seccomp_supported(),
            "rlimits": True,
            "sched_setaffinity": self.affinity,
            "tmpfs_workspace": self.tmpfs,
        }


def detect_protections(state_dir: str | None = None) -> dict[str, bool]:
    """Which protections the local provider can use here (name -> available); probes once per process."""
    return host_protections(state_dir).as_dict()


@functools.lru_cache(maxsize=8)
def host_protections(state_dir: str | None = None) -> Protections:
    """Probe this host (bubblewrap and its namespaces, cgroups, tmpfs mounts, affinity)."""
    problems: list[str] = []
    privileged = os.geteuid() == 0
    bwrap = shutil.which("bwrap")
    setpriv = shutil.which("setpriv")
    if bwrap is None:
        problems.append("bubblewrap (bwrap) is not installed: `apt-get install bubblewrap`")
    if setpriv is None:
        problems.append("setpriv (util-linux) is missing: sandboxed code could not drop root")
    namespaces = {name: False for name in NAMESPACE_FLAGS}
    if bwrap is not None:
        namespaces = _probe_namespaces(bwrap, privileged, problems)
    scratch = state_dir or tempfile.gettempdir()
    tmpfs = privileged and can_mount_tmpfs(scratch)
    try:
        os.sched_setaffinity(0, os.sched_getaffinity(0))
        affinity = True
    except (AttributeError, OSError):
        affinity = False
    found = Protections(
        bwrap=bwrap if any(namespaces.values()) else None,
        setpriv=setpriv,
        privileged=privileged,
        namespaces=namespaces,
        cgroups=CgroupLayout.discover(),
        tmpfs=tmpfs,
        affinity=affinity,
        problems=problems,
    )
    return found


def log_protections(found: Protections, logger: logging.Logger = log) -> None:
    """One INFO line of what is on, one WARNING per thing that is off."""
    flags = found.as_dict()
    logger.info("sandbox protections: %s", ", ".join(f"{k}={'on' if v else 'off'}" for k, v in flags.items()))
    for problem in found.problems:
        logger.warning("sandbox protection missing: %s", problem)
    for controller in ("memory", "pids", "cpuset", "cpu"):
        if not flags[f"cgroup_{controller}"]:
            logger.warning("no writable %s cgroup: falling back to rlimits and affinity for it", controller)


def _probe_namespaces(bwrap: str, privileged: bool, problems: list[str]) -> dict[str, bool]:
    base = [bwrap, "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
    if not privileged:
        base.append("--unshare-user")
    if _runs([*base, *NAMESPACE_FLAGS.values(), "true"]) is None:
        return dict.fromkeys(NAMESPACE_FLAGS, True)
    found = {}
    for name, flag in NAMESPACE_FLAGS.items():
        error = _runs([*base, flag, "true"])
        found[name] = error is None
        if error is not None:
            problems.append(f"bwrap {flag} does not work here: {error}")
    return found


def _runs(argv: list[str]) -> str | None:
    """None if ``argv`` ran and exited 0, else what went wrong."""
    try:
        done = subprocess.run(argv, capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return (
        None
        if done.returncode == 0
        else done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}"
    )
