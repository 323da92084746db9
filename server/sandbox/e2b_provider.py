"""The e2b provider: the same sandbox interface on e2b's cloud sandboxes (the optional ``e2b`` extra).

Select it with ``make_provider("e2b", api_key=..., template=...)`` (the key defaults to
``$E2B_API_KEY``). Each sandbox is one e2b sandbox; ``reset`` replaces it with a fresh one of the
same template (the only way back to the template's exact state). ``cores`` cannot pin anything
remote: the command is told how many it was granted (``TANGRAM_CORES``) and uses the sandbox's vCPUs.

No SDK client ever crosses a ``fork()``: the SDK runs only in a helper process the provider starts
(:mod:`~tangram_env.server.sandbox.e2b_helper`), and this process and its forked action children
call it over a Unix socket. Its errors arrive classified: a refused key is
:class:`~tangram_env.sandbox.SandboxUnavailable`, 429/503 are
:class:`~tangram_env.sandbox.SandboxBusy` (backpressure, not a timeout), a sandbox that is gone or
unreachable is :class:`~tangram_env.sandbox.SandboxBroken`.

Every sandbox costs its owner money while it lives, so none is lost track of: the helper tries again
the kills that e2b fails, kills a sandbox made after its caller stopped waiting and looks for those of
creates that failed after e2b may have made them. Stopped, by ``close`` or because this process exited
(however it ended), it kills every sandbox that carries the provider's tag (e2b metadata
``tangram.owner``) and logs, as an error, any it could not.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import posixpath
import secrets
import shlex
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from tangram_env.images import DEFAULT_IMAGE
from tangram_env.sandbox import (
    ExecResult,
    SandboxBroken,
    SandboxBusy,
    SandboxError,
    SandboxFileTooLarge,
    SandboxRequestError,
    SandboxSpec,
    SandboxUnavailable,
)
from tangram_env.server.sandbox.e2b_helper import END_GRACE_S, TAKEN
from tangram_env.server.sandbox.execspec import result_from
from tangram_env.server.sandbox.procrun import OutputCapture, RunOutcome

WORKSPACE = "/home/user/workspace"
_HELPER_START_S = 60.0
_PING_EVERY_S = 30.0  # how often a caller waiting on the helper checks that it is not hung
_PING_S = 5.0
_STALL_S = 30.0  # a helper that takes this long to read or finish writing a message is hung
_SWEEP_S = 60.0  # how long a closing helper may take to kill what its provider left


def _check_sdk() -> None:
    try:
        found = importlib.util.find_spec("e2b") is not None
    except (ValueError, ImportError):  # in sys.modules as None: deliberately absent
        found = False
    if not found:
        raise SandboxUnavailable(
            "the e2b provider needs the e2b SDK: pip install 'tangram-env[e2b]' (or pip install e2b)"
        )


class _HelperLink:
    """The e2b helper process, and calls to it from any process (a new connection per call)."""

    def __init__(self, connection: dict[str, Any], owner: str, lifetime_s: int) -> None:
        self._dir = tempfile.mkdtemp(prefix="tangram-e2b-")
        self.address = os.path.join(self._dir, "helper.sock")
        self._authkey = secrets.token_bytes(32)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANGRAM_E2B_")}
        env["TANGRAM_E2B_HELPER_KEY"] = self._authkey.hex()
        env["TANGRAM_E2B_API_KEY"] = connection["api_key"]
        env["TANGRAM_E2B_REQUEST_TIMEOUT"] = str(connection["request_timeout"])
        for name in ("domain", "api_url"):
            if connection.get(name):
                env[f"TANGRAM_E2B_{name.upper()}"] = connection[name]
        if connection.get("retries") is not None:
            env["TANGRAM_E2B_RETRIES"] = str(connection["retries"])
        env["TANGRAM_E2B_OWNER"] = owner
        env["TANGRAM_E2B_LIFETIME"] = str(lifetime_s)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        self._owner = os.getpid()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tangram_env.server.sandbox.e2b_helper", "--address", self.address],
            stdin=subprocess.PIPE,  # at its end (close(), or we exited) the helper sweeps and exits
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line.strip() != b"ready":
            self.process.kill()
            raise SandboxUnavailable(
                f"the e2b helper process did not start (exit code {self.process.wait()}); see its stderr"
            )
        atexit.register(self.close)

    def call(self, op: str, *args: Any, wait_s: float) -> Any:
        """The helper's answer to ``op(*args)`` within ``wait_s``, its failures raised as sandbox errors.

        While it waits it pings the helper now and then: one that misses a ping (stopped, or wedged)
        is killed, so that the next call starts a fresh one.
        """
        deadline = time.monotonic() + wait_s
        try:
            with self._connect(_STALL_S) as conn:
                conn.send((op, args))
                while not conn.poll(max(0.0, min(_PING_EVERY_S, deadline - time.monotonic()))):
                    if not self._answers_ping():
                        raise self._hung(f"no answer to {op!r}, nor to a ping")
                    if time.monotonic() >= deadline:
                        raise SandboxError(f"e2b did not answer {op!r} within {wait_s:.0f}s")
                reply = conn.recv()
                if op == "create" and reply[0] == "ok":
                    conn.send(TAKEN)  # else the helper kills the sandbox, as one nobody took
        except BlockingIOError as exc:  # a read or write stalled past _STALL_S
            raise self._hung(f"it stalled exchanging {op!r}") from exc
        except (OSError, EOFError) as exc:
            raise SandboxError(f"the e2b helper process does not answer: {exc}") from exc
        if reply[0] == "ok":
            return reply[1]
        _, kind, message = reply
        if kind == "unavailable":
            raise SandboxUnavailable(message)
        if kind == "busy":
            raise SandboxBusy(f"e2b is at capacity, retry later: {message}")
        if kind == "broken":
            raise SandboxBroken(message, args[0] if args else "")
        if kind == "not_found":
            raise FileNotFoundError(message)
        if kind == "too_large":
            raise SandboxFileTooLarge(message)
        if kind == "request":
            raise SandboxRequestError(message)
        raise SandboxError(message)

    def _connect(self, stall_s: float) -> Connection:
        """An authenticated connection to the helper whose every read and write fails after stalling
        ``stall_s`` (``multiprocessing``'s own ``Client`` would wait forever on a hung helper's handshake).
        """
        with socket.socket(socket.AF_UNIX) as sock:
            stall = struct.pack("ll", int(stall_s), int(stall_s % 1 * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, stall)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, stall)
            sock.connect(self.address)
            conn = Connection(sock.detach())
        try:  # the order of multiprocessing.connection.Client, which the helper's Listener expects
            answer_challenge(conn, self._authkey)
            deliver_challenge(conn, self._authkey)
        except BaseException:
            conn.close()
            raise
        return conn

    def _hung(self, how: str) -> SandboxError:
        if os.getpid() == self._owner:
            self.process.kill()  # the next call starts a new helper; the sandboxes live on in e2b
        return SandboxError(f"the e2b helper process hung ({how}); it is replaced")

    def _answers_ping(self) -> bool:
        """Whether the helper answers at once (it does, whatever else it is doing, unless hung)."""
        try:
            with self._connect(_PING_S) as conn:
                conn.send(("ping", ()))
                return bool(conn.poll(_PING_S))
        except (OSError, EOFError):
            return False

    def ended_in_owner(self) -> bool:
        """Whether the helper exited, asked by the process that started it (children cannot tell)."""
        return os.getpid() == self._owner and self.process.poll() is not None

    def close(self) -> None:
        """Stop the helper (only the process that started it does): at the end of its stdin it kills
        the sandboxes its provider left (see :meth:`~tangram_env.server.sandbox.e2b_helper.Helper.sweep`),
        then exits.
        """
        if os.getpid() != self._owner or self.process.poll() is not None:
            return
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()
        try:
            self.process.wait(timeout=_SWEEP_S)
        except subprocess.TimeoutExpired:  # e2b is slow, or a forked child still holds the stdin pipe
            self.process.kill()
        try:
            os.unlink(self.address)
            os.rmdir(self._dir)
        except OSError:
            pass


class E2BProvider:
    """Makes :class:`E2BSandbox` es from an e2b template.

    ``templates`` maps Tangram image names to e2b templates (``default`` -> ``template``, and an
    unmapped image name is used as the template name itself); ``lifetime_s`` is how long after its
    creation e2b ends a sandbox, busy or idle (a reset makes a new one); ``api_url`` and ``domain``
    select another e2b deployment; ``retries`` is how often the SDK itself retries a 429/503 of e2b's
    API before the provider reports it busy (None: the SDK's default, 3 in e2b 2.x; the
    orchestrator's own back-off comes after those).
    """

    name = "e2b"
    host_memory = False  # its sandboxes live in e2b's cloud: the scheduler reserves no memory here for them

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
        retries: int | None = None,
    ) -> None:
        _check_sdk()
        key = api_key or os.environ.get("E2B_API_KEY")
        if not key:
            raise SandboxUnavailable("the e2b provider needs an API key: pass api_key= or set E2B_API_KEY")
        if lifetime_s <= 0 or request_timeout_s <= 0:
            raise SandboxRequestError("lifetime_s and request_timeout_s must be positive")
        if retries is not None and (not isinstance(retries, int) or retries < 0):
            raise SandboxRequestError(f"retries must be a whole number >= 0, not {retries!r}")
        self.template = template
        self.templates = dict(templates or {})
        self.lifetime_s = int(lifetime_s)
        self.connection: dict[str, Any] = {"api_key": key, "request_timeout": request_timeout_s}
        if domain:
            self.connection["domain"] = domain
        if api_url:
            self.connection["api_url"] = api_url
        if retries is not None:
            self.connection["retries"] = retries
        self.sandboxes: dict[str, E2BSandbox] = {}
        #: The e2b metadata ``tangram.owner`` of this provider's sandboxes.
        self.owner = secrets.token_hex(8)
        # Past this, a helper call has outlasted every request and retry the SDK makes for it.
        self._answer_s = 2 * request_timeout_s * (1 + (3 if retries is None else retries)) + 10
        self._link: _HelperLink | None = None
        self._link_lock = threading.Lock()
        self._lock_pid = os.getpid()

    @property
    def link(self) -> _HelperLink:
        """The helper process: started on first use, in the process that uses the provider first, and
        again by that process if it died (its sandboxes live on in e2b: the new helper reconnects).
        """
        if self._lock_pid != os.getpid():  # a forked child: a parent's thread may have held the lock
            self._link_lock, self._lock_pid = threading.Lock(), os.getpid()
        with self._link_lock:  # set-up threads that need it at once share one helper
            if self._link is None or self._link.ended_in_owner():
                self._link = _HelperLink(self.connection, self.owner, self.lifetime_s)
            return self._link

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
        """Kill every sandbox this provider made, then stop the helper."""
        for sandbox in list(self.sandboxes.values()):
            sandbox.close()
        if self._link is not None:
            self._link.close()  # the helper first kills those with our tag that nobody holds

    def call(self, op: str, *args: Any, busy_s: float = 0.0) -> Any:
        """The helper's answer to ``op(*args)``; it may take ``busy_s`` (a command's limit) beyond what
        the SDK's own requests and retries can (see :meth:`_HelperLink.call`).
        """
        return self.link.call(op, *args, wait_s=busy_s + self._answer_s)

    def start(self, spec: SandboxSpec) -> str:
        """Create the cloud sandbox; its e2b id."""
        try:
            return str(
                self.call(
                    "create", self.template_for(spec.image), self.lifetime_s, dict(spec.env), spec.network
                )
            )
        except (SandboxUnavailable, SandboxBusy):
            raise
        except SandboxError as exc:
            raise SandboxError(f"could not create an e2b sandbox: {exc}") from exc


class E2BSandbox:
    """One e2b cloud sandbox behind the :class:`~tangram_env.sandbox.Sandbox` interface.

    Its ``exec`` is a request to the helper, which kills the command at its limit: bounded, and no
    fork of the caller, so the server's own tools call it from a thread.
    """

    bounded_exec = True

    def __init__(self, provider: E2BProvider, spec: SandboxSpec) -> None:
        self._provider = provider
        self.spec = spec
        self.workspace = WORKSPACE
        self.key = f"e2b-{id(self):x}"
        self._closed = False
        #: The e2b sandbox id (it changes on reset: a reset is a fresh sandbox).
        self.id = provider.start(spec)

    def _call(self, op: str, *args: Any, busy_s: float = 0.0) -> Any:
        if self._closed:
            raise SandboxBroken("closed", self.id)
        return self._provider.call(op, self.id, *args, busy_s=busy_s)

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
        # The workspace is made by the first command that needs it (no round trip at create).
        script = f"mkdir -p {WORKSPACE} && cd {shlex.quote(where)} && {{ {command}\n}}"
        done = self._call(
            "exec",
            script,
            envs,
            limit,
            stdin,
            self.spec.max_output_bytes,
            self.spec.output_kill_bytes,
            busy_s=limit + END_GRACE_S,  # the helper waits that long past the limit for a withheld end
        )
        return map_outcome(self.spec, **done)

    def write_file(self, path: str, data: bytes | str) -> None:
        """Write ``data`` at ``path`` (relative paths are under the workspace)."""
        try:
            self._call("write", self._path(path), data)
        except SandboxError:
            raise
        except OSError as exc:
            raise SandboxError(f"cannot write {path!r} in e2b sandbox {self.id}: {exc}") from exc

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """The bytes at ``path`` (FileNotFoundError if it does not exist); the download stops past
        ``max_bytes`` (:class:`~tangram_env.sandbox.SandboxFileTooLarge`).
        """
        return bytes(self._call("read", self._path(path), max_bytes))

    def _path(self, path: str) -> str:
        if not path or "\0" in path:
            raise SandboxRequestError(f"bad path {path!r}")
        return path if path.startswith("/") else posixpath.join(WORKSPACE, path)

    def reset(self) -> None:
        """Replace the cloud sandbox with a fresh one of the same template."""
        if self._closed:  # a new one now would be nobody's to close
            raise SandboxBroken("closed: a closed e2b sandbox cannot be reset; create a new one", self.id)
        old = self.id
        self.id = self._provider.start(self.spec)
        if self._closed:  # closed by another thread meanwhile, which killed the old one only
            self._provider.call("kill", self.id)
        self._provider.call("kill", old)

    def health(self) -> str | None:
        """None while the cloud sandbox answers, else why not."""
        if self._closed:
            return "closed"
        try:
            answer: str | None = self._call("health")
        except SandboxError as exc:
            return f"e2b sandbox unreachable: {exc}"
        return answer

    def close(self) -> None:
        """Kill the cloud sandbox."""
        if self._closed:
            return
        self._closed = True
        try:
            self._provider.call("kill", self.id)  # the helper tries again if e2b fails it
        except SandboxError:  # the helper hung: the one running at our close (or exit) kills it
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
