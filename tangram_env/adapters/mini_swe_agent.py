"""mini-swe-agent on Tangram: an ``Environment`` whose commands run in a Tangram sandbox session.

    from minisweagent.agents.default import DefaultAgent
    from tangram_env.adapters.mini_swe_agent import TangramEnvironment

    env = TangramEnvironment.for_swe_bench(instance)         # the instance's image, cwd = its repository
    agent = DefaultAgent(model, env, system_template=..., instance_template=...)
    result = agent.run(instance.problem_statement)
    grade = env.grade(result["submission"])                   # SWE-bench's report, graded by Tangram
    env.close()

Each ``execute`` is one ``bash`` action with the session's affinity: the scheduler queues it for cores
like any other action and the sandbox holds none while the model thinks. The sandbox keeps the
agent's files between commands, but nothing a command starts outlives it (a server started with
``&`` is killed when its command ends; docs/mini-swe-agent.md says what to tell the agent). A
command's non-zero exit or time-out, and a command the sandbox refuses as given (a NUL byte in it,
say), are the agent's business (an observation, as with mini-swe-agent's own environments); a
failure of the infrastructure (no sandbox, a lost sandbox or worker, no server) raises, so it never
becomes a reward.
Install with ``pip install "tangram-env[mini-swe-agent]"``.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import shlex
import uuid
from typing import Any

from minisweagent.exceptions import Submitted
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tangram_env.client import Client
from tangram_env.errors import ActionError, ActionRejected, ClosedEnvError, did_you_mean
from tangram_env.session import CommandResult, SandboxSession
from tangram_env.shell_tools import MAX_BASH_TIMEOUT_S, MAX_COMMAND, MAX_FILE_BYTES

#: The first line of output by which a mini-swe-agent agent hands in its work.
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: The last argument of an interpreter that takes its program as an argument: ``-c``, ``-lc``, ...
_PROGRAM_FLAG = re.compile(r"-[A-Za-z]*c")
#: Fields of mini-swe-agent's Docker environment that have no meaning for a Tangram sandbox.
_DOCKER_ONLY = {
    "executable": "the orchestrator runs the sandboxes; there is no docker command to name",
    "run_args": "the orchestrator starts the sandbox; its limits are the image's sandbox settings",
    "container_timeout": "the sandbox is held until the environment is closed",
    "pull_timeout": "images are prepared on the orchestrator's side, not pulled per environment",
}
#: How the orchestrator (``bad_payload``) and the client say they refused a call for its arguments.
_REFUSED_ARGUMENTS = ("bad_payload: arguments of", "the action cannot be sent:")
#: How the sandbox says it refused the command line itself (the bash tool's exception, as sent back).
_REFUSED_COMMAND = ("SandboxRequestError: a command ", "SandboxRequestError: empty command")


class TangramEnvironmentConfig(BaseModel):
    """Where and how commands run: mini-swe-agent's ``cwd``, ``env``, ``forward_env``, ``timeout`` and
    ``interpreter`` (as its Docker environment reads them), and the sandbox's ``image``. Other keys are
    refused: a setting that would be ignored is a mistake.
    """

    model_config = ConfigDict(extra="forbid")

    image: str = "default"
    cwd: str = ""
    env: dict[str, str] = {}
    forward_env: list[str] = []
    timeout: int = Field(30, gt=0, le=MAX_BASH_TIMEOUT_S)
    interpreter: list[str] = Field(["bash", "-c"], min_length=1)
    address: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields_only(cls, data: Any) -> Any:
        # Said here rather than by extra="forbid" alone, whose error names neither why nor the fields.
        if isinstance(data, dict):
            for name in data:
                if name in _DOCKER_ONLY:
                    raise ValueError(
                        f"{name!r} is a setting of mini-swe-agent's Docker environment with no meaning "
                        f"for a Tangram sandbox ({_DOCKER_ONLY[name]}): leave it out"
                    )
                if name not in cls.model_fields:
                    known = list(cls.model_fields)
                    raise ValueError(
                        f"unknown field {name!r}{did_you_mean(str(name), known, n=1)} (known: "
                        f"{', '.join(known)})"
                    )
        return data

    @field_validator("env")
    @classmethod
    def _names(cls, env: dict[str, str]) -> dict[str, str]:
        bad = [name for name in env if not _ENV_NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"not environment variable names: {bad}")
        if any("\0" in value for value in env.values()):  # else every command would be refused
            raise ValueError("environment variable values may not contain NUL bytes")
        return env

    @field_validator("forward_env")
    @classmethod
    def _forwarded_names(cls, names: list[str]) -> list[str]:
        bad = [name for name in names if not _ENV_NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"not environment variable names: {bad}")
        return names


class _Unrunnable(ValueError):
    """A command this environment cannot run as given: an observation for the agent, not a failure."""


def _refused_as_asked(exc: ActionError) -> bool:
    """Whether the call was refused for what it asked (its command, its time limit): the caller's
    mistake, for the agent to read. Anything else (a lost sandbox or worker, a session limit, an image
    the server refuses) is the infrastructure's, and must never turn into an observation.
    """
    if isinstance(exc, ActionRejected):
        return exc.message.startswith(_REFUSED_ARGUMENTS)
    return exc.error_type == "error" and exc.message.startswith(_REFUSED_COMMAND)


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
        """An environment on a SWE-bench instance's image, starting in its repository.

        A ``cwd`` of ``/testbed`` (mini-swe-agent's ``swebench.yaml``), or a path under it, names the
        repository where SWE-bench's official images keep it: it is taken to the instance's own
        repository (``instance.workdir``; the workspace for instances whose image is not an official
        one). Any other ``cwd`` is used as given.
        """
        from tangram_env.envs.swe_bench.instance import TESTBED

        kwargs.setdefault("image", instance.sandbox_image)
        repository = instance.workdir or ""
        cwd = kwargs.get("cwd")
        if cwd is None:
            kwargs["cwd"] = repository
        elif cwd == TESTBED or cwd.startswith(TESTBED + "/"):
            inside = cwd[len(TESTBED) :].strip("/")
            kwargs["cwd"] = "/".join(p for p in (repository, inside) if p)
        env = cls(**kwargs)
        env.instance = instance
        return env

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` in the sandbox; mini-swe-agent's output dict (stderr merged in).

        As in mini-swe-agent's own environments, what stops the command (its time limit, a directory
        that does not exist, a command or call the sandbox refuses as given) is an observation:
        ``returncode`` -1 and ``exception_info``; the environment stays open. A failure of the
        infrastructure (a lost sandbox or worker, no server) closes the environment and raises. So
        does an interrupted call (Ctrl-C, a cancelled task): its command may still be changing the files.
        """
        command = str(action.get("command", ""))
        where = cwd or self.config.cwd
        limit = timeout or self.config.timeout
        try:
            out, cd_failed = self._run(command, where, limit)
        except _Unrunnable as exc:
            return self._stopped("", str(exc), "ValueError")
        except ActionError as exc:
            if not _refused_as_asked(exc):
                self.close()
                raise
            return self._stopped("", exc.message, type(exc).__name__)
        except BaseException:
            self.close()
            raise
        if self.session.closed:  # closed under the command: no observation for anyone
            raise ClosedEnvError(f"the environment was closed while {command[:60]!r} ran")
        # Universal newlines, as mini-swe-agent's own environments read output (text-mode pipes).
        text = (out.stdout + out.stderr).replace("\r\n", "\n").replace("\r", "\n")
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
        forwarded = {k: os.environ[k] for k in self.config.forward_env if k in os.environ}
        # env wins over forward_env, as in mini-swe-agent's Docker environment
        lines += [f"export {k}={shlex.quote(v)}" for k, v in {**forwarded, **self.config.env}.items()]
        if where:
            lines.append(f"cd -- {shlex.quote(where)} || {{ echo; echo {nonce}; exit 1; }}")
        run = f"exec {shlex.join(self.config.interpreter)} {shlex.quote(command)}"
        script = "\n".join([*lines, run])
        # The kernel caps one argument of exec in bytes (128 KiB), and the command is one twice over
        # (the bash tool's script, then the interpreter's program): a longer one runs from a file.
        if len(script.encode("utf-8", "surrogatepass")) > MAX_COMMAND:
            script = self._from_file(command, lines, nonce)
        out = self.session.bash(script, timeout_s=limit, max_output=MAX_FILE_BYTES)
        marker = f"\n{nonce}\n"
        if where and out.stdout.endswith(marker):
            return dataclasses.replace(out, stdout=out.stdout[: -len(marker)]), True
        return out, False

    def _from_file(self, command: str, lines: list[str], nonce: str) -> str:
        """The script that runs ``command`` from a file in the sandbox's /tmp, written here."""
        size = len(command.encode("utf-8", "surrogatepass"))
        if size > MAX_FILE_BYTES:
            raise _Unrunnable(
                f"the command is {size} bytes, more than the {MAX_FILE_BYTES} a command may have: "
                "write long content into files in parts"
            )
        if "\0" in command:  # the sandbox refuses NUL bytes in a command line; a file would hide them
            raise _Unrunnable("a command may not contain NUL bytes")
        *program, flag = self.config.interpreter
        if not program or not _PROGRAM_FLAG.fullmatch(flag):
            raise _Unrunnable(
                f"the command is {size} bytes, too long for a command line, and the interpreter "
                f"{self.config.interpreter} cannot run it from a file (that needs one whose last "
                "argument is -c, like bash -c or python3 -c): shorten the command"
            )
        if flag != "-c":
            program.append(flag[:-1])  # -lc takes the program's text; -l then a file runs the file
        try:
            data = command.encode("utf-8")
        except UnicodeEncodeError as exc:  # as the client refuses a short one: the agent's to read
            raise _Unrunnable(f"the command is not valid text: {exc}") from None
        path = f"/tmp/.mini-swe-agent-{nonce}"
        self.session.write_file(path, data)
        # Opened, then deleted before the command runs: nothing of it stays in the sandbox or its diff.
        opened = f"exec 9< {path} && rm -f -- {path} || exit 126"
        return "\n".join([lines[0], opened, *lines[1:], f"exec {shlex.join(program)} /dev/fd/9"])

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
