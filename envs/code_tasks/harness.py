"""Run a solution's unit tests and write a JSON report. Runs inside the sandbox; standard library only.

    python3 -I harness.py SPEC_JSON_PATH REPORT_JSON_PATH

SPEC_JSON_PATH ``-`` reads the spec from stdin, so that no file ever holds its nonce. SPEC is a JSON
object:

- ``source``: the solution's Python source, imported as the module ``solution``.
- ``entry_point``: the function or class the tests call, bound under that name in every test.
- ``tests``: ``[{"name": ..., "code": ...}]``, run in order, each in a fresh namespace that also holds
  ``solution`` (the module) and ``raises(exc_type, fn, *args, **kwargs)``.
- ``nonce``: a secret of this run; the report is signed with it (HMAC-SHA256) and never contains it,
  so the caller can tell the harness's report from any file the solution wrote.
- ``timeout_s`` (default 5): wall-clock limit of each test; ``import_timeout_s`` (default 5) the same
  for importing the solution.
- ``max_output_chars`` (default 4096): how much of stdout and of stderr is kept, per test and import.
- ``strict`` (default true): comparisons written in tests refuse to compare plain data (exact builtin
  scalars and containers of them) with any other object, so an object whose ``__eq__`` always says
  True cannot pass ``assert f(x) == 3``.

The report is rewritten atomically before the import, after it and after every test, so when the
solution ends the process the caller still has every result up to that point. The file is
``{"version": 1, "hmac": HEX, "report": TEXT}``: TEXT is the report's JSON (see ``_Report``) and HEX
its HMAC-SHA256 keyed with the nonce.

What it survives: output of any size (``sys.stdout``/``sys.stderr`` are captured and capped, and fds
0-2 point at /dev/null); ``sys.exit`` or any exception at import or in a test; a test that loops (a
SIGALRM timer stops it; a watchdog thread ends the run when the timeout is swallowed; a CPU rlimit
ends the process when the loop never returns to the interpreter); rebinding builtins, stdlib
functions or the harness's own globals (tests get a private copy of the builtins, and the harness
puts builtins, its globals and the modules it uses back after each piece of solution code); atexit
handlers and forked children (the harness leaves with ``os._exit``, and only its own process writes
the report); a solution that writes a report itself, now or from a child after the harness is gone
(it cannot sign one: the spec file is deleted and ``sys.argv`` emptied before it is imported).

What it does not defend against: code that walks interpreter frames or the garbage collector to reach
the harness's objects, or that uses ctypes. The sandbox, not this script, is the security boundary.

Exit status: 0 when the final report was written, 1 when no report could be written, 2 for a bad
command line or spec (nothing is run then).
"""

from __future__ import annotations

import _thread
import ast
import builtins
import contextlib
import io
import linecache
import math
import os
import reprlib
import signal
import sys
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType
from typing import Any

try:
    from _json import encode_basestring_ascii as _quote
except ImportError:  # pragma: no cover - CPython always has _json
    from json.encoder import py_encode_basestring_ascii as _quote

try:
    from _hashlib import hmac_digest as _hmac_digest
except ImportError:  # pragma: no cover - a Python built without OpenSSL
    from hmac import digest as _hmac_digest  # type: ignore[assignment]

try:
    import resource
except ImportError:  # pragma: no cover - not on every platform
    resource = None  # type: ignore[assignment]

REPORT_VERSION = 1
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_OUTPUT = 4096
MAX_ERROR_CHARS = 2000
SOLUTION_FILE = "<solution>"
USAGE = "usage: python3 -I harness.py SPEC_JSON_PATH REPORT_JSON_PATH\n"


class SpecError(ValueError):
    """The spec file is missing, unreadable or malformed."""


class _Timeout(BaseException):
    """Raised in the main thread by SIGALRM when solution code runs past its limit."""


@dataclass
class _Spec:
    source: str
    entry_point: str
    tests: list[tuple[str, str]]  # (name, code)
    nonce: str
    timeout_s: float
    import_timeout_s: float
    max_output_chars: int
    strict: bool


