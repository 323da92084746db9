"""The ``none`` provider: commands run directly on the host, in a private directory, with rlimits only.

This is the explicit opt-out for hosts without bubblewrap (or for trusted code): there is no
namespace, no read-only host, no network cut, and a process that detaches from its session outlives
its exec. Every sandbox it makes logs a warning saying so. Paths are host paths: the workspace is a
directory under the state folder, and commands see the host's file system as the server does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import shutil
import tempfile
import uuid
from collections.abc import Callable

from tangram_env.images import Image, get_image
from tangram_env.sandbox import ExecResult, SandboxBroken, SandboxError, SandboxPathError, SandboxSpec
from tangram_env.server.sandbox import fsaccess
from tangram_env.server.sandbox.execspec import plan_exec, result_from
from tangram_env.server.sandbox.procrun import kill_session, run_captured

log = logging.getLogger(__name__)


class UnisolatedProvider:
    """Makes :class:`UnisolatedSandbox` es (no isolation: see the module's description)."""

    name = "none"

    def __init__(self, *, state_dir: str | None = None, image_dir: str | None = None) -> None:
        root = state_dir or os.path.join(tempfile.gettempdir(), f"tangram-unisolated-{os.geteuid()}")
        self.state_dir = os.path.abspath(root)
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        self.image_dir = image_dir
        self.host_cpus = frozenset(os.sched_getaffinity(0))
        self.sandboxes: dict[str, UnisolatedSandbox] = {}
        log.warning(
            "sandbox provider 'none': commands run on the host WITHOUT isolation (no namespaces, "
            "read-write host, network on); use it only for trusted code"
        )

    def create(self, spec: SandboxSpec) -> UnisolatedSandbox:
        """A new directory-backed sandbox from ``spec.image``."""
        sandbox = UnisolatedSandbox(self, spec, get_image(spec.image, self.image_dir))
        self.sandboxes[sandbox.id] = sandbox
        return sandbox

    def close(self) -> None:
        """Close every sandbox this provider made."""
        for sandbox in list(self.sandboxes.values()):
            sandbox.close()


class UnisolatedSandbox:
    """A workspace directory on the host; each exec is a plain child process in its own session."""

    #: ``exec`` returns by its time limit, having killed its command's session (see the executor).
    bounded_exec = True

    def __init__(self, provider: UnisolatedProvider, spec: SandboxSpec, image: Image) -> None:
        self.id = f"un-{uuid.uuid4().hex[:12]}"
        self.spec = spec
        self.image = image
        self._provider = provider
        self.dir = os.path.join(provider.state_dir, self.id)
        self.workspace = os.path.join(self.dir, "work")
        self.tmp = os.path.join(self.dir, "tmp")
        self._closed = False
        os.mkdir(self.dir, 0o700)
        self._fresh_files()
        log.warning("sandbox %s is NOT isolated (provider 'none')", self.id)
        path = ":".join([*image.bin_dirs(), os.environ.get("PATH", "/usr/bin:/bin")])
        self._env = {"PATH": path, "HOME": self.workspace, "TMPDIR": self.tmp, "LANG": "C.UTF-8"}
        self._env.update({"TANGRAM_SANDBOX": "0", **image.env, **spec.env})

    def _fresh_files(self) -> None:
        for path in (self.workspace, self.tmp):
            shutil.rmtree(path, ignore_errors=True)
            os.mkdir(path, 0o700)
        if self.image.workspace:
            shutil.copytree(self.image.workspace, self.workspace, symlinks=True, dirs_exist_ok=True)

    def _check(self) -> None:
        if self._closed or not os.path.isdir(self.dir):
            raise SandboxBroken("closed", self.id)

    def exec(
        self,
        cmd: str | list[str],
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        cores: tuple[int, ...] = (),
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run ``cmd`` as a child process of this one, in the workspace, under rlimits."""
        plan = plan_exec(self.spec, cmd, timeout_s, cores, self._provider.host_cpus, cwd, self.workspace)
        self._check()
        rlimits = plan.rlimits(privileged=False, cgroup_memory=False)
        outcome = run_captured(
            plan.argv,
            env={**self._env, **(env or {}), **plan.core_env},
            cwd=plan.cwd,
            stdin=stdin,
            timeout_s=plan.timeout_s,
            max_output_bytes=self.spec.max_output_bytes,
            output_kill_bytes=self.spec.output_kill_bytes,
            kill=kill_session,
            on_spawn=_limiter(plan.cores, rlimits),
            gated=True,
        )
        return result_from(outcome, self.spec)

    def _locate(self, path: str) -> tuple[str, str]:
        for root in (self.workspace, self.tmp):
            if path == root or path.startswith(root + "/"):
                return root, path[len(root) + 1 :]
        if path.startswith("/"):
            raise SandboxPathError(f"{path!r} is outside the sandbox's workspace and tmp")
        return self.workspace, path

    def write_file(self, path: str, data: bytes | str) -> None:
        """Write ``data`` at ``path`` (relative paths are under the workspace)."""
        self._check()
        root, rel = self._locate(path)
        try:
            fsaccess.write_beneath(root, rel, data.encode() if isinstance(data, str) else bytes(data))
        except OSError as exc:
            if isinstance(exc, SandboxError):
                raise
            raise SandboxError(f"cannot write {path!r} in sandbox {self.id}: {exc}") from exc

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """The bytes at ``path`` (relative paths are under the workspace)."""
        self._check()
        root, rel = self._locate(path)
        return fsaccess.read_beneath(root, rel, max_bytes)

    def reset(self) -> None:
        """Workspace and tmp back to the image's (processes that left their session are not found)."""
        self._check()
        self._fresh_files()

    def health(self) -> str | None:
        """None while usable, else why not."""
        return "closed" if self._closed or not os.path.isdir(self.dir) else None

    def close(self) -> None:
        """Delete the sandbox's directory."""
        if self._closed:
            return
        self._closed = True
        shutil.rmtree(self.dir, ignore_errors=True)
        self._provider.sandboxes.pop(self.id, None)


def _limiter(cores: tuple[int, ...], rlimits: list[tuple[int, tuple[int, int]]]) -> Callable[[int], None]:
    """Applies the exec's cores and rlimits to its (gated) process, from this one."""

    def apply(pid: int) -> None:
        if cores:
            os.sched_setaffinity(pid, cores)
        for which, value in rlimits:
            with contextlib.suppress(ValueError, OSError):  # one above the server's own hard limit
                resource.prlimit(pid, which, value)

    return apply
