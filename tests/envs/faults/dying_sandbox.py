"""A sandbox provider for fault injection: local sandboxes that die mid-command when told to.

An exec whose stdin holds :data:`MARKER` (a solution of the ``code`` env carrying it in a comment, say)
has every process of its sandbox killed ``DELAY_S`` seconds after it starts, and the sandbox marked
broken, the way the local provider itself marks a sandbox it can no longer trust. Everything is real:
the processes die by SIGKILL and the next use of the sandbox raises ``SandboxBroken``.
Declared to the server as the ``dying`` provider through an entry point (see ``test_code_hacks``).
"""

from __future__ import annotations

import threading
from typing import Any

from tangram_env.sandbox import ExecResult, SandboxSpec
from tangram_env.server.sandbox.local import LocalProvider, LocalSandbox

MARKER = b"tangram-test: kill this sandbox mid-command"
DELAY_S = 0.5


class DyingSandbox(LocalSandbox):
    """A local sandbox whose marked commands are killed from outside while they run.

    It offers no host paths, so the ``code`` env grades in it with a fresh harness per grading (whose
    stdin carries the marker); ``test_code_warm`` kills a warm judge's sandbox mid-grade itself.
    """

    host_path = None  # type: ignore[assignment]

    def exec(self, cmd: str | list[str], *args: Any, stdin: bytes | None = None, **kwargs: Any) -> ExecResult:
        """Run ``cmd``; if ``stdin`` holds the marker, kill the sandbox after :data:`DELAY_S`."""
        if stdin and MARKER in stdin:
            threading.Timer(DELAY_S, self._die).start()
        return super().exec(cmd, *args, stdin=stdin, **kwargs)

    def _die(self) -> None:  # as a provider that gives up on a sandbox: mark it, then kill it
        self._mark_broken("killed by the test's fault injection")
        self._kill_everything()


class DyingProvider(LocalProvider):
    """The local provider, making :class:`DyingSandbox` es."""

    name = "dying"

    def create(self, spec: SandboxSpec) -> LocalSandbox:
        """A new sandbox (see :class:`DyingSandbox`)."""
        sandbox = super().create(spec)
        sandbox.__class__ = DyingSandbox
        return sandbox