# --- spec ------------------------------------------------------------------------------------------
def _field(raw: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = raw.get(key, default)
    if value is None:
        raise SpecError(f"spec field {key!r} is missing")
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise SpecError(f"spec field {key!r} has the wrong type: {value!r:.80}")
    return value


def load_spec(path: str) -> _Spec:
    """Read and check the spec at ``path``; :class:`SpecError` says what is wrong."""
    import json  # only here: solution code may patch the json module later

    try:
        if path == "-":
            raw = json.loads(sys.stdin.buffer.read())
        else:
            with open(path, encoding="utf-8") as handle:
                raw = json.load(handle)
    except (OSError, ValueError) as exc:
        raise SpecError(f"cannot read the spec {path!r}: {exc}") from None
    if not isinstance(raw, dict):
        raise SpecError("the spec must be a JSON object")
    items = _field(raw, "tests", list)
    if not all(isinstance(item, dict) for item in items):
        raise SpecError("each test must be an object with 'name' and 'code'")
    tests = [(_field(item, "name", str), _field(item, "code", str)) for item in items]
    if len({name for name, _ in tests}) != len(tests):
        raise SpecError("test names must be unique")
    entry_point = _field(raw, "entry_point", str)
    if not entry_point.isidentifier():
        raise SpecError(f"entry_point {entry_point!r} is not a Python identifier")
    spec = _Spec(
        source=_field(raw, "source", str),
        entry_point=entry_point,
        tests=tests,
        nonce=_field(raw, "nonce", str, ""),
        timeout_s=float(_field(raw, "timeout_s", (int, float), DEFAULT_TIMEOUT_S)),
        import_timeout_s=float(_field(raw, "import_timeout_s", (int, float), DEFAULT_TIMEOUT_S)),
        max_output_chars=_field(raw, "max_output_chars", int, DEFAULT_MAX_OUTPUT),
        strict=_field(raw, "strict", bool, True),
    )
    if not (0 < spec.timeout_s < math.inf and 0 < spec.import_timeout_s < math.inf):
        raise SpecError("timeout_s and import_timeout_s must be positive and finite")
    if spec.max_output_chars < 0:
        raise SpecError("max_output_chars must not be negative")
    return spec


# --- report ----------------------------------------------------------------------------------------
def encode_json(value: object) -> str:
    """JSON text of ``value`` built with builtin types' own methods, which no solution can patch."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        return float.__repr__(value) if math.isfinite(value) else "null"
    if isinstance(value, str):
        return _quote(value)
    if isinstance(value, list):
        return "[" + ",".join([encode_json(item) for item in value]) + "]"
    if isinstance(value, dict):
        return "{" + ",".join([_quote(key) + ":" + encode_json(item) for key, item in value.items()]) + "}"
    raise TypeError(f"cannot encode a {type(value).__name__} as JSON")


class _Report:
    """The report, rewritten in full after each step.

    Fields: ``stage`` (``import``, ``tests``, ``done``, ``aborted``),
    ``import_error`` (text or null), ``import_stdout``, ``import_stderr``, ``harness_error`` (why the
    run was aborted, or null) and ``tests``: one object per finished test with ``name``, ``passed``,
    ``error`` (text or null), ``duration_s``, ``timed_out``, ``stdout``, ``stderr``,
    ``stdout_truncated`` and ``stderr_truncated``.
    """

    def __init__(self, nonce: str, path: str) -> None:
        self.path = path
        self.pid = os.getpid()
        self._key = nonce.encode("utf-8")
        self.data: dict[str, Any] = {
            "stage": "import", "import_error": None,
            "import_stdout": "", "import_stderr": "", "harness_error": None, "tests": [],
        }  # fmt: skip

    def write(self) -> None:
        """Sign the report and replace the file atomically; a forked child never writes."""
        if os.getpid() != self.pid:
            return
        body = encode_json(self.data)
        mac = _hmac_digest(self._key, body.encode("ascii"), "sha256").hex()
        data = encode_json({"version": REPORT_VERSION, "hmac": mac, "report": body}).encode("ascii")
        temp = self.path + ".tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(temp, self.path)

    def add(self, name: str, error: str | None, duration_s: float = 0.0, timed_out: bool = False,
            out: _Capture | None = None, err: _Capture | None = None) -> None:  # fmt: skip
        """Record one test's outcome (``error`` None means it passed)."""
        stdout, stdout_cut = out.value() if out else ("", False)
        stderr, stderr_cut = err.value() if err else ("", False)
        self.data["tests"].append({
            "name": name, "passed": error is None, "error": error, "duration_s": round(duration_s, 6),
            "timed_out": timed_out, "stdout": stdout, "stderr": stderr,
            "stdout_truncated": stdout_cut, "stderr_truncated": stderr_cut,
        })  # fmt: skip


class _Capture(io.TextIOBase):
    """A text stream that keeps the first ``limit`` characters written to it and counts the rest."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self._limit = limit
        self._parts: list[str] = []
        self._kept = 0
        self._dropped = 0

    def writable(self) -> bool:
        """Say that this stream can be written to."""
        return True

    def write(self, text: str) -> int:
        """Keep what fits under the limit; report everything as written."""
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        room = self._limit - self._kept
        if room > 0:
            piece = str.__getitem__(text, slice(0, room))
            self._parts.append(piece)
            self._kept += len(piece)
        self._dropped += max(0, len(text) - max(room, 0))
        return len(text)

    def value(self) -> tuple[str, bool]:
        """Return what was kept, and whether anything was dropped."""
        return "".join(self._parts), self._dropped > 0


# --- test code: compile, with comparisons that do not trust the solution's objects -----------------
_OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
        ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}  # fmt: skip


class _Rewriter(ast.NodeTransformer):
    """Route a test's comparisons through the helpers of :func:`test_helpers`.

    ``assert a OP b`` becomes ``__tg_check__(OP, a, b, text)`` (which explains a failure), any other
    single comparison ``__tg_compare__(OP, a, b)``; other asserts get their source as the message.
    """

    def __init__(self, source: str) -> None:
        self.source = source

    def _call(self, helper: str, args: list[ast.expr]) -> ast.Call:
        return ast.Call(func=ast.Name(id=helper, ctx=ast.Load()), args=args, keywords=[])

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        text = ast.get_source_segment(self.source, node.test) or "the assertion"
        test = node.test
        if node.msg is None and isinstance(test, ast.Compare) and len(test.ops) == 1:
            op = _OPS.get(type(test.ops[0]))
            if op is not None:
                args = [ast.Constant(op), self.visit(test.left), self.visit(test.comparators[0])]
                call = self._call("__tg_check__", [*args, ast.Constant(text)])
                return ast.copy_location(ast.Expr(call), node)
        self.generic_visit(node)
        if node.msg is None:
            node.msg = ast.Constant(f"assert {text}")
        return node

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        op = _OPS.get(type(node.ops[0])) if len(node.ops) == 1 else None
        if op is None:
            return node
        call = self._call("__tg_compare__", [ast.Constant(op), node.left, node.comparators[0]])
        return ast.copy_location(call, node)


def compile_test(name: str, code: str) -> CodeType | str:
    """Compile one test: its code object, or an error text when it does not compile."""
    filename = f"<test {name}>"
    try:
        tree = _Rewriter(code).visit(ast.parse(code, filename))
        compiled = compile(ast.fix_missing_locations(tree), filename, "exec", dont_inherit=True, optimize=0)
    except (SyntaxError, ValueError) as exc:
        return f"the test does not compile: {exc}"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    return compiled


def test_helpers(strict: bool) -> dict[str, Any]:
    """The names rewritten tests call; closures over builtins taken now, so later patches miss them."""
    import operator

    kind_of, ident, as_bool, type_error, assertion = type, id, bool, TypeError, AssertionError
    containers = frozenset(map(id, (list, tuple, set, frozenset, dict)))
    plain = containers | frozenset(map(id, (type(None), bool, int, float, complex, str, bytes)))
    dict_type = dict
    ops: dict[str, Callable[[Any, Any], Any]] = {
        "==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
        ">=": operator.ge, "in": lambda a, b: a in b, "not in": lambda a, b: a not in b,
        "is": operator.is_, "is not": operator.is_not,
    }  # fmt: skip
    shorten = reprlib.Repr()
    shorten.maxstring = shorten.maxother = 160
    shorten.maxlist = shorten.maxtuple = shorten.maxset = shorten.maxfrozenset = shorten.maxdict = 12

    def impure(value: object) -> type | None:  # the type of the first part that is not plain data
        stack: list[Any] = [value]
        seen: set[int] = set()
        while stack:
            item = stack.pop()
            kind = ident(kind_of(item))
            if kind not in plain:
                return kind_of(item)
            if kind in containers and ident(item) not in seen:
                seen.add(ident(item))
                stack.extend(dict_type.items(item) if kind_of(item) is dict_type else item)
        return None

    def compare(op: str, left: object, right: object) -> bool:
        if strict and op not in ("is", "is not"):
            left_bad, right_bad = impure(left), impure(right)
            one_sided = op in (
                "in",
                "not in",
            )  # an element of any kind may be looked up in a custom container
            if (left_bad is not None and right_bad is None) or (
                not one_sided and right_bad is not None and left_bad is None
            ):
                bad = left_bad or right_bad or object
                raise type_error(
                    f"strict test comparison: a {bad.__name__} object compared with plain data "
                    "(tests compare plain data only with exact builtin types)"
                )
        return as_bool(ops[op](left, right))

    def show(value: object) -> str:
        if impure(value) is None:
            return shorten.repr(value)
        try:
            text = repr(value)
        except Exception:
            text = "?"
        return f"{kind_of(value).__name__} object {text[:160]}"

    def check(op: str, left: object, right: object, text: str) -> None:
        if not compare(op, left, right):
            raise assertion(f"assert {text}\n  left:  {show(left)}\n  right: {show(right)}")

    def raises(expected: type[BaseException], fn: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except expected:
            return
        except Exception as exc:
            raise assertion(f"expected {expected.__name__}, got {kind_of(exc).__name__}") from exc
        raise assertion(f"expected {expected.__name__}, nothing was raised")

    return {"__tg_check__": check, "__tg_compare__": compare, "raises": raises}


# --- running solution code -------------------------------------------------------------------------
def describe(exc: BaseException, limit_s: float) -> str:
    """One exception as text: its message, then the innermost frames of the solution and the test."""
    if isinstance(exc, _Timeout):
        return f"timed out after {limit_s:g}s"
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    frames = [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if frame.filename == SOLUTION_FILE or frame.filename.startswith("<test ")
    ]
    if frames:
        text += "\n" + "".join(traceback.format_list(frames[-3:])).rstrip()
    return text[:MAX_ERROR_CHARS]


def make_restorer(namespaces: list[dict[str, Any]]) -> Callable[[], None]:
    """Snapshot ``namespaces``; the returned function puts them back, using only dict's own methods."""
    saved = [(namespace, dict(namespace)) for namespace in namespaces]

    def restore() -> None:
        for namespace, snapshot in saved:
            namespace.clear()
            namespace.update(snapshot)

    return restore


class _CpuLimit:
    """Lowers RLIMIT_CPU around solution code: the last resort for a loop that never yields to Python."""

    def __init__(self) -> None:
        self.original = resource.getrlimit(resource.RLIMIT_CPU) if resource else (-1, -1)

    def arm(self, seconds: float) -> None:
        """Let the process use ``seconds`` more CPU time (and a little slack) before the kernel kills it."""
        if resource is not None:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            soft, hard = int(usage.ru_utime + usage.ru_stime + seconds) + 2, self.original[1]
            self._set((soft if hard < 0 else min(soft, hard), hard))

    def disarm(self) -> None:
        """Put the original limit back."""
        self._set(self.original)

    def _set(self, limits: tuple[int, int]) -> None:
        if resource is not None:
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_CPU, limits)


