"""The caller's side of the test harness: the spec it is given and the report it writes back.

The harness (``harness.py`` in this package, standard library only) runs inside the sandbox::

    spec = HarnessSpec.for_task(task, source)
    argv, stdin = harness_invocation(spec, "report.json")
    run = sandbox.exec(argv, stdin=stdin, timeout_s=spec.sandbox_timeout_s())
    report = read_report(sandbox.read_file("report.json"), spec, run)   # data None if it is missing
    reward = report.fraction

Both the harness's own source and the spec go in on stdin, so that no file in the sandbox ever holds
the code that judges or the nonce that signs, not even for a moment (a process left behind by an
earlier submission could be watching, or could replace a harness file). Inside, the harness judges
from a process that never runs the solution's code (see ``harness.py``).

:func:`read_report` trusts a report only when it is signed with this spec's nonce (which the harness
never writes anywhere the solution could read it), and counts every test the report does not cover
as failed, saying why (the process ended during that test, or at import, ...).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import marshal
import secrets
import signal
import sys
from importlib import resources
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tangram_env.envs.code_tasks.catalog import CodeTask, CodeTest
from tangram_env.sandbox import ExecResult

HARNESS_FILE = "harness.py"
REPORT_VERSION = 1
#: Seconds to start a fresh solution process after a test killed its own (fork, and a little grace).
_RESTART_S = 2.0
_PACKAGE = __name__.rpartition(".")[0]

Stage = Literal["none", "import", "tests", "done", "aborted"]


#: ``python3 -I -c BOOTSTRAP SPEC REPORT`` runs the harness that stdin brings: a line ``TAG NCODE NSRC``,
#: then the harness compiled by this process (used when the sandbox's Python has the same bytecode
#: ``TAG``: compiling it there would cost more than the whole grading of a small task) and its source.
#: It reads exactly those bytes from the descriptor, never through ``sys.stdin``'s buffer: a buffer
#: reads ahead, and the spec (its nonce) that follows would sit in memory that the zygote, forked
#: before the spec is read, passes to every solution process.
BOOTSTRAP = (
    "import os,sys,marshal\n"
    "def r(n):\n"
    " b=b''\n"
    " while len(b)<n:\n"
    "  d=os.read(0,n-len(b))\n"
    "  if not d:raise SystemExit('harness: stdin ended early')\n"
    "  b+=d\n"
    " return b\n"
    "h=b''\n"
    "while h[-1:]!=b'\\n':h+=r(1)\n"
    "t,c,s=h.split();c=r(int(c));s=r(int(s))\n"
    "k=marshal.loads(c) if t.decode()==sys.implementation.cache_tag else compile(s,'<harness>','exec')\n"
    "exec(k,{'__name__':'__main__','__file__':'<harness>'})"
)


@functools.cache
def harness_source() -> str:
    """Return the text of ``harness.py``, to write into a sandbox (read once)."""
    return resources.files(_PACKAGE).joinpath(HARNESS_FILE).read_text(encoding="utf-8")


@functools.cache
def _harness_payload() -> bytes:
    source = harness_source().encode("utf-8")
    code = marshal.dumps(compile(source, "<harness>", "exec", dont_inherit=True))
    return f"{sys.implementation.cache_tag} {len(code)} {len(source)}\n".encode() + code + source


def preload_harness() -> None:
    """Read and compile the harness now, so that processes forked from this one inherit it."""
    _harness_payload()


def harness_invocation(
    spec: HarnessSpec, report_path: str = "report.json", python: str = "python3"
) -> tuple[list[str], bytes]:
    """The command that runs the harness on ``spec`` with no file of its own, and the bytes for its stdin."""
    argv = [python, "-I", "-c", BOOTSTRAP, "-", report_path]
    return argv, _harness_payload() + spec.to_json().encode("utf-8")


def serve_invocation(
    socket_path: str, uid: int, gid: int, python: str = "python3"
) -> tuple[list[str], bytes]:
    """The command that starts a warm judge (``harness.serve``) and the bytes for its stdin."""
    return [python, "-I", "-c", BOOTSTRAP, "--serve", socket_path, str(uid), str(gid)], _harness_payload()


class HarnessSpec(BaseModel):
    """What the harness runs: a solution, its entry point and the tests (see ``harness.py``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str = Field(description="the solution's source, imported as the module 'solution'")
    entry_point: str = Field(description="the function or class the tests call")
    tests: tuple[CodeTest, ...] = Field(min_length=1)
    nonce: str = Field(default_factory=lambda: secrets.token_hex(16), min_length=16)
    timeout_s: float = Field(5.0, gt=0, le=600, description="wall-clock limit of each test")
    import_timeout_s: float = Field(5.0, gt=0, le=600, description="wall-clock limit of the import")
    max_output_chars: int = Field(4096, ge=0, description="stdout and stderr kept, each, per test")
    strict: bool = Field(True, description="tests compare plain data only with exact builtin types")

    @field_validator("entry_point")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not value.isidentifier():
            raise ValueError(f"{value!r} is not a Python identifier")
        return value

    @classmethod
    def for_task(cls, task: CodeTask, source: str, **settings: Any) -> HarnessSpec:
        """Build the spec that grades ``source`` against ``task``'s tests; ``settings``: other fields."""
        return cls(source=source, entry_point=task.entry_point, tests=task.tests, **settings)

    def to_json(self) -> str:
        """Return the spec file's text."""
        return self.model_dump_json()

    def sandbox_timeout_s(self) -> float:
        """Return an upper bound of the whole run, for the sandbox's own limit: every test at its worst
        (run to its limit, then the solution started and imported again for the next one).
        """
        per_test = self.timeout_s + self.import_timeout_s + _RESTART_S
        return 5.0 + self.import_timeout_s + _RESTART_S + per_test * len(self.tests)


class TestOutcome(BaseModel):
    """One test's result; ``reported`` is False when the harness never wrote it (counted failed)."""

    __test__ = False  # not a pytest test class

    model_config = ConfigDict(frozen=True, extra="ignore")

    name: str
    passed: bool
    error: str | None = None
    duration_s: float = 0.0
    timed_out: bool = False
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    reported: bool = True


class _SignedReport(BaseModel):
    version: int
    hmac: str
    report: str


class _RawReport(BaseModel):
    model_config = ConfigDict(extra="ignore")

    stage: Literal["import", "tests", "done", "aborted"]
    import_error: str | None = None
    import_stdout: str = ""
    import_stderr: str = ""
    harness_error: str | None = None
    tests: list[TestOutcome] = Field(default_factory=list)


class HarnessReport(BaseModel):
    """Every test of the spec, in order, with why results are missing when some are (``problem``)."""

    model_config = ConfigDict(frozen=True)

    tests: tuple[TestOutcome, ...]
    stage: Stage = Field(description="how far the harness got: none (no report) .. done, or aborted")
    import_error: str | None = None
    import_stdout: str = ""
    import_stderr: str = ""
    problem: str | None = Field(None, description="why the run did not finish normally, if it did not")

    @property
    def passed(self) -> int:
        """How many tests passed."""
        return sum(test.passed for test in self.tests)

    @property
    def total(self) -> int:
        """How many tests the spec has."""
        return len(self.tests)

    @property
    def fraction(self) -> float:
        """Passed over total: the code env's reward."""
        return self.passed / self.total if self.tests else 0.0


def _how_it_ended(run: ExecResult | None) -> str:
    if run is None:
        return ""
    if run.killed_by:
        return f" (the sandbox stopped it: {run.killed_by})"
    if run.exit_code < 0 or run.exit_code > 128:
        number = -run.exit_code if run.exit_code < 0 else run.exit_code - 128
        try:
            return f" (killed by {signal.Signals(number).name})"
        except ValueError:
            return f" (killed by signal {number})"
    return f" (exit status {run.exit_code})" if run.exit_code else ""


def _unread(spec: HarnessSpec, problem: str) -> HarnessReport:
    failed = [
        TestOutcome(name=t.name, passed=False, error=f"not run: {problem}", reported=False)
        for t in spec.tests
    ]
    return HarnessReport(tests=tuple(failed), stage="none", problem=problem)


#: Why an error-case test that raised as it should still failed.
UNEARNED_ERROR_CASE = (
    "it raised as required, but error-case tests count only once one of the task's ordinary tests passes"
)


def _error_cases_counted(spec: HarnessSpec, outcomes: list[TestOutcome]) -> list[TestOutcome]:
    """The outcomes, with the error-case tests failed unless an ordinary test passed: a solution that
    raises on every call passes every error case and must earn nothing for it. Decided here, from the
    signed report, outside the solution's reach.
    """
    error_cases = {test.name for test in spec.tests if test.error_case}
    if any(outcome.passed for outcome in outcomes if outcome.name not in error_cases):
        return outcomes
    return [
        outcome.model_copy(update={"passed": False, "error": UNEARNED_ERROR_CASE})
        if outcome.passed and outcome.name in error_cases
        else outcome
        for outcome in outcomes
    ]


def read_report(data: bytes | str | None, spec: HarnessSpec, run: ExecResult | None = None) -> HarnessReport:
    """Read the harness's report for ``spec`` (``data`` is None when the file is missing).

    ``run``, the sandbox's result of the harness command, if given, says how the process ended.
    A report not signed with the spec's nonce (not written by this run's harness) is ignored: every
    test failed.
    """
    how = _how_it_ended(run)
    if not data:
        return _unread(spec, f"the harness wrote no report{how}")
    try:
        signed = _SignedReport.model_validate(json.loads(data))
        if signed.version != REPORT_VERSION:
            return _unread(spec, f"the report has version {signed.version}, expected {REPORT_VERSION}")
        body = signed.report.encode("utf-8")
        expected = hmac.new(spec.nonce.encode("utf-8"), body, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected, signed.hmac):
            return _unread(
                spec, "the report is not signed with this run's nonce: the harness did not write it"
            )
        raw = _RawReport.model_validate_json(body)
    except (ValueError, ValidationError) as exc:  # JSONDecodeError is a ValueError
        return _unread(spec, f"the report could not be read: {str(exc)[:200]}")
    reported = {test.name: test for test in raw.tests}
    missing = [test.name for test in spec.tests if test.name not in reported]
    problem = raw.harness_error
    if missing:
        if raw.stage == "import":
            problem = f"the process ended while importing the solution{how}"
        elif raw.stage == "tests":
            problem = f"the process ended during test {missing[0]!r}{how}"
        else:
            problem = problem or f"the report lacks {len(missing)} test(s){how}"
    outcomes: list[TestOutcome] = [
        reported.get(test.name)
        or TestOutcome(
            name=test.name,
            passed=False,
            error=problem if test.name == missing[0] else f"not run: {problem}",
            reported=False,
        )
        for test in spec.tests
    ]
    return HarnessReport(
        tests=tuple(_error_cases_counted(spec, outcomes)),
        stage=raw.stage,
        import_error=raw.import_error,
        import_stdout=raw.import_stdout,
        import_stderr=raw.import_stderr,
        problem=problem,
    )
