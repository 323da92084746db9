"""A sandbox provider for the official SWE-bench Docker images, on the ``docker`` SDK.

Where users run a Docker engine, this grades real SWE-bench instances with the same env: the image of
instance ``x`` is :func:`~tangram_env.envs.swe_bench.instance.official_image_name` (``swebench/sweb.
eval.x86_64.<id>:latest``), whose repository sits at ``/testbed`` with its conda environment
``testbed``. Each sandbox is one container kept alive with ``sleep``; ``exec`` runs ``docker exec``
under coreutils ``timeout``; ``reset`` replaces the container with a fresh one from the image (the
only way back to its exact state). ``cores`` become the container's cpuset for that command.

Select it with ``DockerProvider()`` wherever a :class:`~tangram_env.sandbox.SandboxProvider` is taken.
"""

from __future__ import annotations

import io
import posixpath
import shlex
import tarfile
import time
import uuid
from typing import Any

from tangram_env.envs.swe_bench.instance import TESTBED
from tangram_env.sandbox import ExecResult, SandboxBroken, SandboxError, SandboxSpec, SandboxUnavailable

_TIMEOUT_EXIT = 124


def _sdk() -> Any:
    try:
        import docker
    except ImportError as exc:
        raise SandboxUnavailable("the Docker provider needs the docker SDK: pip install docker") from exc
    return docker


def _cap(data: bytes | None, limit: int) -> tuple[str, bool]:
    raw = data or b""
    if len(raw) <= limit:
        return raw.decode("utf-8", "replace"), False
    marker = f"\n[tangram: output truncated, {len(raw) - limit} more bytes not shown]\n"
    return raw[:limit].decode("utf-8", "replace") + marker, True


class DockerProvider:
    """Makes :class:`DockerSandbox` es from Docker images (pulled when missing, if ``pull``).

    ``client`` is a ``docker.DockerClient`` (default: ``docker.from_env()``, which honours
    ``DOCKER_HOST``); ``workspace`` is the directory commands start in.
    """

    name = "docker"

    def __init__(self, *, client: Any = None, pull: bool = True, workspace: str = TESTBED) -> None:
        docker = _sdk()
        try:
            self.client = client or docker.from_env()
            self.client.ping()
        except Exception as exc:  # the SDK raises DockerException, requests' errors or OSError
            raise SandboxUnavailable(f"no Docker engine answers here: {type(exc).__name__}: {exc}") from exc
        self.pull = pull
        self.workspace = workspace
        self.sandboxes: dict[str, DockerSandbox] = {}

    def _ensure_image(self, image: str) -> None:
        docker = _sdk()
        try:
            self.client.images.get(image)
        except docker.errors.ImageNotFound:
            if not self.pull:
                raise SandboxUnavailable(f"Docker image {image!r} is not here and pulling is off") from None
            try:
                self.client.images.pull(image)
            except docker.errors.APIError as exc:
                raise SandboxUnavailable(f"could not pull Docker image {image!r}: {exc}") from exc

    def start_container(self, spec: SandboxSpec) -> Any:
        """A running container of ``spec.image`` with ``spec``'s limits."""
        self._ensure_image(spec.image)
        return self.client.containers.run(
            spec.image,
            command=["sleep", "infinity"],
            detach=True,
            name=f"tangram-{uuid.uuid4().hex[:12]}",
            network_disabled=not spec.network,
            mem_limit=f"{spec.mem_mb}m",
            pids_limit=spec.max_pids,
            working_dir=self.workspace,
            environment=dict(spec.env),
            labels={"tangram": "sandbox"},
        )

    def create(self, spec: SandboxSpec) -> DockerSandbox:
        """A new sandbox (container) from ``spec.image``."""
        sandbox = DockerSandbox(self, spec, self.start_container(spec))
        self.sandboxes[sandbox.id] = sandbox
        return sandbox

    def close(self) -> None:
        """Remove every container this provider made."""
        for sandbox in list(self.sandboxes.values()):
            sandbox.close()