@dataclass
class _RunResult:
    error: BaseException | None
    duration_s: float
    out: _Capture
    err: _Capture


def make_guard(
    restore: Callable[[], None], on_expire: Callable[[], None], max_output: int
) -> Callable[[Callable[..., object], tuple[object, ...], float], _RunResult]:
    """``run(fn, args, limit_s)``: call solution code under a timer, with output captured, and clean up.

    Between the call and ``restore()`` only closure cells are used: the call may have rebound any
    global or builtin. A watchdog thread calls ``on_expire()`` and ends the process when the code is
    still running well past its limit (the timer's exception was swallowed, or the handler replaced).
    """
    catch_all, timeout_type, clock, monotonic = BaseException, _Timeout, time.perf_counter, time.monotonic
    setitimer, real_timer = signal.setitimer, signal.ITIMER_REAL
    sleep, getpid, hard_exit, pid = time.sleep, os.getpid, os._exit, os.getpid()
    recursion_limit, cpu = sys.getrecursionlimit(), _CpuLimit()
    lock, never = _thread.allocate_lock(), math.inf
    armed, fired, deadline = [False], [False], [never]

    def on_alarm(signum: int, frame: types.FrameType | None) -> None:
        if armed[0]:
            fired[0] = True
            raise timeout_type()

    def watch(period: float = 0.05) -> None:
        while True:
            sleep(period)
            with lock:
                if monotonic() > deadline[0]:
                    restore()
                    on_expire()
                    hard_exit(0)

    _thread.start_new_thread(watch, ())

    def run(fn: Callable[..., object], args: tuple[object, ...], limit_s: float) -> _RunResult:
        out, err = _Capture(max_output), _Capture(max_output)
        sys.stdout, sys.stderr, sys.stdin = out, err, io.StringIO()
        signal.signal(signal.SIGALRM, on_alarm)
        sys.setrecursionlimit(recursion_limit)
        hard_limit = limit_s + max(1.0, limit_s / 2)
        cpu.arm(hard_limit)
        error: BaseException | None = None
        fired[0] = False
        with lock:
            deadline[0] = monotonic() + hard_limit
        started = clock()
        try:
            try:
                armed[0] = True
                setitimer(real_timer, limit_s)
                fn(*args)
            finally:
                armed[0] = False
                setitimer(real_timer, 0)
        except catch_all as exc:
            error = exc
        duration = clock() - started
        if getpid() != pid:  # a fork of the solution's (maybe with `lock` held): only the harness goes on
            hard_exit(0)
        with lock:
            deadline[0] = never
        restore()
        cpu.disarm()
        if fired[0] and not isinstance(error, _Timeout):  # it caught the timeout and carried on
            error = _Timeout()
        return _RunResult(error, duration, out, err)

    return run


