"""Code under test that kills or signals its test runner, for real in a local sandbox: it cannot turn
its 0.0 into "no reward". The runner catches what can be caught and grades on; a runner or test
process killed anyway (SIGKILL) while the sandbox lives is the patch's failure. Only a runner that
never started the tests, or a sandbox that died, leaves the grading undone.

The instance is ``calc`` (conftest.py): ``add`` subtracts; each patch here runs its code when the
tests import ``calc``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tangram_env.envs.swe_bench.grading import GradingUnavailable, grade, run_shards
from tangram_env.envs.swe_bench.instance import SweBenchInstance
from tests.envs.swe_bench.conftest import BUGGY
from tests.envs.swe_bench.test_hacks import calc_with

F2P = "tests/test_calc.py::test_add"
P2P = ["tests/test_calc.py::test_mul", "tests/test_other.py::test_mul_zero"]


def signals(target: str, sig: str) -> str:
    return f"import os as _o, signal as _s\n_o.{target}, _s.{sig})\n"


def graded(calc: tuple[SweBenchInstance, Any], patch: str) -> dict[str, Any]:
    inst, sandbox = calc
    sandbox.reset()
    return grade(sandbox, inst, patch, timeout_s=120)


@pytest.mark.parametrize(
    "sig", ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGTSTP", "SIGALRM", "SIGRTMIN + 3"]
)
def test_a_signal_to_the_runner_changes_nothing(calc: tuple[SweBenchInstance, Any], sig: str) -> None:
    # It used to end the runner without a report: no reward instead of this patch's 0.0.
    out = graded(calc, calc_with(signals("kill(_o.getppid()", sig)))
    status = out["report"]["calc__calc-1"]["tests_status"]
    assert out["resolved"] is False and out["tampering"] is None, out
    assert status["FAIL_TO_PASS"]["failure"] == [F2P] and sorted(status["PASS_TO_PASS"]["success"]) == P2P
    assert out["reason"] == "failed tests: 1/1 FAIL_TO_PASS tests did not pass" and "run_error" not in out


def test_a_fix_that_signals_the_runner_still_resolves(calc: tuple[SweBenchInstance, Any]) -> None:
    fixed = BUGGY.replace("a - b", "a + b")
    out = graded(calc, calc_with(signals("kill(_o.getppid()", "SIGTERM"), fixed))
    assert out["resolved"] is True, out


def test_sigkill_of_the_runner_is_the_patchs_failure(calc: tuple[SweBenchInstance, Any]) -> None:
    # SIGKILL cannot be caught, and from outside it reads the same: the sandbox still runs commands
    # and no limit struck, so the tests' own code is taken to have done it.
    out = graded(calc, calc_with(signals("kill(_o.getppid()", "SIGKILL")))
    assert out["resolved"] is False and out["statuses"] == {}, out
    assert out["run_error"] == "the tests killed their test runner (exit code -9)", out
    assert "the tests killed their test runner" in out["reason"]


@pytest.mark.parametrize(
    ("code", "died_of"),
    [
        (signals("kill(_o.getpid()", "SIGKILL"), 9),  # read as "killed from outside": no reward
        (signals("killpg(0", "SIGTERM"), 15),  # the runner's process group: the shell around it died
    ],
    ids=["sigkill-itself", "sigterm-its-group"],
)
def test_a_test_process_killed_by_its_own_code_is_the_patchs_failure(
    calc: tuple[SweBenchInstance, Any], code: str, died_of: int
) -> None:
    out = graded(calc, calc_with(code))
    assert out["resolved"] is False, out
    assert out["run_error"] == f"a test process died of signal {died_of}", out


def test_a_runner_that_never_started_the_tests_leaves_the_grading_undone(
    calc: tuple[SweBenchInstance, Any],
) -> None:
    # No code under test ran: nothing the patch did can have caused it.
    _, sandbox = calc
    sandbox.reset()
    with pytest.raises(GradingUnavailable, match="before the tests ran"):
        run_shards(sandbox, P2P, python="no-such-python")


NEW_FILE = "diff --git a/{0} b/{0}\nnew file mode 100644\n--- /dev/null\n+++ b/{0}\n@@ -0,0 +1 @@\n+{1}\n"


def test_a_patch_that_stops_the_tests_applying_is_its_failure(calc: tuple[SweBenchInstance, Any]) -> None:
    # The instance's tests add checks/test_more.py; a patch that makes `checks` a file stops them
    # applying. A prepared instance's tests apply to its base commit, so that is the patch's doing:
    # 0.0, not the "no reward" it used to raise.
    inst, sandbox = calc
    more = inst.model_copy(
        update={"test_patch": inst.test_patch + NEW_FILE.format("checks/test_more.py", "x = 1")}
    )
    sandbox.reset()
    out = grade(sandbox, more, NEW_FILE.format("checks", "blocked"), timeout_s=120)
    assert out["resolved"] is False and out["statuses"] == {}, out
    assert "test_patch does not apply over the patch" in out["reason"], out
    sandbox.reset()
    with pytest.raises(GradingUnavailable, match="test_patch does not apply"):  # no patch: the data's fault
        grade(
            sandbox,
            more.model_copy(update={"test_patch": NEW_FILE.format("calc.py", "x")}),
            None,
            timeout_s=120,
        )
