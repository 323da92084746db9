"""mini-swe-agent on Tangram: an ``Environment`` whose commands run in a Tangram sandbox session.

    from minisweagent.agents.default import DefaultAgent
    from tangram_env.adapters.mini_swe_agent import TangramEnvironment

    env = TangramEnvironment.for_swe_bench(instance)         # the instance's image, cwd = its repository
    agent = DefaultAgent(model, env, system_template=..., instance_template=...)
    result = agent.run(instance.problem_statement)
    grade = env.grade(result["submission"])                   # SWE-bench's report, graded by Tangram
    env.close()

Each ``execute`` is one ``bash`` action with the session's affinity: the scheduler queues it for cores
like any other action and the sandbox holds none while the model thinks. A command's non-zero exit
or time-out is the agent's business (an observation, as with mini-swe-agent's own environments); a
failure of the infrastructure (no sandbox, a lost worker) raises, so it never becomes a reward.
Install with ``pip install "tangram-env[mini-swe-agent]"``.
"""

from __future__ import annotations

import dataclasses
import platform
import re
import shlex
import uuid
from typing import Any

from minisweagent.exceptions import Submitted
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tangram_env.client import Client
from tangram_env.errors import ActionRejected, ClosedEnvError
from tangram_env.session import CommandResult, SandboxSession
from tangram_env.shell_tools import MAX_BASH_TIMEOUT_S, MAX_COMMAND, MAX_FILE_BYTES

#: The first line of output by which a mini-swe-agent agent hands in its work.
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class TangramEnvironmentConfig(BaseModel):
    """Where and how commands run: mini-swe-agent's ``cwd``, ``env``, ``timeout`` and ``interpreter``
    (as its Docker environment reads them), and the sandbox's ``image``. Unknown keys are refused:
    a setting that would be ignored is a mistake.
    """

    model_config = ConfigDict(extra="forbid")

    image: str = "default"
    cwd: str = ""
    env: dict[str, str] = {}
    timeout: int = Field(30, gt=0, le=MAX_BASH_TIMEOUT_S)
    interpreter: list[str] = Field(["bash", "-c"], min_length=1)
    address: str | None = None

    @field_validator("env")
    @classmethod
    def _names(cls, env: dict[str, str]) -> dict[str, str]:
        bad = [name for name in env if not _ENV_NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"not environment variable names: {bad}")
        return env


