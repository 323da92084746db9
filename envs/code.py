"""The ``code`` env: write a Python function; the task's unit tests grade it in a sandbox.

Observation: the task (problem text and function signature), then after each submission the test
feedback: each failing test with its error, except the ``hidden_tests`` share of the task's tests,
whose failures are only counted. Action: the agent's Python source as text. A submission's score is
the fraction of all tests it passes (1.0 all: the episode ends; a test that a bad input is refused
counts only once an ordinary test passes, so raising on every call earns nothing); a step's reward
is how much its score gained on the last submission's, so an episode's return is the score of its
last submission, however many turns it took (were each score a reward, three near misses would pay
more than solving at once). The agent may resubmit after seeing failures, up to ``max_turns``
submissions; the hidden tests keep a submission that only answers the inputs feedback showed from
full reward. ``info`` has the score and every test's outcome, for the trainer, not for the agent.
"""

from __future__ import annotations

import math
import string
from typing import Any

from pydantic import BaseModel, Field

from tangram_env.chat import ChatTextEnv, ChatTurn, call_arguments, call_name, check_tools
from tangram_env.env import AnyText, EnvGen, TangramEnv, check_turns
from tangram_env.envs.code_tasks import (
    HarnessSpec,
    get_task,
    harness_invocation,
    load_tasks,
    read_report,
)
from tangram_env.envs.code_tasks.grading import preload_harness
from tangram_env.envs.code_tasks.warm import grade_warm
from tangram_env.kinds import ActionContext, tool
from tangram_env.protocol import Action
from tangram_env.rewards import graded
from tangram_env.sandbox import SandboxFileTooLarge

MAX_SOURCE = 100_000
MAX_REPORT = 16 << 20  # a report of the largest task's tests is a few kilobytes
OUTPUT_CAP = 8_192  # stdout/stderr kept in info, per stream
TEXT_CHARSET = string.printable
#: The most seconds a test may run: the grading tool refuses a payload asking for more.
MAX_PER_TEST_TIMEOUT_S = 30.0


class RunTestsArgs(BaseModel):
    """Grade ``source`` against the tests of task ``task_id``."""

    task_id: str = Field(description="id of a task of the code env")
    source: str = Field(max_length=MAX_SOURCE, description="Python source defining the task's entry point")
    per_test_timeout_s: float = Field(
        2.0, gt=0, le=MAX_PER_TEST_TIMEOUT_S, description="time limit of each test"
    )


def _cap(text: str, limit: int = OUTPUT_CAP) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters cut]"


# Half a core: a grading is a judge and a solution process taking turns over pipes, after an
# interpreter start-up, so one alone keeps its core busy about three quarters of its wall time (50 ms
# of CPU in 69 ms, median of the task set; 85 in 107 on average). Two to a core fill each other's waits.
@tool(name="code.run_tests", placement="sandbox", cpu=0.5, mem_mb=512, timeout_s=60)
def run_tests(args: RunTestsArgs, ctx: ActionContext) -> dict[str, Any]:
    """Run a code task's unit tests against a submitted solution, in a sandbox."""
    task = get_task(args.task_id)
    sandbox = ctx.sandbox
    spec = HarnessSpec.for_task(task, args.source, timeout_s=args.per_test_timeout_s)
    timeout_s = max(1.0, min(ctx.remaining() - 1.0, spec.sandbox_timeout_s()))
    warm = grade_warm(sandbox, spec, ctx.cores, timeout_s)  # a judge kept in the sandbox, if it can
    if warm is not None:
        data, run = warm
    else:
        # The harness and the spec (with the nonce that signs the report) go in on stdin: no file in
        # the sandbox holds either, so nothing left there by an earlier submission can swap or read them.
        argv, stdin = harness_invocation(spec, "report.json")
        run = sandbox.exec(argv, stdin=stdin, timeout_s=timeout_s, cores=ctx.cores)
        try:  # only the solution could make it larger (it runs as the harness's user on this path)
            data = sandbox.read_file("report.json", max_bytes=MAX_REPORT)
        except (OSError, SandboxFileTooLarge):
            data = None
    report = read_report(data, spec, run)
    return {
        "task_id": task.id,
        "passed": report.passed,
        "total": report.total,
        "tests": [{"name": t.name, "passed": t.passed, "error": t.error} for t in report.tests],
        "import_error": report.import_error,
        "problem": report.problem,
        "stdout": _cap(run.stdout),
        "stderr": _cap(run.stderr),
        "exit_code": run.exit_code,
        "killed_by": run.killed_by,
        "wall_s": run.wall_s,
        "cpu_s": run.cpu_s,
    }


# The orchestrator forks a child per action from the process that imported this plugin: read the task
# set and compile the harness here, once, or every grading's child does it again.
load_tasks()
preload_harness()

#: The code env's one tool, for chat agents (``chat=True``): a submission is a call of it.
SUBMIT_TOOL = {
    "type": "function",
    "function": {
        "name": "submit_solution",
        "description": "Submit Python source for the task; its unit tests run and the results come back.",
        "parameters": {
            "type": "object",
            "properties": {"source": {"type": "string", "description": "the complete Python source"}},
            "required": ["source"],
        },
    },
}


