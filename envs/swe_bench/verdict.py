"""Reading a test run's report back from the sandbox, and SWE-bench's verdict on it.

Everything here runs in the grading tool's process, outside the sandbox, on bytes read back from it.
The report is hostile data (the agent's code ran where it was written): it is size-capped and parsed
strictly (:func:`parse_run`), and the planted tests (:mod:`.canaries`) decide whether it is believed.

Per-test rules (:func:`tests_status`), SWE-bench's current ones with a stricter FAIL_TO_PASS:

- a FAIL_TO_PASS test succeeds only when it ran and ``PASSED``; skipped, xfailed, xpassed, errored
  or missing is a failure;
- a PASS_TO_PASS test is maintained when it ``PASSED``, ``XFAIL``ed or was ``SKIPPED`` (as upstream),
  and fails when it ``FAILED``, ``ERROR``ed, ``XPASS``ed or never reported;
- a test id cut short inside its parameters (more ``[`` than ``]``, as 676 ids of SWE-bench Verified
  are) stands for the reported tests it is a prefix of, which must then agree: all passing for
  FAIL_TO_PASS, all maintained for PASS_TO_PASS (upstream takes the first match when they agree on
  passing or not; this never counts a mixed set as a success).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

from tangram_env.envs.swe_bench.instance import SweBenchInstance

Status = Literal["PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS"]
#: Statuses that resolve a FAIL_TO_PASS test, and that maintain a PASS_TO_PASS test.
RESOLVES = frozenset({"PASSED"})
MAINTAINS = frozenset({"PASSED", "XFAIL", "SKIPPED"})
#: Caps on what a report may hold (a real one is far below them).
MAX_REPORT_BYTES = 8 << 20
MAX_NODEID = 4096
MAX_MESSAGE = 4000
MAX_TAIL = 8000


class ReportError(ValueError):
    """A report that is not what the runner writes (so something else wrote or changed it)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TestRecord(_Strict):
    """One test's outcome as the runner reports it."""

    __test__ = False  # not a pytest class

    status: Status
    message: str = Field("", max_length=MAX_MESSAGE)
    # JSON has no tuples: each call comes as a list (strict mode would refuse it; i19 fix).
    calls: list[Annotated[tuple[str, int, str], Strict(False)]] | None = None


class ShardRun(_Strict):
    """One pytest process of a run: how it ended and what it reported."""

    returncode: int | None
    timed_out: bool
    tail: str = Field(max_length=MAX_TAIL)
    tests: dict[str, TestRecord]


class RunReport(_Strict):
    """A whole run: its shards, in order."""

    shards: list[ShardRun]
    wall_s: float = Field(ge=0)


def parse_run(text: str, max_shards: int) -> RunReport:
    """The runner's report in ``text``, or :class:`ReportError` saying what is wrong with it."""
    if len(text) > MAX_REPORT_BYTES:
        raise ReportError(f"the report is larger than {MAX_REPORT_BYTES} bytes")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ReportError(f"the report is not JSON: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("wall_s"), int):
        data["wall_s"] = float(data["wall_s"])
    try:
        run = RunReport.model_validate(data)
    except ValidationError as exc:
        raise ReportError(f"the report does not have the runner's shape: {exc.errors()[:3]}") from None
    if len(run.shards) > max_shards:
        raise ReportError(f"the report has {len(run.shards)} shards; the run had at most {max_shards}")
    for shard in run.shards:
        long = next((t for t in shard.tests if len(t) > MAX_NODEID or not t), None)
        if long is not None:
            raise ReportError("the report has a test id that is empty or too long")
    return run


def _matching(test: str, statuses: dict[str, str]) -> list[str]:
    """The statuses ``test`` stands for: its own, or those of the tests a cut-short id is a prefix of."""
    if test in statuses:
        return [statuses[test]]
    if test.count("[") > test.count("]"):
        return [s for t, s in statuses.items() if t.startswith(test)]
    return []


#: The rules before these (``legacy``): passing, failing, and neither (a skipped test did not count).
_LEGACY_PASS = frozenset({"PASSED", "XFAIL", "XPASS"})
_LEGACY_FAIL = frozenset({"FAILED", "ERROR"})


def tests_status(
    f2p: list[str], p2p: list[str], statuses: dict[str, str], *, legacy: bool = False
) -> dict[str, dict[str, list[str]]]:
    """SWE-bench's ``tests_status`` for the FAIL_TO_PASS and PASS_TO_PASS ids (module docstring).

    ``legacy``: the rules this grader had before (a skipped test neither passed nor failed, an
    expected failure passed), kept for the comparison in the tests and benchmark only.
    """
    out: dict[str, dict[str, list[str]]] = {}
    if legacy:
        for key, tests in (("FAIL_TO_PASS", f2p), ("PASS_TO_PASS", p2p)):
            out[key] = {
                "success": [t for t in tests if statuses.get(t) in _LEGACY_PASS],
                "failure": [t for t in tests if t not in statuses or statuses[t] in _LEGACY_FAIL],
            }
        out["FAIL_TO_FAIL"] = {"success": [], "failure": []}
        out["PASS_TO_FAIL"] = {"success": [], "failure": []}
        return out
    for key, tests, good in (("FAIL_TO_PASS", f2p, RESOLVES), ("PASS_TO_PASS", p2p, MAINTAINS)):
        success: list[str] = []
        failure: list[str] = []
        for test in tests:
            found = _matching(test, statuses)
            (success if found and all(s in good for s in found) else failure).append(test)
        out[key] = {"success": success, "failure": failure}
    out["FAIL_TO_FAIL"] = {"success": [], "failure": []}
    out["PASS_TO_FAIL"] = {"success": [], "failure": []}
    return out


def swe_report(
    instance: SweBenchInstance,
    patch: str | None,
    applied: bool,
    statuses: dict[str, str],
    *,
    legacy: bool = False,
) -> dict[str, Any]:
    """SWE-bench's evaluation report of one instance from per-test statuses.

    ``applied`` is whether the patch applied (or, with no patch, whether the tests could run at all).
    As in SWE-bench, an empty patch resolves nothing; its tests' statuses are still reported.
    """
    exists = bool(patch and patch.strip())
    status = tests_status(
        instance.FAIL_TO_PASS, instance.PASS_TO_PASS, statuses if applied else {}, legacy=legacy
    )
    if not applied:
        status = {k: {"success": [], "failure": []} for k in status}
    resolved = (
        exists and applied and not status["FAIL_TO_PASS"]["failure"] and not status["PASS_TO_PASS"]["failure"]
    )
    return {
        instance.instance_id: {
            "patch_is_None": patch is None,
            "patch_exists": exists,
            "patch_successfully_applied": exists and applied,
            "resolved": resolved,
            "tests_status": status,
        }
    }
