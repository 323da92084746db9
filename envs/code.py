"""The ``code`` env: write a Python function; the task's unit tests grade it in a sandbox.

Observation: the task (problem text and function signature), then after each submission the test
feedback. Action: the agent's Python source as text. Reward: the fraction of tests passed (1.0 all).
The agent may resubmit after seeing failures, up to ``max_turns`` submissions.
"""

from __future__ import annotations

import json
import string
import uuid
from importlib import resources
from typing import Any

from gymnasium import spaces
from pydantic import BaseModel, Field

from tangram_env.env import EnvGen, TangramEnv
from tangram_env.kinds import ActionContext, tool
from tangram_env.protocol import Action

MAX_SOURCE = 100_000
OUTPUT_CAP = 8_192  # stdout/stderr kept in info, per stream
TEXT_CHARSET = string.printable


class RunTestsArgs(BaseModel):
    """Grade ``source`` against the tests of task ``task_id``."""

    task_id: str = Field(description="id of a task of the code env")
    source: str = Field(max_length=MAX_SOURCE, description="Python source defining the task's entry point")
    per_test_timeout_s: float = Field(2.0, gt=0, le=30, description="time limit of each test")


def _cap(text: str, limit: int = OUTPUT_CAP) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters cut]"


@tool(name="code.run_tests", placement="sandbox", cpu=1, mem_mb=512, timeout_s=60)
def run_tests(args: RunTestsArgs, ctx: ActionContext) -> dict[str, Any]:
    """Run a code task's unit tests against a submitted solution, in a sandbox."""
    from tangram_env.envs.code_tasks import get_task

    task = get_task(args.task_id)
    sandbox = ctx.sandbox
    nonce = uuid.uuid4().hex
    spec = {
        "source": args.source,
        "entry_point": task.entry_point,
        "tests": [t.model_dump() for t in task.tests],
        "timeout_s": args.per_test_timeout_s,
        "nonce": nonce,
    }
    harness = (resources.files("tangram_env.envs.code_tasks") / "harness.py").read_text()
    sandbox.write_file("harness.py", harness)
    sandbox.write_file("spec.json", json.dumps(spec))
    limit = min(ctx.remaining() - 1.0, args.per_test_timeout_s * len(task.tests) + 10.0)
    run = sandbox.exec(
        ["python3", "-I", "harness.py", "spec.json", "report.json"],
        timeout_s=max(1.0, limit),
        cores=ctx.cores,
    )
    try:
        report = json.loads(sandbox.read_file("report.json"))
        if report.get("nonce") != nonce:
            report = {"tests": [], "import_error": "the test report was tampered with"}
    except (OSError, ValueError) as exc:
        report = {"tests": [], "import_error": None, "report_error": f"no test report ({type(exc).__name__})"}
    reported = {t["name"]: t for t in report.get("tests", []) if isinstance(t, dict) and "name" in t}
    tests = []
    for t in task.tests:  # a test with no report (the process died first) failed
        entry = reported.get(t.name)
        tests.append(
            {
                "name": t.name,
                "passed": bool(entry and entry.get("passed") is True),
                "error": (entry or {}).get("error")
                or (None if entry else _why_unreported(run.killed_by, run.exit_code)),
            }
        )
    passed = sum(t["passed"] for t in tests)
    return {
        "task_id": task.id,
        "passed": passed,
        "total": len(tests),
        "tests": tests,
        "import_error": report.get("import_error"),
        "stdout": _cap(run.stdout),
        "stderr": _cap(run.stderr),
        "exit_code": run.exit_code,
        "killed_by": run.killed_by,
        "wall_s": run.wall_s,
    }


def _why_unreported(killed_by: str | None, exit_code: int) -> str:
    if killed_by:
        return f"not run: the solution's process was killed ({killed_by})"
    return f"not run: the solution's process ended early (exit code {exit_code})"


class CodeEnv(TangramEnv[str, str]):
    """Solve one programming task per episode; see the module docstring."""

    metadata: dict[str, Any] = {"render_modes": ["ansi"]}

    def __init__(
        self,
        *,
        max_turns: int = 3,
        task_ids: list[str] | None = None,
        per_test_timeout_s: float = 2.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        from tangram_env.envs.code_tasks import get_task, load_tasks

        self.tasks = [get_task(t) for t in task_ids] if task_ids else load_tasks()
        self.max_turns = max_turns
        self.per_test_timeout_s = per_test_timeout_s
        self.observation_space = spaces.Text(max_length=MAX_SOURCE, min_length=0, charset=TEXT_CHARSET)
        self.action_space = spaces.Text(max_length=MAX_SOURCE, min_length=0, charset=TEXT_CHARSET)
        self.task = self.tasks[0]
        self.turn = 0
        self._observation = ""

    def _describe_task(self) -> str:
        return (
            f"# Task: {self.task.title}\n\n{self.task.prompt}\n\nWrite a Python function with this signature:\n\n"
            f"    {self.task.signature}\n\nReply with the complete source code."
        )

    def _reset(
        self, *, seed: int | None, options: dict[str, Any] | None
    ) -> EnvGen[tuple[str, dict[str, Any]]]:
        task_id = (options or {}).get("task_id")
        if task_id is not None:
            from tangram_env.envs.code_tasks import get_task

            self.task = get_task(task_id)
        else:
            self.task = self.tasks[int(self.np_random.integers(len(self.tasks)))]
        self.turn = 0
        self._observation = self._describe_task()
        return self._observation, {"task_id": self.task.id, "max_turns": self.max_turns}
        yield []  # a reset needs no action

    def _step(self, action: str) -> EnvGen[tuple[str, float, bool, bool, dict[str, Any]]]:
        self.turn += 1
        (result,) = yield [
            Action(
                kind="code.run_tests",
                payload={
                    "task_id": self.task.id,
                    "source": str(action)[:MAX_SOURCE],
                    "per_test_timeout_s": self.per_test_timeout_s,
                },
            )
        ]
        info: dict[str, Any] = {"task_id": self.task.id, "turn": self.turn}
        reward, solved = 0.0, False
        if result.ok:
            report = result.value
            reward = report["passed"] / max(1, report["total"])
            solved = report["passed"] == report["total"]
            info.update(report)
            feedback = self._feedback(report)
        else:
            info.update(error_type=result.error_type, error=result.message)
            feedback = f"Your submission could not be graded: {result.error_type}: {result.message}"
        self._observation = f"{self._describe_task()}\n\n# Feedback on submission {self.turn}\n{feedback}"
        out_of_turns = self.turn >= self.max_turns
        return self._observation, reward, solved, out_of_turns and not solved, info

    @staticmethod
    def _feedback(report: dict[str, Any]) -> str:
        lines = [f"{report['passed']}/{report['total']} tests passed."]
        if report.get("import_error"):
            lines.append(f"Your code failed to import: {report['import_error']}")
        lines += [f"- {t['name']}: FAILED: {t['error']}" for t in report["tests"] if not t["passed"]]
        if report.get("killed_by"):
            lines.append(f"The run was stopped: {report['killed_by']}.")
        return "\n".join(lines)

    def render(self) -> str | None:  # type: ignore[override]
        """The current observation as text (``render_mode="ansi"``)."""
        return self._observation if self.render_mode == "ansi" else None
