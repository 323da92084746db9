"""Bug injection: small AST-located mutations of a Python source file, applied as byte-exact edits.

Each :class:`Mutation` replaces one short span of one line (an operator, a literal, two arguments), so
the diff between the original and the mutated file is the one line a real bug would touch, and the gold
patch is that diff reversed. Operators: flip a comparison, drop a ``not``, move an integer literal by
one (offsets, slice bounds), swap ``and``/``or``, swap ``+``/``-``, swap two call arguments, and change
what a function returns.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass

_COMPARE = {
    ast.Lt: ("<", "<="),
    ast.LtE: ("<=", "<"),
    ast.Gt: (">", ">="),
    ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="),
    ast.NotEq: ("!=", "=="),
    ast.Is: ("is", "is not"),
    ast.IsNot: ("is not", "is"),
    ast.In: ("in", "not in"),
    ast.NotIn: ("not in", "in"),
}
_OP_TEXT = {"is not": r"is\s+not", "not in": r"not\s+in"}
_SKIP_NAMES = re.compile(r"^(test_|_?_repr_|__repr__$|__str__$)")


@dataclass(frozen=True)
class Mutation:
    """One injected bug: bytes ``start:end`` of the file become ``replacement``."""

    path: str
    function: str
    function_lines: tuple[int, ...]  # the ``def`` line and the first decorator's line
    operator: str
    line: int
    start: int
    end: int
    original: str
    replacement: str

    @property
    def key(self) -> str:
        """A stable id, unique within a package version."""
        return f"{self.path}:{self.line}:{self.start}:{self.operator}"

    def apply(self, source: bytes) -> bytes:
        """``source`` with the mutation applied (the span must hold ``original``)."""
        if source[self.start : self.end].decode("utf-8") != self.original:
            raise ValueError(f"{self.path}:{self.line}: the source changed under mutation {self.key}")
        return source[: self.start] + self.replacement.encode("utf-8") + source[self.end :]


class _Offsets:
    def __init__(self, source: bytes) -> None:
        self.source = source
        self.starts = [0]
        for i, byte in enumerate(source):
            if byte == 0x0A:
                self.starts.append(i + 1)

    def at(self, lineno: int, col: int) -> int:
        return self.starts[lineno - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        start = self.at(getattr(node, "lineno", 1), getattr(node, "col_offset", 0))
        return start, self.at(getattr(node, "end_lineno", 1), getattr(node, "end_col_offset", 0))

    def text(self, start: int, end: int) -> str:
        return self.source[start:end].decode("utf-8")


def _one_line(*nodes: ast.AST) -> bool:
    lines = {getattr(n, "lineno", None) for n in nodes} | {getattr(n, "end_lineno", None) for n in nodes}
    return len(lines) == 1 and None not in lines


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str, source: bytes) -> None:
        self.path = path
        self.off = _Offsets(source)
        self.lines = source.decode("utf-8").splitlines()
        self.stack: list[ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef] = []
        self.found: list[Mutation] = []

    # --- scopes -------------------------------------------------------------------------------
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.stack.append(node)
        self.generic_visit(node)
        self.stack.pop()

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.stack.append(node)
        for stmt in node.body:  # the body only: defaults and decorators run at import
            if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
                self.visit(stmt)
        self.stack.pop()

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    def visit_If(self, node: ast.If) -> None:
        test = ast.unparse(node.test)
        if "TYPE_CHECKING" in test or "__name__" in test:
            return
        self.generic_visit(node)

    def _function(self) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        for scope in reversed(self.stack):
            if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return scope
        return None

    def _add(self, node: ast.AST, operator: str, start: int, end: int, replacement: str) -> None:
        fn = self._function()
        if fn is None or _SKIP_NAMES.match(fn.name):
            return
        line = node.lineno  # type: ignore[attr-defined]
        if "pragma: no cover" in self.lines[line - 1]:
            return
        qual = ".".join(s.name for s in self.stack[: self.stack.index(fn) + 1])
        lines = (fn.lineno, *(d.lineno for d in fn.decorator_list[:1]))
        self.found.append(
            Mutation(
                self.path, qual, lines, operator, line, start, end, self.off.text(start, end), replacement
            )
        )

    # --- operators ----------------------------------------------------------------------------
    def visit_Compare(self, node: ast.Compare) -> None:
        op = type(node.ops[0])
        right = node.comparators[0]
        if op in _COMPARE and _one_line(node.left, right):
            start, end = self.off.span(node.left)[1], self.off.span(right)[0]
            gap = self.off.text(start, end)
            old, new = _COMPARE[op]
            match = re.search(rf"(?<![\w=<>!]){_OP_TEXT.get(old, re.escape(old))}(?![\w=<>])", gap)
            if match and re.fullmatch(r"[\s()]*", gap[: match.start()] + gap[match.end() :]):
                self._add(node, "flip-comparison", start + match.start(), start + match.end(), new)
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not) and _one_line(node):
            start, operand = self.off.span(node)[0], self.off.span(node.operand)[0]
            if re.fullmatch(r"not\s+|not(?=\()", self.off.text(start, operand)):
                self._add(node, "drop-not", start, operand, "")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        value = node.value
        if type(value) is int and _one_line(node):
            start, end = self.off.span(node)
            if re.fullmatch(r"\d+", self.off.text(start, end)):
                self._add(node, "off-by-one", start, end, str(value + 1 if value <= 1 else value - 1))

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        if len(node.values) == 2 and _one_line(*node.values):
            start, end = self.off.span(node.values[0])[1], self.off.span(node.values[1])[0]
            gap = self.off.text(start, end)
            old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            match = re.search(rf"\b{old}\b", gap)
            if match and re.fullmatch(r"[\s()]*", gap[: match.start()] + gap[match.end() :]):
                self._add(node, "swap-boolean", start + match.start(), start + match.end(), new)
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        strings = any(
            isinstance(n, ast.Constant) and isinstance(n.value, str) for n in (node.left, node.right)
        )
        if isinstance(node.op, (ast.Add, ast.Sub)) and _one_line(node.left, node.right) and not strings:
            start, end = self.off.span(node.left)[1], self.off.span(node.right)[0]
            gap = self.off.text(start, end)
            old, new = ("+", "-") if isinstance(node.op, ast.Add) else ("-", "+")
            match = re.search(re.escape(old), gap)
            if match and re.fullmatch(r"[\s()]*", gap[: match.start()] + gap[match.end() :]):
                self._add(node, "swap-arithmetic", start + match.start(), start + match.end(), new)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        args = node.args
        if len(args) >= 2 and not any(isinstance(a, ast.Starred) for a in args[:2]) and _one_line(*args[:2]):
            (a0, a1), (b0, b1) = self.off.span(args[0]), self.off.span(args[1])
            first, between, second = self.off.text(a0, a1), self.off.text(a1, b0), self.off.text(b0, b1)
            if first != second and re.fullmatch(r"\s*,\s*", between):
                self._add(node, "swap-arguments", a0, b1, f"{second}{between}{first}")
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        value = node.value
        if value is not None and _one_line(value):
            start, end = self.off.span(value)
            if isinstance(value, ast.Constant) and isinstance(value.value, bool):
                self._add(node, "change-return", start, end, str(not value.value))
            elif isinstance(value, (ast.Name, ast.Attribute, ast.Subscript)) and not (
                isinstance(value, ast.Name) and value.id in ("None", "self", "cls")
            ):
                self._add(node, "change-return", start, end, "None")
        self.generic_visit(node)


def _function_spans(tree: ast.Module, off: _Offsets) -> list[tuple[int, int]]:
    """Byte spans of every function, decorators included, from the start of their first line."""
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            spans.append((off.at(first, 0), off.span(node)[1]))
    return spans


def _parse_block(text: bytes) -> str:
    # Under ``if 1:`` an indented def (a method, a closure) parses as it stands.
    return ast.dump(ast.parse(b"if 1:\n" + text if text[:1] in (b" ", b"\t") else text))


def find_mutations(path: str, source: bytes) -> list[Mutation]:
    """Every mutation the operators find in the function bodies of ``source`` (file ``path``), each
    checked to parse and to change the syntax tree.

    The check parses only the innermost function that holds the mutation: an edit of an operator,
    literal or balanced argument inside it cannot change how the rest of the file parses, and a large
    module is not parsed again for each of its hundreds of mutations.
    """
    tree = ast.parse(source)
    finder = _Finder(path, source)
    finder.visit(tree)
    spans = _function_spans(tree, finder.off)
    before: dict[tuple[int, int], str] = {}
    out = []
    for m in finder.found:
        span = max((sp for sp in spans if sp[0] <= m.start and m.end <= sp[1]), key=lambda sp: sp[0])
        start, end = span
        if span not in before:
            before[span] = _parse_block(source[start:end])
        edited = source[start : m.start] + m.replacement.encode("utf-8") + source[m.end : end]
        try:
            after = _parse_block(edited)
        except SyntaxError:
            continue
        if after != before[span]:
            out.append(m)
    return out


def iter_covered(
    mutations: list[Mutation], covered: dict[tuple[str, int], set[str]]
) -> Iterator[tuple[Mutation, set[str]]]:
    """The mutations whose function some test calls, with those tests (``covered`` maps a function's
    ``(path, first line)`` to the node ids of the tests that called it).
    """
    for m in mutations:
        tests: set[str] = set()
        for line in m.function_lines:
            tests |= covered.get((m.path, line), set())
        if tests:
            yield m, tests
