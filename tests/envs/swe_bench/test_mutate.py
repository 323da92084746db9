from __future__ import annotations

import ast
import collections

from tangram_env.envs.swe_bench.mutate import find_mutations, iter_covered
from tangram_env.envs.swe_bench.statement import write_statement

SOURCE = b'''"""A module."""

MAX = 10


def clamp(x, lo=0, hi=MAX):
    """Docstring: 1 < 2 is not mutated."""
    if x < lo:
        return lo
    if not x <= hi:
        return hi
    return x


def window(items, size):
    out = []
    for i in range(len(items) - size + 1):
        out.append(items[i : i + size])
    return out


def both(a, b):
    return bool(a and b) is True


class Box:
    def has(self, key):
        return key in self.keys or False


def ratio(a, b):
    return divmod(a, b)


def test_ignored():
    assert 1 == 1


if __name__ == "__main__":
    print(clamp(3 > 2))
'''


def test_operators_find_one_line_edits_that_change_the_tree() -> None:
    found = find_mutations("mod.py", SOURCE)
    ops = collections.Counter(m.operator for m in found)
    assert set(ops) >= {
        "flip-comparison",
        "drop-not",
        "off-by-one",
        "swap-boolean",
        "swap-arithmetic",
        "swap-arguments",
        "change-return",
    }
    before = ast.dump(ast.parse(SOURCE))
    for m in found:
        after = m.apply(SOURCE)
        assert ast.dump(ast.parse(after)) != before
        changed = [
            i for i, (x, y) in enumerate(zip(SOURCE.splitlines(), after.splitlines(), strict=True)) if x != y
        ]
        assert changed == [m.line - 1], m  # exactly the one line the mutation names
        assert m.function in {
            "clamp",
            "window",
            "both",
            "Box.has",
            "ratio",
        }  # never tests, docstrings or __main__
    flips = {(m.line, m.original, m.replacement) for m in found if m.operator == "flip-comparison"}
    assert (8, "<", "<=") in flips and (10, "<=", "<") in flips and (28, "in", "not in") in flips
    assert any(m.operator == "drop-not" and m.original == "not " for m in found)
    swap = next(m for m in found if m.operator == "swap-arguments")
    assert (swap.original, swap.replacement) == ("a, b", "b, a")


def test_a_mutation_undone_is_the_original() -> None:
    for m in find_mutations("mod.py", SOURCE):
        mutated = m.apply(SOURCE)
        restored = mutated[: m.start] + m.original.encode() + mutated[m.start + len(m.replacement.encode()) :]
        assert restored == SOURCE


def test_only_covered_functions_are_candidates() -> None:
    found = find_mutations("mod.py", SOURCE)
    clamp_line = next(m.function_lines[0] for m in found if m.function == "clamp")
    covered = {("mod.py", clamp_line): {"tests/test_mod.py::test_clamp"}}
    picked = list(iter_covered(found, covered))
    assert picked and all(m.function == "clamp" for m, _ in picked)
    assert all(tests == {"tests/test_mod.py::test_clamp"} for _, tests in picked)


def test_statements_report_failures_without_the_fix() -> None:
    failing = ["tests/test_mod.py::test_clamp", "tests/test_mod.py::test_window[3]"]
    messages = {
        failing[0]: "AssertionError: assert 10 == 11\n +  where 10 = <function clamp at 0x7f00aa>(11)",
        failing[1]: "IndexError: list index out of range",
    }
    text = write_statement("mod", "1.0", failing, messages, seed=3)
    assert text.startswith("test_clamp fails: AssertionError: assert 10 == 11")
    assert "tests/test_mod.py::test_window[3]" in text and "IndexError" in text
    assert "0x7f00aa" not in text  # addresses differ per run: left out, so statements are reproducible
    assert text == write_statement("mod", "1.0", failing, messages, seed=3)
    assert "if not x" not in text and "diff" not in text
