"""Grading by a repository's own runner in a real local sandbox: a repository laid out as Django's
(``tests/runtests.py`` running unittest labels at ``--verbosity 2``), its log read outside the sandbox.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator

import pytest

from tangram_env.envs.swe_bench.grading import grade
from tangram_env.envs.swe_bench.instance import SweBenchInstance, validate_instance
from tangram_env.envs.swe_bench.prepare import cache_root, gitconfig_file
from tests.envs.swe_bench.conftest import diff_of, git

BUGGY = "def add(a, b):\n    return a - b\n"
#: What Django's runner does with the arguments SWE-bench passes: run the labels, verbosely.
RUNTESTS = """import argparse, os, sys, unittest
parser = argparse.ArgumentParser()
parser.add_argument("labels", nargs="*")
parser.add_argument("--verbosity", type=int, default=1)
parser.add_argument("--settings")
parser.add_argument("--parallel")
args = parser.parse_args()
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [here, os.path.dirname(here)]
result = unittest.TextTestRunner(verbosity=args.verbosity).run(
    unittest.defaultTestLoader.loadTestsFromNames(args.labels)
)
sys.exit(not result.wasSuccessful())
"""
TESTS = """import unittest
from calc import add


class AddTests(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

    def test_zero(self):
        '''Adding zero changes nothing.'''
        self.assertEqual(add(0, 0), 0)
"""


def ident(test: str) -> str:
    where = "calc_tests.test_add.AddTests"
    return f"{test} ({where}.{test})" if sys.version_info >= (3, 11) else f"{test} ({where})"


@pytest.fixture(scope="module")
def djangoish(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SweBenchInstance, object]]:
    from tangram_env.images import build_image
    from tangram_env.sandbox import SandboxSpec
    from tangram_env.server.sandbox.local import LocalProvider

    root = tmp_path_factory.mktemp("djangoish")
    repo = root / "repo"
    (repo / "tests" / "calc_tests").mkdir(parents=True)
    (repo / "calc.py").write_text(BUGGY)
    (repo / "tests" / "runtests.py").write_text(RUNTESTS)
    (repo / "tests" / "calc_tests" / "__init__.py").write_text("")
    (repo / "tests" / "calc_tests" / "test_add.py").write_text(TESTS)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "buggy")
    commit = git(repo, "rev-parse", "HEAD").strip()
    gold = diff_of(repo, {"calc.py": BUGGY.replace("a - b", "a + b")})
    image = f"swe-test-djangoish-{root.name}"[:60]
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
    inst = validate_instance(
        {
            "instance_id": "django__django-90001",
            "repo": "django/django",
            "base_commit": commit,
            "problem_statement": "add() subtracts",
            "patch": gold,
            "FAIL_TO_PASS": [ident("test_add")],
            "PASS_TO_PASS": ["Adding zero changes nothing."],
            "image": image,
            "python": "python",
        }
    )
    provider = LocalProvider(image_dir=str(images))
    sandbox = provider.create(SandboxSpec(image=image, mem_mb=1024))
    yield inst, sandbox
    provider.close()


def graded(box: tuple[SweBenchInstance, object], patch: str | None) -> dict[str, object]:
    inst, sandbox = box
    sandbox.reset()  # type: ignore[attr-defined]
    return grade(sandbox, inst, patch, timeout_s=120)


def test_django_runner_grades_gold_resolved_and_empty_not(djangoish: tuple[SweBenchInstance, object]) -> None:
    gold = graded(djangoish, djangoish[0].patch)
    assert gold["resolved"] is True, gold["log"]
    assert gold["statuses"] == {ident("test_add"): "PASSED", "Adding zero changes nothing.": "PASSED"}
    # The planted case's label first, in the app of the instance's tests.
    assert re.search(
        r"--settings=test_sqlite --parallel 1 calc_tests\.test_\w+ calc_tests\.test_add\.AddTests",
        str(gold["log"]),
    )
    assert gold["tampering"] is None
    empty = graded(djangoish, None)
    assert "error" not in empty, empty
    report = empty["report"]["django__django-90001"]  # type: ignore[index]
    assert report["resolved"] is False
    assert report["tests_status"]["FAIL_TO_PASS"]["failure"] == [ident("test_add")]
    assert report["tests_status"]["PASS_TO_PASS"]["success"] == ["Adding zero changes nothing."]


def test_a_patch_that_breaks_the_runner_fails_its_tests(djangoish: tuple[SweBenchInstance, object]) -> None:
    inst = djangoish[0]
    broken = inst.patch.replace("+    return a + b", "+    return a +")  # a syntax error: every test errors
    out = graded(djangoish, broken)
    report = out["report"]["django__django-90001"]  # type: ignore[index]
    assert report["patch_successfully_applied"] is True and report["resolved"] is False
    assert report["tests_status"]["FAIL_TO_PASS"]["failure"] == [ident("test_add")]
    assert report["tests_status"]["PASS_TO_PASS"]["failure"] == ["Adding zero changes nothing."]
    assert "SyntaxError" in str(out["log"])


def test_result_lines_printed_by_the_patch_cannot_pass_a_test(
    djangoish: tuple[SweBenchInstance, object],
) -> None:
    # Fixes nothing; prints a passing result line for the failing test when the runner exits.
    line = f"{ident('test_add')} ... ok"
    spoof = (
        "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,6 @@\n"
        "+import atexit\n+import sys\n+\n"
        f"+atexit.register(lambda: sys.stderr.write({line + chr(10)!r}))\n"
        " def add(a, b):\n     return a - b\n"
    )
    out = graded(djangoish, spoof)
    report = out["report"]["django__django-90001"]  # type: ignore[index]
    assert report["patch_successfully_applied"] is True, out["log"]
    assert line in str(out["log"])  # the forged line is there, after the real "... FAIL"
    assert report["resolved"] is False
    assert report["tests_status"]["FAIL_TO_PASS"]["failure"] == [ident("test_add")]


#: Fixes nothing; unittest reports every failure and error as a success (each test prints ``ok``
#: once, so no line contradicts another).
PASS_EVERYTHING = """import unittest


def _ok(self, test, err=None):
    unittest.TextTestResult.addSuccess(self, test)


unittest.TextTestResult.addFailure = unittest.TextTestResult.addError = _ok
"""


def test_a_patch_that_passes_every_unittest_result_is_caught_by_planted_tests(
    djangoish: tuple[SweBenchInstance, object],
) -> None:
    lines = PASS_EVERYTHING.splitlines(keepends=True)
    patch = (
        f"diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,{2 + len(lines)} @@\n"
        + "".join(f"+{line}" for line in lines)
        + "".join(f" {line}" for line in BUGGY.splitlines(keepends=True))
    )
    out = graded(djangoish, patch)
    report = out["report"]["django__django-90001"]  # type: ignore[index]
    assert report["patch_successfully_applied"] is True and report["resolved"] is False, out["log"]
    assert "planted test that must fail came back PASSED" in str(out["tampering"])


def test_edits_to_the_runner_or_its_tests_are_undone(djangoish: tuple[SweBenchInstance, object]) -> None:
    inst = djangoish[0]
    assert {"tests/runtests.py", "tests/calc_tests/test_add.py"} <= set(inst.test_files())
    # A runner that prints a passing line for every test and runs none.
    forged = "".join(f"+print({f'{t} ... ok'!r})\n" for t in [*inst.FAIL_TO_PASS, *inst.PASS_TO_PASS])
    runner_patch = (
        "diff --git a/tests/runtests.py b/tests/runtests.py\n"
        "--- a/tests/runtests.py\n+++ b/tests/runtests.py\n"
        f"@@ -1,2 +1,5 @@\n{forged}+raise SystemExit(0)\n"
        " import argparse, os, sys, unittest\n parser = argparse.ArgumentParser()\n"
    )
    test_patch = (
        "diff --git a/tests/calc_tests/test_add.py b/tests/calc_tests/test_add.py\n"
        "--- a/tests/calc_tests/test_add.py\n+++ b/tests/calc_tests/test_add.py\n"
        "@@ -5,3 +5,3 @@ class AddTests(unittest.TestCase):\n     def test_add(self):\n"
        "-        self.assertEqual(add(2, 3), 5)\n+        self.assertEqual(add(2, 3), -1)\n \n"
    )
    for patch, path in ((runner_patch, "tests/runtests.py"), (test_patch, "tests/calc_tests/test_add.py")):
        out = graded(djangoish, patch)
        report = out["report"]["django__django-90001"]  # type: ignore[index]
        assert [d["path"] for d in out["dropped_edits"]] == [path]  # type: ignore[attr-defined]
        assert report["resolved"] is False, out["log"]
        assert report["tests_status"]["FAIL_TO_PASS"]["failure"] == [ident("test_add")]
