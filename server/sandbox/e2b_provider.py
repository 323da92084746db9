"""The e2b provider: the same sandbox interface on e2b's cloud sandboxes (the optional ``e2b`` extra).

Select it with ``make_provider("e2b", api_key=..., template=...)`` (the key defaults to
``$E2B_API_KEY``). Each sandbox is one e2b sandbox; ``reset`` replaces it with a fresh one of the
same template (the only way back to the template's exact state). ``cores`` cannot pin anything
remote: the command is told how many it was granted (``TANGRAM_CORES``) and uses the sandbox's vCPUs.
A forked child reconnects to the sandbox by id instead of sharing its parent's HTTP connections.
"""

from __future__ import annotations

import os
import posixpath
import shlex
import time
from typing import Any

from tangram_env.images import DEFAULT_IMAGE
from tangram_env.sandbox import (
    ExecResult,
    SandboxBroken,
    SandboxError,
    SandboxRequestError,
    SandboxSpec,
    SandboxUnavailable,
)
from tangram_env.server.sandbox.execspec import result_from
from tangram_env.server.sandbox.procrun import OutputCapture, RunOutcome

WORKSPACE = "/home/user/workspace"


def _sdk() -> Any:
    try:
        import e2b
    except ImportError as exc:
        raise SandboxUnavailable(
            "the e2b provider needs the e2b SDK: pip install 'tangram-env[e2b]' (or pip install e2b)"
        ) from exc
    return e2b


class _OutputFlood(Exception):
    """Raised from an output callback to stop reading a command that printed too much."""


class E2BProvider:
    """Makes :class:`E2BSandbox` es from an e2b template.

    ``templates`` maps Tangram image names to e2b templates (``default`` -> ``template``, and an
    unmapped image name is used as the template name itself); ``lifetime_s`` is how long e2b keeps
    an idle sandbox alive; ``api_url`` and ``domain`` select another e2b deployment.
    """

    name = "e2b"

    def __init__(
        self,
        *,
        api_key: str | None = None,
        template: str | None = None,
        templates: dict[str, str] | None = None,
        lifetime_s: int = 3600,
        request_timeout_s: float = 30.0,
        domain: str | None = None,
        api_url: str | None = None,
    ) -> None:
        self._e2b = _sdk()
        key = api_key or os.environ.get("E2B_API_KEY")
        if not key:
            raise SandboxUnavailable("the e2b provider needs an API key: pass api_key= or set E2B_API_KEY")
        if lifetime_s <= 0 or request_timeout_s <= 0:
            raise SandboxRequestError("lifetime_s and request_timeout_s must be positive")
        self.template = template
        self.templates = dict(templates or {})
        self.lifetime_s = int(lifetime_s)
        self.connection = {"api_key": key, "request_timeout": request_timeout_s}
        if domain:
            self.connection["domain"] = domain
        if api_url:
            self.connection["api_url"] = api_url
        self.sandboxes: dict[str, E2BSandbox] = {}

    def template_for(self, image: str) -> str | None:
        """The e2b template a sandbox of ``image`` starts from (None: e2b's default)."""
        if image in self.templates:
            return self.templates[image]
        return self.template if image == DEFAULT_IMAGE else image

    def create(self, spec: SandboxSpec) -> E2BSandbox:
        """A new e2b sandbox for ``spec`` (network follows ``spec.network``)."""
        sandbox = E2BSandbox(self, spec)
        self.sandboxes[sandbox.key] = sandbox
        return sandbox

    def close(self) -> None:
        """Kill every sandbox this provider made."""
        for sandbox in list(self.sandboxes.values()):
            sandbox.close()

    def start(self, spec: SandboxSpec) -> Any:
        """Create the cloud sandbox (an ``e2b.Sandbox``), mapping the SDK's errors to ours."""
        e2b = self._e2b
        try:
            remote = e2b.Sandbox.create(
                template=self.template_for(spec.image),
                timeout=self.lifetime_s,
                envs=dict(spec.env),
                allow_internet_access=spec.network,
                **self.connection,
            )
            remote.commands.run(f"mkdir -p {WORKSPACE}", timeout=30)
        except e2b.AuthenticationException as exc:
            raise SandboxUnavailable(f"e2b refused the API key: {exc}") from exc
        except Exception as exc:
            raise SandboxError(f"could not create an e2b sandbox: {type(exc).__name__}: {exc}") from exc
        return remote