class DockerSandbox:
    """One container; see the module's description."""

    def __init__(self, provider: DockerProvider, spec: SandboxSpec, container: Any) -> None:
        self.provider = provider
        self.spec = spec
        self.container = container
        self.id = f"docker-{container.id[:12]}"
        self.workspace = provider.workspace

    def _path(self, path: str) -> str:
        return path if path.startswith("/") else posixpath.join(self.workspace, path)

    def exec(
        self,
        cmd: str | list[str],
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        cores: tuple[int, ...] = (),
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run ``cmd`` in the container (through ``timeout``), on ``cores`` if given."""
        shell = cmd if isinstance(cmd, str) else shlex.join(cmd)
        if stdin is not None:
            feed = f"/tmp/.tangram-stdin-{uuid.uuid4().hex[:8]}"
            self.write_file(feed, stdin)
            shell = f"( {shell} ) < {feed}; status=$?; rm -f {feed}; exit $status"
        limit = timeout_s or self.spec.wall_timeout_s
        argv = ["timeout", "-k", "5", f"{limit:.0f}", "sh", "-c", shell]
        if cores:
            self.container.update(cpuset_cpus=",".join(map(str, cores)))
        started = time.monotonic()
        try:
            code, (out, err) = self.container.exec_run(
                argv,
                workdir=self._path(cwd) if cwd else self.workspace,
                environment={**self.spec.env, **(env or {}), "TANGRAM_CORES": str(len(cores) or "")},
                demux=True,
            )
        except Exception as exc:  # the container died or the engine went away
            raise SandboxBroken(f"docker exec failed: {type(exc).__name__}: {exc}", self.id) from exc
        stdout, out_cut = _cap(out, self.spec.max_output_bytes)
        stderr, err_cut = _cap(err, self.spec.max_output_bytes)
        killed = (
            "timeout"
            if code == _TIMEOUT_EXIT or (code == 137 and time.monotonic() - started >= limit)
            else None
        )
        return ExecResult(
            exit_code=code,
            stdout=stdout,
            stderr=stderr,
            stdout_truncated=out_cut,
            stderr_truncated=err_cut,
            wall_s=time.monotonic() - started,
            killed_by=killed,
        )

    def write_file(self, path: str, data: bytes | str) -> None:
        """Write ``data`` at ``path`` (relative: under the workspace), through ``put_archive``."""
        raw = data.encode("utf-8") if isinstance(data, str) else data
        full = self._path(path)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(posixpath.basename(full))
            info.size, info.mtime, info.mode = len(raw), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(raw))
        parent = posixpath.dirname(full) or "/"
        self.container.exec_run(["mkdir", "-p", parent])
        if not self.container.put_archive(parent, buf.getvalue()):
            raise SandboxError(f"could not write {full} in container {self.id}")

    def read_file(self, path: str) -> bytes:
        """The bytes at ``path`` (FileNotFoundError if absent), through ``get_archive``."""
        full = self._path(path)
        try:
            stream, _stat = self.container.get_archive(full)
        except Exception as exc:
            raise FileNotFoundError(full) from exc
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.next()
            handle = tar.extractfile(member) if member is not None else None
            if handle is None:
                raise FileNotFoundError(full)
            return handle.read()

    def reset(self) -> None:
        """A fresh container from the image replaces this one."""
        old = self.container
        self.container = self.provider.start_container(self.spec)
        self.provider.sandboxes.pop(self.id, None)
        self.id = f"docker-{self.container.id[:12]}"
        self.provider.sandboxes[self.id] = self
        try:
            old.remove(force=True)
        except Exception:  # already gone: nothing to clean up
            pass

    def close(self) -> None:
        """Remove the container."""
        self.provider.sandboxes.pop(self.id, None)
        try:
            self.container.remove(force=True)
        except Exception:  # already gone
            pass
