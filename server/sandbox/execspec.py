"""One exec from request to result, independent of how it is launched: checks, limits, outcome mapping."""

from __future__ import annotations

import math
import posixpath
import resource
import signal
from collections.abc import Iterable
from dataclasses import dataclass

from tangram_env.sandbox import ExecResult, KillReason, SandboxRequestError, SandboxSpec, truncation_marker
from tangram_env.server.sandbox.cgroups import format_cpus
from tangram_env.server.sandbox.procrun import RunOutcome


@dataclass(frozen=True)
class ExecPlan:
    """A checked exec request: the argv, its time limit, its cores and where it runs."""

    spec: SandboxSpec
    argv: list[str]
    timeout_s: float
    cores: tuple[int, ...]
    cwd: str
    host_cpu_count: int

    @property
    def cpus_text(self) -> str:
        """The granted cores in the kernel's list format."""
        return format_cpus(self.cores)

    @property
    def core_env(self) -> dict[str, str]:
        """How the command learns its grant: ``TANGRAM_CORES`` (how many) and ``TANGRAM_CPU_IDS``."""
        env = {"TANGRAM_CORES": str(len(self.cores) or self.host_cpu_count)}
        if self.cores:
            env["TANGRAM_CPU_IDS"] = self.cpus_text
        return env

    def rlimits(self, *, privileged: bool, cgroup_memory: bool) -> list[tuple[int, tuple[int, int]]]:
        """The rlimits each process of the exec gets (``RLIMIT_NPROC`` only binds a uid of its own)."""
        spec = self.spec
        limits = [
            (resource.RLIMIT_CORE, (0, 0)),
            (resource.RLIMIT_NOFILE, (spec.max_open_files, spec.max_open_files)),
            (resource.RLIMIT_FSIZE, (spec.disk_mb << 20, spec.disk_mb << 20)),
        ]
        if privileged:
            limits.append((resource.RLIMIT_NPROC, (spec.max_pids, spec.max_pids)))
        if spec.cpu_time_s is not None:
            seconds = max(1, math.ceil(spec.cpu_time_s))
            limits.append((resource.RLIMIT_CPU, (seconds, seconds + 1)))
        if not cgroup_memory:
            # Without a memory cgroup, the address space is the only memory limit left (a coarse one).
            limits.append((resource.RLIMIT_AS, (spec.mem_mb << 20, spec.mem_mb << 20)))
        return limits


def plan_exec(
    spec: SandboxSpec,
    cmd: str | list[str],
    timeout_s: float | None,
    cores: Iterable[int],
    host_cpus: frozenset[int],
    cwd: str | None,
    workspace: str,
) -> ExecPlan:
    """Check an exec request (raising :class:`SandboxRequestError`) and resolve its defaults."""
    if isinstance(cmd, str):
        if not cmd.strip():
            raise SandboxRequestError("empty command")
        argv = ["/bin/sh", "-c", cmd]
    elif isinstance(cmd, list | tuple) and cmd and all(isinstance(a, str) for a in cmd):
        argv = list(cmd)
    else:
        raise SandboxRequestError(f"a command is a shell string or a non-empty list of strings, not {cmd!r}")
    if any("\0" in a for a in argv):
        raise SandboxRequestError("a command may not contain NUL bytes")
    limit = spec.wall_timeout_s if timeout_s is None else timeout_s
    if not isinstance(limit, int | float) or not math.isfinite(limit) or limit <= 0:
        raise SandboxRequestError(f"timeout_s must be a positive number of seconds, not {timeout_s!r}")
    try:
        granted = tuple(sorted({int(c) for c in cores}))
    except (TypeError, ValueError):
        raise SandboxRequestError(f"cores must be CPU ids (integers), not {cores!r}") from None
    unknown = [c for c in granted if c not in host_cpus]
    if unknown:
        raise SandboxRequestError(
            f"cores {unknown} are not CPUs this server may use ({format_cpus(host_cpus)})"
        )
    where = workspace if cwd is None else posixpath.normpath(posixpath.join(workspace, cwd))
    if "\0" in where:
        raise SandboxRequestError("cwd may not contain NUL bytes")
    return ExecPlan(spec, argv, float(limit), granted, where, len(host_cpus))


def _text(data: bytes, dropped: int) -> str:
    text = data.decode("utf-8", errors="replace")
    return text + truncation_marker(dropped) if dropped else text


def result_from(
    outcome: RunOutcome, spec: SandboxSpec, *, oom: bool = False, pids_max: bool = False
) -> ExecResult:
    """The :class:`ExecResult` of a finished run, naming the limit that stopped it, if one did."""
    hit: list[KillReason] = []
    if oom:
        hit.append("memory")
    if pids_max:
        hit.append("pids")
    if outcome.output_exceeded:
        hit.append("output")
    if outcome.timed_out:
        hit.append("timeout")
    # A process over RLIMIT_CPU gets SIGXCPU, then SIGKILL at the hard limit (a shell reports 128+sig).
    xcpu = {signal.SIGXCPU, signal.SIGKILL}
    died_of = outcome.signal or (outcome.returncode - 128 if outcome.returncode > 128 else None)
    if spec.cpu_time_s is not None and died_of in xcpu and outcome.cpu_s >= 0.8 * spec.cpu_time_s:
        hit.append("cpu_time")
    killed_by: KillReason | None = None
    if outcome.output_exceeded:
        killed_by = "output"
    elif outcome.timed_out:
        killed_by = "timeout"
    elif oom and outcome.returncode != 0:
        killed_by = "memory"
    elif "cpu_time" in hit:
        killed_by = "cpu_time"
    return ExecResult(
        exit_code=outcome.returncode,
        stdout=_text(outcome.stdout, outcome.stdout_dropped),
        stderr=_text(outcome.stderr, outcome.stderr_dropped),
        stdout_truncated=outcome.stdout_dropped > 0,
        stderr_truncated=outcome.stderr_dropped > 0,
        wall_s=outcome.wall_s,
        cpu_s=outcome.cpu_s,
        killed_by=killed_by,
        limits_hit=hit,
    )