# --- the run ---------------------------------------------------------------------------------------
def _explain(run: Callable[..., _RunResult], exc: BaseException, limit_s: float) -> str:
    """``describe`` under the guard: the exception's ``__str__`` is solution code too."""
    if type(exc) is _Timeout:
        return describe(exc, limit_s)
    box: list[str] = []
    run(lambda: box.append(describe(exc, limit_s)), (), 2.0)
    return box[0] if box else f"{type(exc).__name__} (its message could not be shown)"


def _intact(namespace: dict[str, Any], bound: dict[str, Any], copy: dict[str, Any], pristine: dict) -> bool:
    """Whether a test's namespace still holds what the harness put there, builtins included."""
    if namespace.get("__builtins__") is not copy or len(copy) != len(pristine):
        return False
    return all(namespace.get(key) is value for key, value in bound.items()) and all(
        copy.get(key) is value for key, value in pristine.items()
    )


def run_spec(spec: _Spec, report: _Report) -> None:
    """Import the solution and run every test, recording each in ``report`` as it finishes."""
    names = [name for name, _ in spec.tests]
    tests = [compile_test(name, code) for name, code in spec.tests]
    pristine, helpers = dict(builtins.__dict__), test_helpers(spec.strict)
    progress: list[int] = [-1]  # the test running now; -1 while importing

    def on_expire() -> None:  # called by the watchdog, which then ends the process
        report.data["stage"] = "aborted"
        start = progress[0]
        if start < 0:
            report.data["import_error"] = "importing the solution ran past its time limit and did not stop"
            why = "not run: importing the solution did not stop"
        else:
            limit = f"{spec.timeout_s:g}s"
            report.add(names[start], f"timed out after {limit} and did not stop", timed_out=True)
            why = "not run: an earlier test did not stop"
        report.data["harness_error"] = why.replace("not run: ", "aborted: ")
        for name in names[start + 1 :]:
            report.add(name, why)
        report.write()

    module = types.ModuleType("solution")
    module.__file__ = SOLUTION_FILE
    code: CodeType | None = None
    import_error: str | None = None
    try:
        code = compile(spec.source, SOLUTION_FILE, "exec", dont_inherit=True)
    except Exception as exc:  # SyntaxError, null bytes, too deeply nested
        import_error = describe(exc, 0.0)
    linecache.cache[SOLUTION_FILE] = (len(spec.source), None, spec.source.splitlines(True), SOLUTION_FILE)
    sys.modules["solution"] = sys.modules["__main__"] = module
    entry_box: list[object] = []
    missing = object()

    def load(namespace: dict[str, Any] = module.__dict__, name: str = spec.entry_point) -> None:
        exec(code, namespace)  # type: ignore[arg-type]  # only called when code compiled
        entry_box.append(namespace.get(name, missing))  # inside the guard: a hostile key's __eq__ may run

    restore = make_restorer(
        [builtins.__dict__, globals(), os.__dict__, signal.__dict__, time.__dict__, io.__dict__,
         traceback.__dict__, linecache.__dict__, reprlib.__dict__, types.__dict__, _thread.__dict__]
    )  # fmt: skip
    run = make_guard(restore, on_expire, spec.max_output_chars)
    if code is not None:
        result = run(load, (), spec.import_timeout_s)
        report.data["import_stdout"], _ = result.out.value()
        report.data["import_stderr"], _ = result.err.value()
        entry = entry_box[0] if entry_box else missing
        if result.error is not None:
            import_error = _explain(run, result.error, spec.import_timeout_s)
        elif entry is missing:
            import_error = f"the solution does not define {spec.entry_point!r}"
        elif not callable(entry):
            import_error = f"{spec.entry_point!r} is a {type(entry).__name__}, not a function or class"
        else:
            import_error = None
    report.data["import_error"] = import_error
    report.data["stage"] = "tests"
    report.write()

    for index, name in enumerate(names):  # (no zip(strict=...): the sandbox's Python may be older)
        progress[0], compiled = index, tests[index]
        if import_error is not None:
            report.add(name, "not run: the solution failed to import")
            continue
        if isinstance(compiled, str):
            report.add(name, compiled)
            continue
        copy, bound = dict(pristine), {spec.entry_point: entry, "solution": module, **helpers}
        namespace = {"__builtins__": copy, "__name__": "__test__", **bound}
        result = run(exec, (compiled, namespace), spec.timeout_s)
        error = None if result.error is None else _explain(run, result.error, spec.timeout_s)
        if error is None and not _intact(namespace, bound, copy, pristine):
            error = "the solution changed the test's namespace or its builtins"
        timed_out = type(result.error) is _Timeout
        report.add(name, error, result.duration_s, timed_out, result.out, result.err)
        report.write()