class E2BSandbox:
    """One e2b cloud sandbox behind the :class:`~tangram_env.sandbox.Sandbox` interface."""

    def __init__(self, provider: E2BProvider, spec: SandboxSpec) -> None:
        self._provider = provider
        self.spec = spec
        self.workspace = WORKSPACE
        self.key = f"e2b-{id(self):x}"
        self._remote = provider.start(spec)
        self._remote_pid = os.getpid()
        self._closed = False
        #: The e2b sandbox id (it changes on reset: a reset is a fresh sandbox).
        self.id = str(self._remote.sandbox_id)

    def _client(self) -> Any:
        if self._closed:
            raise SandboxBroken("closed", self.id)
        if os.getpid() != self._remote_pid:
            # A forked child must not share the parent's connection pool: connect anew by id.
            e2b = self._provider._e2b
            try:
                self._remote = e2b.Sandbox.connect(self._remote.sandbox_id, **self._provider.connection)
            except Exception as exc:
                raise SandboxBroken(f"cannot reach e2b sandbox: {exc}", self.id) from exc
            self._remote_pid = os.getpid()
        return self._remote

    def exec(
        self,
        cmd: str | list[str],
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        cores: tuple[int, ...] = (),
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run ``cmd`` in the cloud sandbox and wait for it, with the spec's output and time limits."""
        if isinstance(cmd, list | tuple):
            if not cmd or not all(isinstance(a, str) for a in cmd):
                raise SandboxRequestError(
                    f"a command is a shell string or a non-empty list of strings, not {cmd!r}"
                )
            command = shlex.join(cmd)
        elif isinstance(cmd, str) and cmd.strip():
            command = cmd
        else:
            raise SandboxRequestError(f"empty or invalid command {cmd!r}")
        limit = self.spec.wall_timeout_s if timeout_s is None else float(timeout_s)
        if limit <= 0:
            raise SandboxRequestError(f"timeout_s must be positive, not {timeout_s!r}")
        envs = {**self.spec.env, **(env or {}), "TANGRAM_CORES": str(len(cores) or 1)}
        where = WORKSPACE if cwd is None else posixpath.join(WORKSPACE, cwd)
        remote = self._client()
        out, err = OutputCapture(self.spec.max_output_bytes), OutputCapture(self.spec.max_output_bytes)
        start = time.monotonic()
        exit_code, timed_out, flooded = -1, False, False
        e2b = self._provider._e2b

        def sink(capture: OutputCapture) -> Any:
            def take(text: str) -> None:
                capture.add(text.encode())
                if out.total + err.total > self.spec.output_kill_bytes:
                    raise _OutputFlood

            return take

        handle = None
        try:
            handle = remote.commands.run(
                command,
                background=True,
                envs=envs,
                cwd=where,
                timeout=limit,
                stdin=bool(stdin),
                retain_output=False,
            )
            if stdin:
                handle.send_stdin(stdin)
                handle.close_stdin()
            exit_code = handle.wait(on_stdout=sink(out), on_stderr=sink(err)).exit_code
        except e2b.CommandExitException as exc:
            exit_code = exc.exit_code
        except _OutputFlood:
            flooded = True
        except e2b.TimeoutException as exc:
            if isinstance(exc, e2b.SandboxNotRunningException):
                raise SandboxBroken(f"the e2b sandbox stopped: {exc}", self.id) from exc
            timed_out = True
        except e2b.SandboxNotFoundException as exc:
            raise SandboxBroken(f"the e2b sandbox is gone: {exc}", self.id) from exc
        except e2b.SandboxException as exc:
            raise SandboxError(f"e2b could not run the command: {exc}") from exc
        if (timed_out or flooded) and handle is not None:
            try:
                handle.kill()
            except Exception:  # already ended, or the sandbox is going: nothing left to stop
                pass
        return map_outcome(
            self.spec,
            exit_code=-9 if timed_out or flooded else exit_code,
            stdout=out,
            stderr=err,
            wall_s=time.monotonic() - start,
            timed_out=timed_out,
            output_exceeded=flooded,
        )

    def write_file(self, path: str, data: bytes | str) -> None:
        """Write ``data`` at ``path`` (relative paths are under the workspace)."""
        try:
            self._client().files.write(self._path(path), data)
        except SandboxError:
            raise
        except Exception as exc:
            raise SandboxError(f"cannot write {path!r} in e2b sandbox {self.id}: {exc}") from exc

    def read_file(self, path: str) -> bytes:
        """The bytes at ``path`` (FileNotFoundError if it does not exist)."""
        e2b = self._provider._e2b
        try:
            return bytes(self._client().files.read(self._path(path), format="bytes"))
        except e2b.FileNotFoundException as exc:
            raise FileNotFoundError(path) from exc
        except SandboxError:
            raise
        except Exception as exc:
            raise SandboxError(f"cannot read {path!r} in e2b sandbox {self.id}: {exc}") from exc

    def _path(self, path: str) -> str:
        if not path or "\0" in path:
            raise SandboxRequestError(f"bad path {path!r}")
        return path if path.startswith("/") else posixpath.join(WORKSPACE, path)

    def reset(self) -> None:
        """Replace the cloud sandbox with a fresh one of the same template."""
        old = self._client()
        self._remote = self._provider.start(self.spec)
        self._remote_pid = os.getpid()
        self.id = str(self._remote.sandbox_id)
        try:
            old.kill()
        except Exception:  # it may have timed out on e2b's side already
            pass

    def health(self) -> str | None:
        """None while the cloud sandbox answers, else why not."""
        if self._closed:
            return "closed"
        try:
            return None if self._client().is_running() else "the e2b sandbox is not running"
        except Exception as exc:
            return f"e2b sandbox unreachable: {exc}"

    def close(self) -> None:
        """Kill the cloud sandbox."""
        if self._closed:
            return
        self._closed = True
        try:
            self._remote.kill()
        except Exception:  # already gone
            pass
        self._provider.sandboxes.pop(self.key, None)


def map_outcome(
    spec: SandboxSpec,
    *,
    exit_code: int,
    stdout: OutputCapture,
    stderr: OutputCapture,
    wall_s: float,
    timed_out: bool = False,
    output_exceeded: bool = False,
) -> ExecResult:
    """An e2b command's outcome as an :class:`ExecResult` (the same rules as the local providers)."""
    outcome = RunOutcome(
        returncode=exit_code,
        signal=None,
        stdout=stdout.value(),
        stderr=stderr.value(),
        stdout_dropped=stdout.dropped,
        stderr_dropped=stderr.dropped,
        wall_s=wall_s,
        cpu_s=0.0,  # e2b does not report CPU time per command
        timed_out=timed_out,
        output_exceeded=output_exceeded,
    )
    return result_from(outcome, spec)
