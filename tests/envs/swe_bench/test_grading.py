"""Grading in a real local sandbox, on a small repository made here with a test patch of its own."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tangram_env.envs.swe_bench.grading import grade
from tangram_env.envs.swe_bench.instance import SweBenchInstance
from tangram_env.envs.swe_bench.prepare import cache_root, gitconfig_file

BUGGY = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
TESTS = "from calc import mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"
OTHER = "from calc import mul\n\n\ndef test_mul_zero():\n    assert mul(0, 5) == 0\n"
GIT = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@x",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@x",
}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **GIT},
    ).stdout


def diff_of(repo: Path, edit: dict[str, str]) -> str:
    """The patch that makes ``edit`` (path -> new text) in ``repo``, which is left as it was."""
    for path, text in edit.items():
        (repo / path).write_text(text)
    out = git(repo, "diff")
    git(repo, "checkout", "-q", "--", ".")
    return out


@pytest.fixture(scope="module")
def calc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SweBenchInstance, object]]:
    from tangram_env.images import build_image
    from tangram_env.sandbox import SandboxSpec
    from tangram_env.server.sandbox.local import LocalProvider

    root = tmp_path_factory.mktemp("calc")
    repo = root / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text(BUGGY)
    (repo / "tests" / "test_calc.py").write_text(TESTS)
    (repo / "tests" / "test_other.py").write_text(OTHER)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "buggy")
    commit = git(repo, "rev-parse", "HEAD").strip()
    gold = diff_of(repo, {"calc.py": BUGGY.replace("a - b", "a + b")})
    test_patch = diff_of(
        repo,
        {
            "tests/test_calc.py": TESTS.replace("import mul", "import add, mul")
            + "\n\ndef test_add():\n    assert add(2, 3) == 5\n"
        },
    )
    image = f"swe-test-calc-{root.name}"[:60]
    gitconfig = gitconfig_file(cache_root())
    images = root / "images"
    build_image(
        image,
        from_dir=repo,
        python_env=sys.prefix,
        root=images,
        env={"GIT_CONFIG_GLOBAL": str(gitconfig)},
        read_only=[str(gitconfig)],
    )
    inst = SweBenchInstance(
        instance_id="calc__calc-1",
        repo="calc/calc",
        base_commit=commit,
        problem_statement="add() subtracts",
        patch=gold,
        test_patch=test_patch,
        FAIL_TO_PASS=["tests/test_calc.py::test_add"],
        PASS_TO_PASS=["tests/test_calc.py::test_mul", "tests/test_other.py::test_mul_zero"],
        image=image,
        python="python",
    )
    provider = LocalProvider(image_dir=str(images))
    sandbox = provider.create(SandboxSpec(image=image, mem_mb=1024))
    yield inst, sandbox
    provider.close()


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
    assert report["patch_successfully_applied"] is True, out["log"]
    assert report["resolved"] is False
    assert report["tests_status"]["FAIL_TO_PASS"]["failure"] == ["tests/test_calc.py::test_add"]


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
