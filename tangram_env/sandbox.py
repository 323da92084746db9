"""The sandbox interface that tools run code through; providers live in ``tangram_env.server.sandbox``.

A sandbox keeps a trajectory's files and processes between actions; each ``exec`` runs on the cores
its action was granted. Providers (local isolated, e2b, ...) all implement :class:`Sandbox`.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

from pydantic import BaseModel, Field

from tangram_env.units import MiB, Seconds

#: Why the sandbox stopped a command, if it did.
KillReason = Literal["timeout", "memory", "output", "pids", "cpu_time", "signal"]


class SandboxSpec(BaseModel):
    """What a sandbox starts from and the limits it enforces."""

    image: str = Field("default", description="image name (a directory or virtual environment)")
    mem_mb: MiB = Field(1024, description="memory limit of everything running in the sandbox")
    max_pids: int = Field(256, description="processes and threads at once")
    max_output_bytes: int = Field(1 << 20, description="stdout and stderr are each cut at this size")
    wall_timeout_s: Seconds = Field(60.0, description="default wall-clock limit per exec")
    network: bool = Field(False, description="allow network access (off: no interfaces but loopback)")
    env: dict[str, str] = Field(default_factory=dict, description="environment of every exec")


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

    @property
    def ok(self) -> bool:
        """Exited with status 0 and was not killed."""
        return self.exit_code == 0 and self.killed_by is None


@runtime_checkable
class Sandbox(Protocol):
    """One isolated place to run commands, with a private workspace."""

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

    def read_file(self, path: str) -> bytes:
        """The bytes at ``path`` (relative paths are under the workspace)."""
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
