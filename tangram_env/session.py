"""Sandbox sessions as a public API, for agents that bring their own loop.

    async with client.sandbox(image="default") as box:       # client: an AsyncClient
        out = await box.bash("python -c 'print(6 * 7)'", timeout_s=30)
        await box.write_file("notes.txt", "hello")
        text = await box.read_file("notes.txt")

    with client.sandbox() as box:                             # client: a Client (the sync twin)
        box.bash("ls")

A session is a name for one sandbox that keeps its files between calls; the sandbox itself is taken
from the warm pool on the first call and goes back (reset) when the session closes. Each ``bash`` call
is a fresh shell, and with the local and Docker providers nothing it starts outlives it: processes it
leaves running (``cmd &``, ``nohup``) are killed when it ends (e2b's go on; docs/sandboxes.md), so a
server a test needs is started, used and stopped in one call.
Every call is one action the scheduler sees, with the session's affinity: it queues for cores like
any other action, holds none while the agent thinks, and fails with the typed errors of
:mod:`tangram_env.errors` (a command that exits non-zero is a :class:`CommandResult`, not an error).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from tangram_env.errors import did_you_mean
from tangram_env.protocol import Action, Result

#: The action kinds a session calls (registered by the ``tangram_env.envs.tools`` plugin).
BASH, READ_FILE, WRITE_FILE = "bash", "read_file", "write_file"
#: Seconds an action may run past its command's own time limit (start-up, output collection).
_MARGIN_S = 15.0


@dataclass(frozen=True)
class CommandResult:
    """What one ``bash`` call did: exit code, output (cut at the tool's limit) and why it stopped."""

    exit_code: int
    stdout: str
    stderr: str
    truncated: bool = False
    killed_by: str | None = None
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Exited with status 0 and was not killed."""
        return self.exit_code == 0 and self.killed_by is None

    @property
    def output(self) -> str:
        """The standard output, then the standard error."""
        return self.stdout + self.stderr


_OPTIONS = ("image", "session_id", "env_id", "deadline_s", "priority")


class _Session:
    """What the sync and async sessions share: the session's identity and how its actions look."""

    def __init__(
        self,
        client: Any,
        *,
        image: str = "default",
        session_id: str | None = None,
        env_id: str = "sandbox",
        deadline_s: float | None = None,
        priority: int = 0,
        **unknown: Any,
    ) -> None:
        if unknown:
            name = next(iter(unknown))
            raise TypeError(
                f"unknown sandbox option {name!r}{did_you_mean(name, _OPTIONS)}: the options are "
                f"{', '.join(_OPTIONS)}; a sandbox's limits (memory, disk, processes) come from the "
                "orchestrator's sandbox settings for its image (docs/sandboxes.md)"
            )
        self.client = client
        self.image = image
        self.session_id = session_id or f"{uuid.uuid4().hex}-sbx"
        self.env_id = env_id
        self.deadline_s = deadline_s
        self.priority = priority
        self.closed = False

    def _action(self, kind: str, payload: dict[str, Any], timeout_s: float | None = None) -> Action:
        if self.closed:
            from tangram_env.errors import ClosedEnvError

            raise ClosedEnvError(f"sandbox session {self.session_id} is closed")
        return Action(
            kind=kind,
            payload=payload,
            affinity=self.session_id,
            image=self.image,
            trajectory_id=self.session_id,
            env_id=self.env_id,
            timeout_s=None if timeout_s is None else timeout_s + _MARGIN_S,
            deadline_s=self.deadline_s,
            priority=self.priority,
        )

    def _bash_action(self, command: str, timeout_s: float | None, max_output: int | None) -> Action:
        payload: dict[str, Any] = {"command": command}
        if timeout_s is not None:
            payload["timeout_s"] = timeout_s
        if max_output is not None:
            payload["max_output"] = max_output
        return self._action(BASH, payload, timeout_s)

    def _read_action(self, path: str) -> Action:
        return self._action(READ_FILE, {"path": path})

    def _write_action(self, path: str, data: bytes | str) -> Action:
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        return self._action(WRITE_FILE, {"path": path, "data": raw})

    @staticmethod
    def _command(result: Result) -> CommandResult:
        value = result.unwrap()
        return CommandResult(
            exit_code=int(value["exit_code"]),
            stdout=value.get("stdout", ""),
            stderr=value.get("stderr", ""),
            truncated=bool(value.get("truncated", False)),
            killed_by=value.get("killed_by"),
            wall_s=float(value.get("wall_s", 0.0)),
        )

    @staticmethod
    def _bytes(result: Result) -> bytes:
        return bytes(result.unwrap()["data"])

    def _end(self) -> None:
        if not self.closed:
            self.closed = True
            self.client.close_sessions([self.session_id])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(session_id={self.session_id!r}, image={self.image!r})"


class SandboxSession(_Session):
    """A sandbox session for sync code; made by :meth:`Client.sandbox <tangram_env.client.Client.sandbox>`.

    ``image``: the sandbox image; ``deadline_s``: a limit on each call from submission to result
    (queueing included); ``priority``: the scheduler's hint for every call; ``env_id``: the name the
    calls are accounted under.
    """

    def bash(
        self, command: str, *, timeout_s: float | None = None, max_output: int | None = None
    ) -> CommandResult:
        """Run ``command`` with bash in the session's workspace (a fresh shell each call).
        ``max_output``: characters of stdout, and of stderr, to return (default 30,000; at most 4 MiB,
        and the sandbox's ``max_output_bytes``); the middle of longer output is cut, ``truncated`` set.
        """
        return self._command(self.client.run(**_fields(self._bash_action(command, timeout_s, max_output))))

    def read_file(self, path: str) -> bytes:
        """The bytes of ``path`` (relative paths are under the workspace)."""
        return self._bytes(self.client.run(**_fields(self._read_action(path))))

    def write_file(self, path: str, data: bytes | str) -> None:
        """Write ``data`` at ``path``, making parent directories (str is written as UTF-8)."""
        self.client.run(**_fields(self._write_action(path, data))).unwrap()

    def close(self) -> None:
        """End the session: the sandbox is reset and goes back to the warm pool."""
        self._end()

    def __enter__(self) -> SandboxSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSandboxSession(_Session):
    """The asyncio twin of :class:`SandboxSession`; made by :meth:`AsyncClient.sandbox`."""

    async def bash(
        self, command: str, *, timeout_s: float | None = None, max_output: int | None = None
    ) -> CommandResult:
        """Run ``command`` with bash in the session's workspace (a fresh shell each call; see
        :meth:`SandboxSession.bash`).
        """
        (result,) = await self.client.gather([self._bash_action(command, timeout_s, max_output)])
        return self._command(result)

    async def read_file(self, path: str) -> bytes:
        """The bytes of ``path`` (relative paths are under the workspace)."""
        (result,) = await self.client.gather([self._read_action(path)])
        return self._bytes(result)

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Write ``data`` at ``path``, making parent directories (str is written as UTF-8)."""
        (result,) = await self.client.gather([self._write_action(path, data)])
        result.unwrap()

    async def aclose(self) -> None:
        """End the session: the sandbox is reset and goes back to the warm pool."""
        self._end()

    async def __aenter__(self) -> AsyncSandboxSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _fields(action: Action) -> dict[str, Any]:
    """An action as :meth:`Client.run`'s keyword arguments (so it takes the client's fast path)."""
    return {**action.model_dump(exclude_none=True, exclude={"id"}), "id": action.id}