class TangramEnvironment:
    """A mini-swe-agent ``Environment`` backed by one Tangram sandbox session.

    ``client``: a :class:`~tangram_env.client.Client` to share (default: one of its own, at
    ``address`` or the embedded orchestrator). Other keyword arguments are
    :class:`TangramEnvironmentConfig` fields. Use it in a ``with`` block (or call :meth:`close`):
    the sandbox is held until then.
    """

    def __init__(
        self,
        *,
        client: Client | None = None,
        config_class: type[TangramEnvironmentConfig] = TangramEnvironmentConfig,
        **kwargs: Any,
    ) -> None:
        self.config = config_class(**kwargs)
        self._owns_client = client is None
        self.client = client if client is not None else Client(self.config.address)
        self.session: SandboxSession = self.client.sandbox(image=self.config.image, env_id="mini-swe-agent")
        self.instance: Any = None

    @classmethod
    def for_swe_bench(cls, instance: Any, **kwargs: Any) -> TangramEnvironment:
        """An environment on a SWE-bench instance's image, starting in its repository."""
        kwargs.setdefault("image", instance.sandbox_image)
        kwargs.setdefault("cwd", instance.workdir or "")
        env = cls(**kwargs)
        env.instance = instance
        return env

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` in the sandbox; mini-swe-agent's output dict (stderr merged in).

        As in mini-swe-agent's own environments, what stops the command (its time limit, a directory
        that does not exist, a call out of range) is an observation: ``returncode`` -1 and
        ``exception_info``. A failure of the infrastructure raises. An interrupted call (Ctrl-C, a
        cancelled task) closes the environment: its command may still be changing the files.
        """
        command = str(action.get("command", ""))
        where = cwd or self.config.cwd
        limit = timeout or self.config.timeout
        try:
            out, cd_failed = self._run(command, where, limit)
        except ActionRejected as exc:  # refused as called (a time limit out of range): the agent's to read
            return self._stopped("", str(exc), type(exc).__name__)
        except BaseException:
            self.close()
            raise
        if self.session.closed:  # closed under the command: no observation for anyone
            raise ClosedEnvError(f"the environment was closed while {command[:60]!r} ran")
        text = out.stdout + out.stderr
        if cd_failed:
            return self._stopped(text, f"cannot change to the directory {where!r}", "NotADirectoryError")
        if out.killed_by is not None:
            stop = f"it ran past its time limit of {limit} s" if out.killed_by == "timeout" else out.killed_by
            return self._stopped(text, f"the command was stopped ({stop})", "CommandStopped")
        output = {"output": text, "returncode": out.exit_code, "exception_info": ""}
        if out.truncated:  # never a cut submission: a patch missing its middle would grade as a failure
            output["exception_info"] = (
                f"The output was longer than {MAX_FILE_BYTES} characters (or the sandbox's output limit) "
                "and its middle was cut."
            )
        else:
            self._check_finished(output)
        return output

    def _run(self, command: str, where: str, limit: int) -> tuple[CommandResult, bool]:
        """The command's result, and whether it never ran because ``where`` could not be entered."""
        nonce = uuid.uuid4().hex  # unguessable: only the prelude can print it
        lines = ["exec 2>&1"]  # one stream, in order, as mini-swe-agent's own environments give it
        lines += [f"export {k}={shlex.quote(v)}" for k, v in self.config.env.items()]
        if where:
            lines.append(f"cd -- {shlex.quote(where)} || {{ echo; echo {nonce}; exit 1; }}")
        lines.append(f"exec {shlex.join(self.config.interpreter)} {shlex.quote(command)}")
        script = "\n".join(lines)
        if len(script) > MAX_COMMAND:  # too long for one argument of exec: run it from a file
            name = f".mini-swe-agent-{nonce}.sh"
            self.session.write_file(name, f'rm -f -- "$0"\n{script}\n')  # gone before the command runs
            script = f"exec bash {name}"
        out = self.session.bash(script, timeout_s=limit, max_output=MAX_FILE_BYTES)
        marker = f"\n{nonce}\n"
        if where and out.stdout.endswith(marker):
            return dataclasses.replace(out, stdout=out.stdout[: -len(marker)]), True
        return out, False

    @staticmethod
    def _stopped(output: str, why: str, kind: str) -> dict[str, Any]:
        return {
            "output": output,
            "returncode": -1,
            "exception_info": f"An error occurred while executing the command: {why}",
            "extra": {"exception_type": kind, "exception": why},
        }

    def _check_finished(self, output: dict[str, Any]) -> None:
        """Raise mini-swe-agent's ``Submitted`` when the command's output hands in the work."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )

    def grade(self, patch: str | None, *, timeout_s: float = 900.0) -> dict[str, Any]:
        """Grade ``patch`` on the SWE-bench instance in a fresh sandbox; SWE-bench's report with
        ``resolved``. A grading that could not run raises the action's typed error (never a 0).
        """
        if self.instance is None:
            raise ValueError("grade() needs a SWE-bench instance: make the environment with for_swe_bench()")
        from tangram_env.envs.swe_bench import grade_action

        (future,) = self.client.submit([grade_action(self.instance, patch or None, timeout_s)])
        return dict(future.result().unwrap())

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """What mini-swe-agent's prompt templates may use: the config, the platform, ``kwargs``."""
        return {**self.config.model_dump(), **platform.uname()._asdict(), **kwargs}

    def serialize(self) -> dict[str, Any]:
        """The environment's part of a saved trajectory."""
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{type(self).__module__}.{type(self).__name__}",
                    "session_id": self.session.session_id,
                }
            }
        }

    def close(self) -> None:
        """End the sandbox session (and the client, if this environment made it)."""
        self.session.close()
        if self._owns_client:
            self.client.close()

    cleanup = close  # the name mini-swe-agent's environments give it

    def __enter__(self) -> TangramEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort: a forgotten environment still frees its sandbox
        session = getattr(self, "session", None)
        if session is not None and not session.closed:
            try:
                self.close()
            except Exception:
                pass
