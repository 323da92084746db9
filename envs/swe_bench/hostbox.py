"""A directory on this host with the ``exec`` method of a sandbox, for prepare-time validation.

Prepare builds and checks instances from the project's own pinned packages before any sandbox image
exists; it runs the same grading code as the env does, through this class. It isolates nothing and is
never used for an agent's commands.
"""

from __future__ import annotations

import os
import subprocess
import time

from tangram_env.sandbox import ExecResult

_CAP = 8 << 20


class HostBox:
    """Runs commands as subprocesses in ``workspace`` (``scratch`` replaces grading's /tmp folder)."""

    def __init__(self, workspace: str, scratch: str, env: dict[str, str] | None = None) -> None:
        self.id = f"host:{workspace}"
        self.workspace = workspace
        self.scratch = scratch
        self.env = dict(env or {})

    def exec(
        self,
        cmd: str | list[str],
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        cores: tuple[int, ...] = (),
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run ``cmd`` (a shell string or argv) in ``cwd`` (default the workspace)."""
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        started = time.monotonic()
        try:
            done = subprocess.run(
                argv,
                cwd=cwd or self.workspace,
                input=stdin if stdin is not None else b"",
                capture_output=True,
                timeout=timeout_s,
                env={**os.environ, **self.env, **(env or {})},
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            return ExecResult(
                exit_code=-9,
                stdout=_text(exc.stdout),
                stderr=_text(exc.stderr),
                wall_s=time.monotonic() - started,
                killed_by="timeout",
            )
        return ExecResult(
            exit_code=done.returncode,
            stdout=_text(done.stdout),
            stderr=_text(done.stderr),
            wall_s=time.monotonic() - started,
        )


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    raw = data if isinstance(data, bytes) else data.encode()
    return raw[:_CAP].decode("utf-8", "replace")