def _say(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, text.encode("utf-8", "replace"))


def _isolate() -> None:
    """Point fds 0-2 at /dev/null: raw writes by the solution go nowhere, and no child keeps a pipe open."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    if resource is not None:  # a process killed by the CPU limit should not leave a core file
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))


def main(argv: list[str]) -> int:
    """Run the spec at ``argv[1]``, writing the report to ``argv[2]``; returns the exit status."""
    if len(argv) != 3:
        _say(USAGE)
        return 2
    try:
        spec = load_spec(argv[1])
    except SpecError as exc:
        _say(f"harness: {exc}\n")
        return 2
    report = _Report(spec.nonce, os.path.abspath(argv[2]))
    try:
        report.write()
    except OSError as exc:
        _say(f"harness: cannot write the report: {exc}\n")
        return 1
    if argv[1] != "-":
        with contextlib.suppress(OSError):  # the nonce is in the spec: the solution must not read it
            os.unlink(argv[1])
    sys.argv = [SOLUTION_FILE]
    _isolate()
    try:
        run_spec(spec, report)
        report.data["stage"] = "done"
    except BaseException:  # a bug of the harness's own: say so in the report
        report.data["stage"] = "aborted"
        report.data["harness_error"] = traceback.format_exc()[-MAX_ERROR_CHARS:]
    try:
        report.write()
    except OSError:  # stderr is /dev/null by now: the missing report says it all
        return 1
    return 0


if __name__ == "__main__":
    os._exit(main(sys.argv))  # not sys.exit: the solution's atexit handlers and threads must not run
