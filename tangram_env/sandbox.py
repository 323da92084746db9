"""The sandbox interface that tools run code through; providers live in ``tangram_env.server.sandbox``.

A sandbox keeps a trajectory's files and processes between actions; each ``exec`` runs on the cores
its action was granted. Providers (local isolated, e2b, ...) all implement :class:`Sandbox`.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tangram_env.errors import TangramRuntimeError, did_you_mean
from tangram_env.units import Bytes, MiB, Seconds

#: Why the sandbox stopped a command, if it did.
KillReason = Literal["timeout", "memory", "output", "pids", "cpu_time", "signal"]


class SandboxError(TangramRuntimeError):
    """A sandbox could not do what was asked (a command that fails is an :class:`ExecResult`, not this)."""


class SandboxUnavailable(SandboxError):
    """A provider cannot make sandboxes here: isolation missing, package not installed, no API key."""


class SandboxBroken(SandboxError):
    """The sandbox died, hung or could not be cleaned up; it must be replaced, not reused.

    ``reason`` says why in a few words (it becomes the action's error message).
    """

    def __init__(self, reason: str, sandbox_id: str = "") -> None:
        super().__init__(reason, sandbox_id)
        self.reason = reason
        self.sandbox_id = sandbox_id

    def __str__(self) -> str:
        return f"sandbox {self.sandbox_id} is broken: {self.reason}" if self.sandbox_id else self.reason


class SandboxBusy(SandboxError):
    """The provider is at capacity for now (e2b's 429/503): backpressure, to retry later; neither the
    sandbox nor the action failed.
    """


class SandboxPathError(SandboxError, PermissionError):
    """A file path that leaves the sandbox's writable areas (workspace and tmp)."""


class SandboxRequestError(SandboxError, ValueError):
    """A request a sandbox cannot take as given (an empty command, a bad timeout, unknown CPU ids)."""


class SandboxFileTooLarge(SandboxRequestError):
    """A file larger than the caller's ``max_bytes``, refused before it is read (a sparse file can
    claim a gigabyte on no disk at all, and the reader, not the sandbox, would hold it).
    """


def check_file_size(path: str, size: int, max_bytes: int | None) -> None:
    """Raise :class:`SandboxFileTooLarge` when ``size`` is over ``max_bytes`` (None: no limit)."""
    if max_bytes is not None and size > max_bytes:
        raise SandboxFileTooLarge(f"{path} holds {size} bytes, more than {max_bytes}; read it with bash")


def truncation_marker(dropped_bytes: int) -> str:
    """What ends a stream cut at the output limit (the same text for every provider)."""
    return f"\n[tangram: output truncated, {dropped_bytes} more bytes not shown]\n"


class SandboxSpec(BaseModel):
    """What a sandbox starts from and the limits it enforces (sizes and durations accept human units)."""

    # A typo of a limit (``mem_md = 5``) would leave the default in force, unsaid.
    model_config = ConfigDict(extra="forbid")

    image: str = Field("default", min_length=1, description="image name (a directory or virtual environment)")
    mem_mb: MiB = Field(1024, gt=0, description="memory limit of everything running in the sandbox")
    max_pids: int = Field(256, gt=0, description="processes and threads at once")
    max_output_bytes: int = Field(1 << 20, gt=0, description="stdout and stderr are each cut at this size")
    wall_timeout_s: Seconds = Field(60.0, gt=0, description="default wall-clock limit per exec")
    network: bool = Field(False, description="allow network access (off: no interfaces but loopback)")
    env: dict[str, str] = Field(default_factory=dict, description="environment of every exec")
    disk_mb: MiB = Field(
        1024,
        gt=0,
        description="size of the private workspace and tmp together (the local sandbox's count against "
        "mem_mb, and are kept 64 MiB, or half of it, below it)",
    )
    cpu_time_s: Seconds | None = Field(
        None, gt=0, description="CPU seconds per process in one exec (None: bounded by wall time and cores)"
    )
    output_kill_bytes: Bytes = Field(
        64 << 20,
        gt=0,
        description="a command whose stdout and stderr pass this many bytes together is killed",
    )
    max_open_files: int = Field(4096, gt=0, description="open file descriptors per process")

    @model_validator(mode="before")
    @classmethod
    def _known_fields_only(cls, data: Any) -> Any:
        # Said here rather than by extra="forbid" alone, whose error names neither the known fields nor
        # the closest one.
        if isinstance(data, dict):
            unknown = sorted(str(k) for k in data if k not in cls.model_fields)
            if unknown:
                known = list(cls.model_fields)
                hint = did_you_mean(unknown[0], known, n=1) if len(unknown) == 1 else ""
                raise ValueError(
                    f"unknown SandboxSpec field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                    f"(known: {', '.join(known)}){hint}"
                )
        return data


class ExecResult(BaseModel):
    """The outcome of one command in a sandbox."""

    exit_code: int
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float = 0.0
    cpu_s: float = 0.0
    killed_by: KillReason | None = None
    #: Every limit the command ran into, even those that did not stop it (a fork bomb hits ``pids``).
    limits_hit: list[KillReason] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Exited with status 0 and was not killed."""
        return self.exit_code == 0 and self.killed_by is None


@runtime_checkable
class Sandbox(Protocol):
    """One isolated place to run commands, with a private workspace.

    ``workspace`` is the workspace's path as commands inside the sandbox see it (their default
    working directory). A sandbox is usable from a forked child of the process that created it.
    An ``exec`` with ``cores`` runs on exactly those CPU ids and is told how many through the
    environment (``TANGRAM_CORES``, and ``TANGRAM_CPU_IDS``). A sandbox whose ``exec`` returns by its
    ``timeout_s``, having killed what it started, and spawns without copying its caller may say so with
    ``bounded_exec = True``: the server's own tools then call it from a thread, not a forked child.
    """

    id: str
    workspace: str

    def exec(
        self,
        cmd: str | list[str],
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        cores: tuple[int, ...] = (),
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run ``cmd`` (a shell string or argv) inside the sandbox, on ``cores`` if given."""
        ...

    def write_file(self, path: str, data: bytes | str) -> None:
        """Write ``data`` at ``path`` (relative paths are under the workspace)."""
        ...

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """The bytes at ``path`` (relative paths are under the workspace); a file over ``max_bytes``
        raises :class:`SandboxFileTooLarge` before it is read.
        """
        ...

    def reset(self) -> None:
        """Back to the image's starting state: workspace restored, every process gone."""
        ...

    def close(self) -> None:
        """Kill everything and free the sandbox's resources."""
        ...


class SandboxProvider(Protocol):
    """Creates sandboxes of one kind (local isolated, e2b, ...)."""

    name: str

    def create(self, spec: SandboxSpec) -> Sandbox:
        """A new sandbox started from ``spec.image``."""
        ...

    def close(self) -> None:
        """Close every sandbox this provider made."""
        ...
