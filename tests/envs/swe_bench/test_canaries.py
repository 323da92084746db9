"""The planted tests: they report as the grader expects when pytest really runs them, and neither
their names, their shapes nor where they stand tell them from a repository's own tests.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from tangram_env.envs.swe_bench.canaries import MUST_FAIL, MUST_PASS, Canaries, check_canaries, make_canaries
from tangram_env.envs.swe_bench.grading import grade
from tangram_env.envs.swe_bench.instance import SweBenchInstance
from tangram_env.envs.swe_bench.testrun import _insert

#: A test file as repositories write them: a docstring, a ``__future__`` import, a decorated test, a
#: class, a fixture and a ``__main__`` block.
OWN_FILE = '''"""Tests of the parser."""
from __future__ import annotations

import pytest


@pytest.fixture
def numbers():
    return [1, 2, 3]


@pytest.mark.parametrize("n", [1, 2])
def test_positive(n):
    assert n > 0


class TestSum:
    def test_sum(self, numbers):
        assert sum(numbers) == 6


def test_fails():
    assert 1 == 2


if __name__ == "__main__":
    pytest.main([__file__])
'''
OWN_OUTCOMES = {
    "test_own.py::test_positive[1]": "PASSED",
    "test_own.py::test_positive[2]": "PASSED",
    "test_own.py::TestSum::test_sum": "PASSED",
    "test_own.py::test_fails": "FAILED",
}


OWN_NAMES = {"test_positive", "test_fails"}


def _pytest_outcomes(root: Path) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "no:randomly", "."],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    return {m[1]: m[0] for m in re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED) (\S+)", out, re.MULTILINE)}


def test_planted_tests_report_as_declared_under_pytest(tmp_path: Path) -> None:
    # Enough draws to meet every shape on both sides many times, run by real pytest.
    planted: list[Canaries] = []
    for i in range(40):
        root = tmp_path / f"r{i}"
        (root / "tests").mkdir(parents=True)
        (root / "test_own.py").write_text(OWN_FILE)
        canaries = make_canaries("tests", "test_own.py")
        (root / canaries.path).write_text(canaries.source)
        for path, source in canaries.inserted.items():
            assert _insert(str(root / path), source) == OWN_FILE.encode()
        planted.append(canaries)
        outcomes = _pytest_outcomes(root)
        assert check_canaries(canaries, outcomes) == [], (outcomes, canaries)
        assert {t: outcomes.get(t) for t in canaries.inserted_expected} == canaries.inserted_expected
        assert {t: outcomes.get(t) for t in OWN_OUTCOMES} == OWN_OUTCOMES  # the file's own still run
    assert len({c.path for c in planted}) == len(planted)


def _shape(source: str) -> str:
    """A test's statements with every name and constant (signed or not) blanked: what a pattern
    could key on.
    """

    class Blank(ast.NodeTransformer):
        def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
            if isinstance(node.operand, ast.Constant):
                return ast.Constant(0)
            return self.generic_visit(node)

        def visit_Constant(self, node: ast.Constant) -> ast.AST:
            return ast.Constant(0)

        def visit_Name(self, node: ast.Name) -> ast.AST:
            return ast.Name("_", node.ctx)

        def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
            node.name = "_"
            return self.generic_visit(node)

    return ast.dump(Blank().visit(ast.parse(source)))


def test_names_and_shapes_do_not_tell_which_tests_are_planted_or_must_fail() -> None:
    shapes: dict[str, set[str]] = {MUST_PASS: set(), MUST_FAIL: set()}
    for _ in range(300):
        canaries = make_canaries("tests", "tests/test_calc.py")
        tests = {**canaries.expected, **canaries.inserted_expected}
        sources = {**{canaries.path: canaries.source}, **canaries.inserted}
        for test, want in tests.items():
            path, name = test.split("::")
            assert re.fullmatch(r"test(_[a-z]+){3,4}", name) and not re.search(r"\d", name), name
            (node,) = [n for n in ast.parse(sources[path]).body if getattr(n, "name", "") == name]
            shapes[want].add(_shape(ast.unparse(node)))
        assert re.fullmatch(r"tests/test(_[a-z]+){3}\.py", canaries.path), canaries.path
        assert not canaries.source.startswith("import")  # nothing a planted module alone would have
    assert shapes[MUST_PASS] == shapes[MUST_FAIL] and len(shapes[MUST_PASS]) >= 8


def test_inserted_tests_land_anywhere_between_the_files_statements(tmp_path: Path) -> None:
    places = set()
    for i in range(60):
        path = tmp_path / f"test_{i}.py"
        path.write_text(OWN_FILE)
        canaries = make_canaries("", path.name)
        assert _insert(str(path), canaries.inserted[path.name]) == OWN_FILE.encode()
        text = path.read_text()
        compile(text, str(path), "exec")  # after the ``__future__`` import, never inside a statement
        names = [getattr(n, "name", type(n).__name__) for n in ast.parse(text).body]
        first = next(i for i, n in enumerate(names) if n.startswith("test_") and n not in OWN_NAMES)
        places.add(first)
    assert len(places) >= 4, places  # not always the end of the file


def test_a_name_the_file_already_uses_is_never_overwritten(tmp_path: Path) -> None:
    canaries = make_canaries("", "test_own.py")
    source = canaries.inserted["test_own.py"]
    taken = next(n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef))
    path = tmp_path / "test_own.py"
    path.write_text(OWN_FILE + f"\n\ndef {taken}():\n    assert True\n")
    before = path.read_bytes()
    assert _insert(str(path), source) is None and path.read_bytes() == before
    # Missing, or not Python: nothing is inserted (the grader then finds those tests missing).
    assert _insert(str(tmp_path / "absent.py"), source) is None
    (tmp_path / "bad.py").write_text("def broken(:\n")
    assert _insert(str(tmp_path / "bad.py"), source) is None


def test_inserted_tests_count_only_by_definite_outcomes() -> None:
    canaries = make_canaries("tests", "tests/test_calc.py")
    right = {**canaries.expected}
    assert check_canaries(canaries, right) == []  # inserted ones missing: their file may not run them
    (must_fail,) = [t for t, w in canaries.inserted_expected.items() if w == MUST_FAIL]
    (must_pass,) = [t for t, w in canaries.inserted_expected.items() if w == MUST_PASS]
    for excused in ("SKIPPED", "ERROR", "XFAIL"):
        assert check_canaries(canaries, {**right, must_fail: excused, must_pass: excused}) == []
    assert check_canaries(canaries, {**right, must_fail: "PASSED"}) == [
        "a planted test among the repository's that must fail came back PASSED"
    ]
    assert check_canaries(canaries, {**right, must_pass: "FAILED"}) == [
        "a planted test among the repository's that must pass came back FAILED"
    ]


def test_the_test_file_is_put_back_after_the_run(calc: tuple[SweBenchInstance, Any]) -> None:
    inst, sandbox = calc
    sandbox.reset()
    out = grade(sandbox, inst, inst.patch, timeout_s=120)
    assert out["resolved"] is True, out
    after = sandbox.exec(["cat", "tests/test_calc.py"], cwd=sandbox.workspace).stdout
    names = [n.name for n in ast.parse(after).body if isinstance(n, ast.FunctionDef)]
    assert names == ["test_mul", "test_add"], after  # the test patch's file, and nothing planted
