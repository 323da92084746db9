"""``test_outcome``: a reward from test results, the pass fraction or whether the task is resolved.

Each item is a test report, in any of these shapes (other keys are ignored, so a ``run_tests``
result passes through as it is; the counts are integers and the flags booleans, never coerced)::

    {"passed": 3, "total": 4}                          # counts
    {"passed": 3, "failed": 1, "errors": 0}            # total = passed + failed + errors
    {"outcomes": ["passed", "failed", True, False]}    # per test: "passed"/True count as passes
    {"passed": 3, "total": 4, "mode": "resolved"}      # 1.0 only when every test passed

``mode`` is ``"fraction"`` (default: passed / total, 0.0 when there are no tests) or ``"resolved"``
(1.0 if the report says ``"resolved": true`` or every test passed and there was at least one, else
0.0). A report must say how many tests ran: ``passed`` alone (or with a misspelt ``total``, which
is ignored) is refused, not read as every test passed; so is one whose ``outcomes`` disagree with its
counts. Pure Python, so it runs on the GPU worker's host lane and never waits for a device.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tangram_env.errors import describe_validation_error
from tangram_env.kinds import reward_model

_PASSES = frozenset({"passed", "pass", "ok", "success", "xpassed"})


class TestReport(BaseModel):
    """One item of ``test_outcome``: counts or per-test outcomes, and the reward mode."""

    model_config = ConfigDict(extra="ignore", strict=True)  # "3" is not 3, nor true 1
    __test__ = False  # not a pytest test class

    passed: int | None = Field(None, ge=0)
    total: int | None = Field(None, ge=0)
    failed: int = Field(0, ge=0)
    errors: int = Field(0, ge=0)
    outcomes: list[str | bool] | None = None
    resolved: bool | None = None
    mode: Literal["fraction", "resolved"] = "fraction"

    @model_validator(mode="after")
    def _consistent(self) -> TestReport:
        if self.outcomes is None and self.passed is None and self.resolved is None:
            raise ValueError(
                "a test report needs 'passed' (with 'total' or 'failed'), 'outcomes' or 'resolved'"
            )
        if self.passed is not None and self.total is not None and self.passed > self.total:
            raise ValueError(f"passed ({self.passed}) > total ({self.total})")
        if (
            self.passed is not None
            and self.total is None
            and not {"failed", "errors"} & self.model_fields_set
        ):
            # Else a misspelt total ("totl", JUnit's "tests" or "failures") would make every test pass.
            raise ValueError("'passed' needs 'total', 'failed' or 'errors' to say how many tests ran")
        if self.outcomes is not None:
            passes, ran = self._outcome_counts()
            if self.passed not in (None, passes) or self.total not in (None, ran):
                raise ValueError("'outcomes' and the counts disagree: give one of them")
        return self

    def _outcome_counts(self) -> tuple[int, int]:
        assert self.outcomes is not None
        passes = sum(1 for o in self.outcomes if o is True or (isinstance(o, str) and o.lower() in _PASSES))
        return passes, len(self.outcomes)

    def counts(self) -> tuple[int, int]:
        """Count the tests passed and the tests run."""
        if self.outcomes is not None:
            return self._outcome_counts()
        passed = self.passed or 0
        total = self.total if self.total is not None else passed + self.failed + self.errors
        return passed, total

    def reward(self) -> float:
        """Score the report under its ``mode``."""
        if self.mode == "resolved" and self.resolved is not None:
            return 1.0 if self.resolved else 0.0
        if self.passed is None and self.outcomes is None:  # only a resolved flag was given
            return 1.0 if self.resolved else 0.0
        passed, total = self.counts()
        if self.mode == "resolved":
            return 1.0 if total > 0 and passed == total else 0.0
        return passed / total if total else 0.0


def score_reports(items: list[Any]) -> list[float]:
    """Score test reports (see the module docs); a malformed item raises ``ValueError`` naming it."""
    out = []
    for i, item in enumerate(items):
        try:
            report = TestReport.model_validate(item)
        except ValidationError as exc:
            raise ValueError(f"item {i} is not a test report: {describe_validation_error(exc)}") from None
        out.append(report.reward())
    return out


@reward_model(name="test_outcome", cpu=0.0, mem_mb=0, max_batch=256, max_wait_ms=1.0, timeout_s=30.0)
def test_outcome(items: list[Any]) -> list[float]:
    """Reward from test results: the fraction of tests passed, or 1.0/0.0 for resolved or not."""
    return score_reports(items)


test_outcome.__test__ = False  # pytest must not collect it
