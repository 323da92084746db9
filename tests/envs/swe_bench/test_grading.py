"""Grading in a real local sandbox, on a small repository made here with a test patch of its own."""

from __future__ import annotations

from tangram_env.envs.swe_bench.grading import grade
from tangram_env.envs.swe_bench.instance import SweBenchInstance


def graded(calc: tuple[SweBenchInstance, object], patch: str | None, shards: int = 1) -> dict[str, object]:
    inst, sandbox = calc
    sandbox.reset()  # type: ignore[attr-defined]
    return grade(sandbox, inst, patch, shards=shards, timeout_s=120)


def test_the_gold_patch_resolves_with_swe_bench_report(calc: tuple[SweBenchInstance, object]) -> None:
    out = graded(calc, calc[0].patch, shards=2)
    assert out["resolved"] is True, out["log"]
    report = out["report"]["calc__calc-1"]  # type: ignore[index]
    assert set(report) == {
        "patch_is_None",
        "patch_exists",
        "patch_successfully_applied",
        "resolved",
        "tests_status",
    }
    assert report["patch_exists"] and report["patch_successfully_applied"] and not report["patch_is_None"]
    status = report["tests_status"]
    assert set(status) == {"FAIL_TO_PASS", "PASS_TO_PASS", "FAIL_TO_FAIL", "PASS_TO_FAIL"}
    assert status["FAIL_TO_PASS"] == {"success": ["tests/test_calc.py::test_add"], "failure": []}
    assert status["PASS_TO_PASS"]["failure"] == [] and len(status["PASS_TO_PASS"]["success"]) == 2
    assert out["shards"] == 2  # two test files: two shards, run at once


def test_no_patch_and_an_empty_patch_resolve_nothing(calc: tuple[SweBenchInstance, object]) -> None:
    for patch in (None, ""):
        out = graded(calc, patch)
        report = out["report"]["calc__calc-1"]  # type: ignore[index]
        assert report["patch_is_None"] is (patch is None) and report["patch_exists"] is False
        assert report["resolved"] is False
        # The test patch still went in and ran: the new test fails, the old ones pass.
        assert report["tests_status"]["FAIL_TO_PASS"]["failure"] == ["tests/test_calc.py::test_add"]
        assert out["statuses"]["tests/test_calc.py::test_mul"] == "PASSED"  # type: ignore[index]
        assert "assert -1 == 5" in out["messages"]["tests/test_calc.py::test_add"]  # type: ignore[index]


def test_a_patch_that_does_not_apply(calc: tuple[SweBenchInstance, object]) -> None:
    bad = calc[0].patch.replace("-    return a - b", "-    return a * b * b")
    out = graded(calc, bad)
    report = out["report"]["calc__calc-1"]  # type: ignore[index]
    assert report["patch_successfully_applied"] is False and report["resolved"] is False
    assert "git apply" in str(out["log"])


def test_editing_the_tests_cannot_pass_them(calc: tuple[SweBenchInstance, object]) -> None:
    # Defines test_add trivially in the test file and fixes nothing: grading restores the file first.
    repo_patch = (
        "diff --git a/tests/test_calc.py b/tests/test_calc.py\n"
        "--- a/tests/test_calc.py\n+++ b/tests/test_calc.py\n"
        "@@ -3,3 +3,7 @@ from calc import mul\n \n def test_mul():\n     assert mul(2, 3) == 6\n+\n+\n"
        "+def test_add():\n+    pass\n"
    )
    out = graded(calc, repo_patch)
    report = out["report"]["calc__calc-1"]  # type: ignore[index]
    assert out["dropped_edits"] == [{"path": "tests/test_calc.py", "reason": "a test file of the instance"}]
    assert report["patch_exists"] is True and report["resolved"] is False
    assert report["tests_status"]["FAIL_TO_PASS"]["failure"] == ["tests/test_calc.py::test_add"]
    assert "only files that are not graded" in str(out["reason"])


def test_a_missing_test_counts_as_failed(calc: tuple[SweBenchInstance, object]) -> None:
    inst = calc[0].model_copy(
        update={"PASS_TO_PASS": ["tests/test_calc.py::test_mul", "tests/test_calc.py::nope"]}
    )
    sandbox = calc[1]
    sandbox.reset()  # type: ignore[attr-defined]
    out = grade(sandbox, inst, inst.patch, timeout_s=120)
    report = out["report"]["calc__calc-1"]
    assert report["resolved"] is False
    assert report["tests_status"]["PASS_TO_PASS"]["failure"] == ["tests/test_calc.py::nope"]
