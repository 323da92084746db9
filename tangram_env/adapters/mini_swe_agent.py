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

import platform
import shlex
from typing import Any

from minisweagent.exceptions import Submitted
from pydantic import BaseModel

from tangram_env.client import Client
from tangram_env.session import SandboxSession

#: The first line of output by which a mini-swe-agent agent hands in its work.
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class TangramEnvironmentConfig(BaseModel):
    """Where and how commands run (mini-swe-agent reads ``cwd``, ``env`` and ``timeout`` as it does for
    its local environment).
    """

    image: str = "default"
    cwd: str = ""
    env: dict[str, str] = {}
    timeout: int = 30
    address: str | None = None


class TangramEnvironment:
    """A mini-swe-agent ``Environment`` backed by one Tangram sandbox session.

    ``client``: a :class:`~tangram_env.client.Client` to share (default: one of its own, at
    ``address`` or the embedded orchestrator). Other keyword arguments are
    :class:`TangramEnvironmentConfig` fields.
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
        """Run ``action["command"]`` in the sandbox; mini-swe-agent's output dict (stderr merged in)."""
        command = str(action.get("command", ""))
        prelude = ["exec 2>&1"]  # one stream, in order, as mini-swe-agent's own environments give it
        prelude += [f"export {k}={shlex.quote(v)}" for k, v in self.config.env.items()]
        where = cwd or self.config.cwd
        if where:
            prelude.append(f"cd {shlex.quote(where)}")
        limit = timeout or self.config.timeout
        out = self.session.bash("\n".join([*prelude, command]), timeout_s=limit)
        output: dict[str, Any] = {
            "output": out.stdout + out.stderr,
            "returncode": out.exit_code,
            "exception_info": "",
        }
        if out.killed_by is not None:
            output["returncode"] = -1
            output["exception_info"] = f"The command was stopped ({out.killed_by}; time limit {limit} s)."
        self._check_finished(output)
        return output

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