class CodeEnv(ChatTextEnv, TangramEnv[str, str]):
    """Solve one programming task per episode; see the module docstring.

    ``chat=True``: observations are chat messages and a submission may be a ``submit_solution`` tool
    call (or the assistant's text); ``env.tools`` lists that tool in OpenAI's format.
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi"]}
    reset_options = frozenset({"task_id"})

    def __init__(
        self,
        *,
        max_turns: int = 3,
        task_ids: list[str] | None = None,
        per_test_timeout_s: float = 2.0,
        chat: bool = False,
        hidden_tests: float = 0.5,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= hidden_tests <= 1.0:
            raise ValueError(f"hidden_tests is a share of each task's tests, from 0 to 1; got {hidden_tests}")
        self.hidden_tests = hidden_tests
        self.tasks = [get_task(t) for t in task_ids] if task_ids else load_tasks()
        self.max_turns = check_turns(max_turns)
        self.per_test_timeout_s = per_test_timeout_s  # checked by the property
        # Any Unicode: the feedback quotes tests and errors with text outside any charset.
        self.observation_space = AnyText(max_length=MAX_SOURCE, min_length=0, charset=TEXT_CHARSET)
        self.action_space = AnyText(max_length=MAX_SOURCE, min_length=0, charset=TEXT_CHARSET)
        self.task = self.tasks[0]
        self.turn = 0
        self._score = 0.0
        self._observation = ""
        self.tools = check_tools([SUBMIT_TOOL])
        self._use_chat(chat)

    @property
    def per_test_timeout_s(self) -> float:
        """Seconds each test may run, above 0 and at most :data:`MAX_PER_TEST_TIMEOUT_S`."""
        return self._per_test_timeout_s

    @per_test_timeout_s.setter
    def per_test_timeout_s(self, value: float) -> None:
        # Checked here (make, set_attr): a value the grading tool refuses would fail every grading.
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0 < value <= MAX_PER_TEST_TIMEOUT_S
        ):
            raise ValueError(
                f"per_test_timeout_s must be a number of seconds above 0 and at most "
                f"{MAX_PER_TEST_TIMEOUT_S:g} (the limit of the code.run_tests tool); got {value!r}"
            )
        self._per_test_timeout_s = float(value)

    def _chat_text(self, turn: ChatTurn) -> str:
        """The source in a ``submit_solution`` call, else the assistant's text."""
        for call in turn.tool_calls:
            if call_name(call) == "submit_solution":
                return str(call_arguments(call).get("source", ""))
        return turn.text

    def _describe_task(self) -> str:
        what = "class" if self.task.kind == "class" else "function"
        signature = "\n".join(f"    {line}" for line in self.task.signature.splitlines())
        return (
            f"# Task: {self.task.title}\n\n{self.task.prompt}\n\n"
            f"Write a Python {what} with this signature:\n\n{signature}\n\n"
            "Reply with the complete source code."
        )

    def _reset(
        self, *, seed: int | None, options: dict[str, Any] | None
    ) -> EnvGen[tuple[str, dict[str, Any]]]:
        task_id = (options or {}).get("task_id")
        if task_id is not None:
            self.task = get_task(task_id)
        else:
            self.task = self.tasks[int(self.np_random.integers(len(self.tasks)))]
        self.turn = 0
        self._score = 0.0  # the last submission's
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
                    # What cannot be UTF-8 (a lone surrogate from a decoder) becomes U+FFFD: the
                    # submission is graded as written, never dropped as an infrastructure failure.
                    "source": str(action)[:MAX_SOURCE].encode("utf-8", "replace").decode("utf-8"),
                    "per_test_timeout_s": self.per_test_timeout_s,
                },
                # No session: a grading needs no files of an earlier one, and a session would hold
                # its sandbox's memory until the env closes (a batch of thousands of envs stepped in
                # lockstep then waits forever for memory). Any warm sandbox, and its judge, serves.
            )
        ]
        report = graded(result, "grading the submission")  # a grader's failure is never a reward
        score = report["passed"] / max(1, report["total"])
        reward, self._score = score - self._score, score  # the return telescopes to the last score
        solved = report["passed"] == report["total"]
        hidden = self._hidden_names()
        info: dict[str, Any] = {
            "task_id": self.task.id,
            "turn": self.turn,
            "score": score,
            **report,
            "hidden": sorted(hidden),
        }
        news = f"# Feedback on submission {self.turn}\n{self._feedback(report, hidden)}"
        self._observation = f"{self._describe_task()}\n\n{news}"
        out_of_turns = self.turn >= self.max_turns
        # A chat's messages are its history: a turn brings only what is new, not the task again.
        obs = news if self.chat else self._observation
        return obs, reward, solved, out_of_turns and not solved, info

    def _hidden_names(self) -> set[str]:
        """The task's tests whose failures the feedback counts but never shows: the last
        ``hidden_tests`` share of them. Their inputs and expected values never reach the agent, so
        a submission that only echoes what earlier feedback showed cannot pass them.
        """
        tests = self.task.tests
        return {t.name for t in tests[len(tests) - math.ceil(len(tests) * self.hidden_tests) :]}

    @staticmethod
    def _feedback(report: dict[str, Any], hidden: set[str]) -> str:
        lines = [f"{report['passed']}/{report['total']} tests passed."]
        if report.get("import_error"):
            lines.append(f"Your code failed to import: {report['import_error']}")
        if report.get("problem"):
            lines.append(f"Problem: {report['problem']}")
        failed = [t for t in report["tests"] if not t["passed"]]
        lines += [f"- {t['name']}: FAILED: {t['error']}" for t in failed if t["name"] not in hidden]
        if unseen := sum(t["name"] in hidden for t in failed):
            lines.append(f"- {unseen} hidden test(s) FAILED (their inputs are not shown).")
        if report.get("killed_by"):
            lines.append(f"The run was stopped: {report['killed_by']}.")
        return "\n".join(lines)

    def render(self) -> str | None:
        """The current observation as text (``render_mode="ansi"``)."""
        return self._observation if self.render_mode == "ansi" else None
