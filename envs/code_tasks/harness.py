"""Run a solution's unit tests and write a signed JSON report. Standard library only.

    python3 -I harness.py SPEC_JSON_PATH REPORT_JSON_PATH

Two processes. The **judge** (this process) runs the tests and decides every verdict; it never runs
a line of the solution. The **solution process**, forked from the judge before the judge has read
anything secret, imports the solution and answers the judge's requests over a pair of pipes: call
this, get that attribute, apply this operator. What crosses back is plain data (exact builtin scalars
and containers, size-capped), a handle to an object that stays in the solution process, or an
exception described as text. Comparisons and assertions run in the judge on that data, so an object
whose ``__eq__`` always says True never reaches them, and nothing the solution does to its own
interpreter (builtins, the garbage collector, frames, ctypes) touches the judge's.

The judge makes itself non-dumpable before it reads the spec, so no other process of the sandbox's
user can read its memory, environment or file descriptors (``/proc/PID/mem``, ``environ``, ``fd``)
or ptrace it. The spec's ``nonce`` (read from stdin with ``-``, so no file ever holds it) signs the
report with HMAC-SHA256; a report the solution writes itself cannot be signed.

SPEC is a JSON object:

- ``source``: the solution's Python source, imported as the module ``solution``.
- ``entry_point``: the function or class the tests call, bound under that name in every test.
- ``tests``: ``[{"name": ..., "code": ...}]``, run in order by the judge, each in a fresh namespace
  that also holds ``solution`` (the module) and ``raises(exc_type, fn, *args, **kwargs)``.
- ``nonce``: a secret of this run; it signs the report and is never written anywhere.
- ``timeout_s`` (default 5): wall-clock limit of each test; ``import_timeout_s`` (default 5) the same
  for importing the solution. Past it the solution process is killed and started afresh.
- ``max_output_chars`` (default 4096): how much of stdout and of stderr is kept, per test and import.
- ``strict`` (default true): comparisons written in tests refuse to compare plain data with any other
  object (a solution's object is never equal to a builtin value).

The report is rewritten atomically before the import, after it and after every test, as
``{"version": 1, "hmac": HEX, "report": TEXT}`` (TEXT is the report's JSON, see ``_Report``).
A test fails when the solution raises, returns a wrong value, runs past its time, ends its process
(which is then started again for the next test) or breaks the protocol.

Exit status: 0 when the final report was written, 1 when no report could be written, 2 for a bad
command line or spec (nothing is run then).
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import json
import linecache
import marshal
import math
import operator
import os
import reprlib
import select
import signal
import socket
import sys
import time
import traceback
import types
from collections.abc import Callable
from types import CodeType

#: ``typing`` and ``dataclasses`` would cost every grading about 9 ms of imports: names for mypy only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    #: Encodes a long flat list or tuple as one node, or says no (None): see ``_Link._big``.
    Big = Callable[[Any], list[Any] | None]

try:
    from _hashlib import hmac_digest as _hmac_digest
except ImportError:  # pragma: no cover - a Python built without OpenSSL
    from hmac import digest as _hmac_digest  # type: ignore[assignment]

REPORT_VERSION = 1
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_OUTPUT = 4096
MAX_ERROR_CHARS = 2000
MAX_MESSAGE_BYTES = 16 << 20  # a reply larger than this is a protocol error
MAX_DEPTH = 100  # nesting of plain data that crosses the pipes
SOLUTION_FILE = "<solution>"
USAGE = "usage: python3 -I harness.py SPEC_JSON_PATH REPORT_JSON_PATH\n"


class SpecError(ValueError):
    """The spec file is missing, unreadable or malformed."""


class _Spec:
    def __init__(
        self,
        *,
        source: str,
        entry_point: str,
        tests: list[tuple[str, str]],
        nonce: str,
        timeout_s: float,
        import_timeout_s: float,
        max_output_chars: int,
        strict: bool,
    ) -> None:
        self.source = source
        self.entry_point = entry_point
        self.tests = tests  # (name, code)
        self.nonce = nonce
        self.timeout_s = timeout_s
        self.import_timeout_s = import_timeout_s
        self.max_output_chars = max_output_chars
        self.strict = strict


# --- spec ------------------------------------------------------------------------------------------
def _field(raw: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = raw.get(key, default)
    if value is None:
        raise SpecError(f"spec field {key!r} is missing")
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise SpecError(f"spec field {key!r} has the wrong type: {value!r:.80}")
    return value


def load_spec(path: str) -> _Spec:
    """Read and check the spec at ``path`` (``-``: stdin); :class:`SpecError` says what is wrong."""
    try:
        if path == "-":
            raw = json.loads(sys.stdin.buffer.read())
        else:
            with open(path, encoding="utf-8") as handle:
                raw = json.load(handle)
    except (OSError, ValueError) as exc:
        raise SpecError(f"cannot read the spec {path!r}: {exc}") from None
    return check_spec(raw)


def check_spec(raw: object) -> _Spec:
    """The spec that the JSON value ``raw`` describes; :class:`SpecError` says what is wrong."""
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
    """JSON text of ``value`` (ASCII only, so that the HMAC is over well-defined bytes)."""
    return json.dumps(value, ensure_ascii=True, separators=(",", ":"), allow_nan=False)


class _Report:
    """The report, rewritten in full after each step.

    Fields: ``stage`` (``import``, ``tests``, ``done``, ``aborted``),
    ``import_error`` (text or null), ``import_stdout``, ``import_stderr``, ``harness_error`` (why the
    run was aborted, or null) and ``tests``: one object per finished test with ``name``, ``passed``,
    ``error`` (text or null), ``duration_s``, ``timed_out``, ``stdout``, ``stderr``,
    ``stdout_truncated`` and ``stderr_truncated``.
    """

    def __init__(self, nonce: str, path: str, send: Callable[[bytes], None] | None = None) -> None:
        self.path = path
        self._send = send  # the warm judge's: each signed report goes to the tool, no file is written
        self._key = nonce.encode("utf-8")
        self.data: dict[str, Any] = {
            "stage": "import", "import_error": None,
            "import_stdout": "", "import_stderr": "", "harness_error": None, "tests": [],
        }  # fmt: skip

    def write(self) -> None:
        """Sign the report and replace the file atomically."""
        body = encode_json(self.data)
        mac = _hmac_digest(self._key, body.encode("ascii"), "sha256").hex()
        data = encode_json({"version": REPORT_VERSION, "hmac": mac, "report": body}).encode("ascii")
        if self._send is not None:
            self._send(data)
            return
        temp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(temp, self.path)

    def add(self, name: str, error: str | None, duration_s: float = 0.0, timed_out: bool = False,
            output: dict[str, Any] | None = None) -> None:  # fmt: skip
        """Record one test's outcome (``error`` None means it passed)."""
        out = output or {}
        self.data["tests"].append({
            "name": name, "passed": error is None, "error": error, "duration_s": round(duration_s, 6),
            "timed_out": timed_out, "stdout": out.get("stdout", ""), "stderr": out.get("stderr", ""),
            "stdout_truncated": out.get("stdout_cut", False),
            "stderr_truncated": out.get("stderr_cut", False),
        })  # fmt: skip


# --- plain data across the pipes -------------------------------------------------------------------
# A value is a list of nodes in post-order (children before their container), so that data of any depth
# crosses without recursion, and shared parts stay shared. A node is ``[tag, payload]``: ``v`` a JSON
# scalar, ``f`` a float JSON lacks, ``b`` bytes (hex), ``c`` a complex, ``l``/``t``/``s``/``fs`` a list,
# tuple, set or frozenset of node indices, ``d`` a dict as ``[[key, value], ...]`` indices, and ``h`` a
# handle to an object that stays in the solution process (``["h", id, type name]``). The value is the
# last node.
_PLAIN_SCALARS = (type(None), bool, int, str)
_TAGS: dict[type, str] = {list: "l", tuple: "t", set: "s", frozenset: "fs", dict: "d"}
_BUILD: dict[str, Callable[[list[Any]], Any]] = {"l": list, "t": tuple, "s": set, "fs": frozenset}
_BIG = 1000  # lists and tuples this long may be sent once and referred to after (see ``_Link._big``)
_FLAT = 16  # lists and tuples this long of JSON scalars only are one node (``L`` or ``T``)
_JSON_SCALARS = {type(None), bool, int, str, float}


def _flat(items: list[Any] | tuple[Any, ...]) -> bool:
    """Whether ``items`` holds JSON scalars only (finite floats)."""
    kinds = set(map(type, items))
    return kinds <= _JSON_SCALARS and (float not in kinds or all(map(_finite, items)))


def _finite(value: object) -> bool:
    return type(value) is not float or math.isfinite(value)


def _leaf(item: object) -> list[Any] | None:
    kind = type(item)
    if kind in _PLAIN_SCALARS:
        return ["v", item]
    if kind is float:
        return ["v", item] if math.isfinite(item) else ["f", repr(item)]  # type: ignore[arg-type]
    if kind is bytes:
        return ["b", item.hex()]  # type: ignore[attr-defined]
    if kind is complex:
        return ["c", [item.real, item.imag]]  # type: ignore[attr-defined]
    return None


def encode_value(value: object, handle_of: Callable[[object], list[Any]], big: Big | None = None) -> list:
    """``value`` as nodes; anything but exact builtin data (and cycles) goes through ``handle_of``.

    ``big``, if given, may encode a long list or tuple as one node (the judge's cache, see ``_Link``).
    """
    nodes: list[Any] = []
    memo: dict[int, int] = {}
    open_ids: set[int] = set()
    stack: list[tuple[object, list[Any], list[int]]] = []

    def emit(item: object) -> int | None:  # the item's node index, or None once its frame is pushed
        node = _leaf(item)
        if node is None:
            if id(item) in memo:
                return memo[id(item)]
            if type(item) not in _TAGS or id(item) in open_ids:
                node = handle_of(item)
            elif type(item) in (list, tuple) and len(item) >= _FLAT:  # type: ignore[arg-type]
                if big is not None and len(item) >= _BIG:  # type: ignore[arg-type]
                    node = big(item)
                if node is None and _flat(item):  # type: ignore[arg-type]
                    node = ["L" if type(item) is list else "T", list(item)]  # type: ignore[call-overload]
            if node is None:
                open_ids.add(id(item))
                parts = [p for pair in dict.items(item) for p in pair] if type(item) is dict else list(item)  # type: ignore[call-overload]
                stack.append((item, parts, []))
                return None
        nodes.append(node)
        return len(nodes) - 1

    emit(value)
    while stack:
        item, parts, got = stack[-1]
        if len(got) < len(parts):
            index = emit(parts[len(got)])
            if index is not None:
                got.append(index)
            continue
        stack.pop()
        tag = _TAGS[type(item)]
        nodes.append([tag, [got[i : i + 2] for i in range(0, len(got), 2)] if tag == "d" else got])
        memo[id(item)] = len(nodes) - 1
        open_ids.discard(id(item))
        if stack:
            stack[-1][2].append(len(nodes) - 1)
    return nodes


def decode_value(
    nodes: Any, resolve: Callable[[list[Any]], object], cache: dict[int, Any] | None = None
) -> Any:
    """The value that :func:`encode_value` made ``nodes`` of; handles go through ``resolve``.

    ``cache`` (the solution process's only) keeps long flat lists the judge sends once (``K`` nodes) for
    later requests (``k`` nodes); each use gets a value equal to the one sent (see :func:`_lend`).
    """
    if type(nodes) is not list or not nodes:
        raise ValueError("a value must be a non-empty list of nodes")
    built: list[Any] = []

    def part(index: object) -> Any:
        if type(index) is not int or not 0 <= index < len(built):
            raise ValueError("a node refers to a node that does not come before it")
        return built[index]

    for node in nodes:
        if type(node) is not list or len(node) < 2 or type(node[0]) is not str:
            raise ValueError("a malformed node")
        tag, payload = node[0], node[1]
        if tag == "v" and (type(payload) in _PLAIN_SCALARS or type(payload) is float):
            value = payload
        elif tag == "f" and payload in ("nan", "inf", "-inf"):
            value = float(payload)
        elif tag == "b" and type(payload) is str:
            value = bytes.fromhex(payload)
        elif tag == "c" and type(payload) is list and len(payload) == 2:
            value = complex(float(payload[0]), float(payload[1]))
        elif tag == "h":
            value = resolve(node)
        elif tag in ("L", "T") and type(payload) is list and _flat(payload):
            value = list(payload) if tag == "L" else tuple(payload)
        elif cache is not None and tag == "K" and len(node) == 3 and node[2][0] in ("l", "t"):
            kind, items = node[2]
            cache[payload] = [tuple(items), None] if kind == "t" else [items, None]
            value = _lend(cache[payload])
        elif cache is not None and tag == "k":
            value = _lend(cache[payload])
        elif tag in _BUILD and type(payload) is list:
            value = _BUILD[tag]([part(i) for i in payload])
        elif tag == "d" and type(payload) is list:
            if not all(type(pair) is list and len(pair) == 2 for pair in payload):
                raise ValueError("a malformed dict")
            value = {part(key): part(item) for key, item in payload}
        else:
            raise ValueError(f"unknown node {str(node)[:80]}")
        built.append(value)
    return built[-1]


def _lend(entry: list[Any]) -> Any:
    """The value of a cached long flat list or tuple (``[pristine, lent]``), as if freshly sent.

    A tuple of scalars cannot change: the same one serves every use. A list is copied once, then the
    copy is lent again while it still equals the original (comparing is several times cheaper than
    copying); one the solution changed is replaced by a fresh copy.
    """
    pristine, lent = entry
    if type(pristine) is tuple:
        return pristine
    if lent is None or lent != pristine:
        entry[1] = lent = list(pristine)
    return lent


def _write_all(fd: int, data: bytes, deadline: float) -> bool:
    """Write ``data`` to non-blocking ``fd`` before ``deadline``; False when time ran out."""
    view = memoryview(data)
    while view:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        _, ready, _ = select.select([], [fd], [], left)
        if ready:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                continue
            except OSError:  # the solution process is gone
                raise SolutionFailed("the solution's process ended") from None
    return True


# --- the solution process --------------------------------------------------------------------------
_BINARY = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow, "matmul": operator.matmul,
    "and": operator.and_, "or": operator.or_, "xor": operator.xor, "lshift": operator.lshift,
    "rshift": operator.rshift, "eq": operator.eq, "ne": operator.ne, "lt": operator.lt,
    "le": operator.le, "gt": operator.gt, "ge": operator.ge, "contains": operator.contains,
    "getitem": operator.getitem, "divmod": divmod,
}  # fmt: skip
_UNARY: dict[str, Callable[..., Any]] = {
    "neg": operator.neg, "pos": operator.pos, "abs": abs, "invert": operator.invert, "len": len,
    "hash": hash, "bool": bool, "repr": repr, "str": str, "iter": iter, "next": next, "int": int,
    "float": float, "index": operator.index, "round": round, "callable": callable,
}  # fmt: skip


class _Capture(io.TextIOBase):
    """A text stream that keeps the first ``limit`` characters written to it and counts the rest."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self._limit, self._kept, self._dropped = limit, 0, 0
        self._parts: list[str] = []

    def writable(self) -> bool:
        """Say that this stream can be written to."""
        return True

    def write(self, text: str) -> int:
        """Keep what fits under the limit; report everything as written."""
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        room = self._limit - self._kept
        if room > 0:
            self._parts.append(text[:room])
            self._kept += min(room, len(text))
        self._dropped += max(0, len(text) - max(room, 0))
        return len(text)

    def value(self) -> tuple[str, bool]:
        """Return what was kept, and whether anything was dropped."""
        return "".join(self._parts), self._dropped > 0


def _describe_in_solution(exc: BaseException) -> list[Any]:
    """An exception of the solution's as data: name, module, builtin bases, message, frames.

    Its ``__str__`` is solution code: a timer stops one that hangs.
    """

    def stop(signum: int, frame: Any) -> None:
        raise TimeoutError("describing the exception took too long")

    kind = type(exc)
    bases = [cls.__name__ for cls in kind.__mro__ if cls.__module__ == "builtins"]
    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        text = "".join(traceback.format_exception_only(kind, exc)).strip()
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == SOLUTION_FILE]
        where = "".join(traceback.format_list(frames[-3:])).rstrip()
    except BaseException:
        text, where = f"{kind.__name__} (its message could not be shown)", ""
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return [str(kind.__name__), str(kind.__module__), bases, text[:MAX_ERROR_CHARS], where[:MAX_ERROR_CHARS]]


def solution_main(read_fd: int, write_fd: int) -> None:
    """Serve the judge's requests until the pipe closes (runs in the solution process)."""
    pid = os.getpid()
    objects: dict[int, object] = {}
    pending = b""
    deferred: list[Any] | None = None  # the first error of a call whose result nobody waits for
    sys.stdout, sys.stderr = _Capture(DEFAULT_MAX_OUTPUT), _Capture(DEFAULT_MAX_OUTPUT)
    pristine = list(builtins.__dict__.items())
    own = builtins.__dict__

    def restore_builtins() -> None:  # this process's own code needs them; done before each reply
        for name, value in pristine:
            if own.get(name) is not value:
                own[name] = value

    def handle_of(value: object) -> list[Any]:
        objects[id(value)] = value
        return ["h", id(value), type(value).__name__]

    def resolve(node: list[Any]) -> object:
        return objects[node[1]]

    cache: dict[int, Any] = {}

    def run(request: list[Any]) -> Any:
        op = request[0].rstrip("!")
        if request[1] == "F":  # a call with plain arguments (see ``_Link._encode``)
            args = [objects[request[2]], *request[3:]]
        else:
            args = decode_value(request[1], resolve, cache)
        if op == "import":
            source, entry = args
            module = types.ModuleType("solution")
            module.__file__ = SOLUTION_FILE
            sys.modules["solution"] = sys.modules["__main__"] = module
            linecache.cache[SOLUTION_FILE] = (len(source), None, source.splitlines(True), SOLUTION_FILE)
            exec(compile(source, SOLUTION_FILE, "exec", dont_inherit=True), module.__dict__)
            return [module, module.__dict__.get(entry)]  # None: not defined (or defined as None)
        if op == "call":
            target, positional, keywords = args
            return target(*positional, **keywords)
        if op == "callm":
            target, name, positional, keywords = args
            return getattr(target, name)(*positional, **keywords)
        if op == "getattr":
            return getattr(*args)
        if op == "setattr":
            return setattr(*args)
        if op == "delattr":
            return delattr(*args)
        if op == "setitem":
            return operator.setitem(*args)
        if op == "delitem":
            return operator.delitem(*args)
        if op == "binop":
            return _BINARY[args[0]](*args[1:])
        if op == "unop":
            return _UNARY[args[0]](*args[1:])
        if op == "begin":
            sys.stdout, sys.stderr = _Capture(args[0]), _Capture(args[0])
            return None
        if op == "end":
            (stdout, stdout_cut), (stderr, stderr_cut) = sys.stdout.value(), sys.stderr.value()  # type: ignore[union-attr]
            return {"stdout": stdout, "stderr": stderr, "stdout_cut": stdout_cut, "stderr_cut": stderr_cut}
        raise ValueError(f"unknown request {op!r}")

    requests: list[Any] = []
    while True:
        while not requests:  # requests are length-prefixed marshal data (the judge's, so trusted here)
            restore_builtins()
            chunk = os.read(read_fd, 1 << 16)
            if not chunk:
                os._exit(0)
            pending += chunk
            start = 0
            while len(pending) - start >= 4:
                size = int.from_bytes(pending[start : start + 4], "big")
                if len(pending) - start - 4 < size:
                    break
                requests.append(marshal.loads(pending[start + 4 : start + 4 + size]))
                start += 4 + size
            pending = pending[start:]
            requests.reverse()
        request = requests.pop()
        wants_reply = not request[0].endswith("!")
        if not wants_reply and deferred is not None:
            continue  # an earlier call of this run of calls failed: the rest are skipped
        if wants_reply and deferred is not None:
            reply, deferred = deferred, None
        else:
            try:
                value = run(request)
                if wants_reply:
                    restore_builtins()
                reply = ["ok", encode_value(value, handle_of)] if wants_reply else None  # type: ignore[assignment]
            except BaseException as exc:  # the solution's failure is data, whatever it raised
                restore_builtins()
                reply = ["err", *_describe_in_solution(exc)]
                if not wants_reply:
                    deferred = reply
            if os.getpid() != pid:  # a fork the solution made: only the solution process answers
                os._exit(0)
        if reply is not None:
            restore_builtins()
            try:
                data = json.dumps(reply, separators=(",", ":")).encode() + b"\n"
            except (TypeError, ValueError) as exc:
                data = json.dumps(["err", "ValueError", "builtins", ["ValueError"], str(exc), ""]).encode()
                data += b"\n"
            _write_blocking(write_fd, data)


def _write_blocking(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class _Zygote:
    """The process that forks solution processes for the judge.

    The judge forks it before reading the spec, so neither it nor any process it forks holds a copy of
    the nonce; a solution process started after a failure comes from it too. It hands the judge each
    new process's pid and pipe ends (``SCM_RIGHTS``) and, asked, how a process ended.
    """

    def __init__(self, user: tuple[int, int] | None = None) -> None:
        """``user``: the uid and gid solution processes drop to (the warm judge's zygote runs as root)."""
        judge_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            try:
                judge_end.close()
                _zygote_main(zygote_end, user)
            finally:
                os._exit(0)
        zygote_end.close()
        self.pid, self.sock = pid, judge_end

    def spawn(self) -> tuple[int, int, int]:
        """A new solution process: its pid, the end to write requests to and the end to read replies."""
        self.sock.sendall(b"f")
        message, fds, _, _ = socket.recv_fds(self.sock, 16, 2)
        if len(message) == 16 and not fds and message.lstrip().startswith(b"E"):
            raise SpawnFailed(int(message.lstrip()[1:]), "no solution process could be started")
        if len(message) != 16 or len(fds) != 2:
            raise OSError("the harness's zygote process did not start a solution process")
        return int(message), fds[0], fds[1]

    def status(self, pid: int) -> int | None:
        """The wait status of solution process ``pid`` once it has ended (None if unknown)."""
        try:
            self.sock.sendall(b"w" + str(pid).encode().rjust(15))
            answer = self.sock.recv(16)
            return int(answer) if answer.strip(b" -") else None
        except (OSError, ValueError):
            return None

    def cleanup(self) -> float:
        """Kill every process of the solutions' user, reap them; the CPU seconds they used."""
        self.sock.sendall(b"k")
        answer = self.sock.recv(16)
        if len(answer) != 16:
            raise OSError("the harness's zygote process did not clean up")
        return float(answer)

    def close(self) -> None:
        """End the zygote (it exits when its socket closes)."""
        self.sock.close()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


class SpawnFailed(OSError):
    """The zygote could not fork a solution process (the sandbox's process limit is full); it lives on."""


def _zygote_main(sock: socket.socket, user: tuple[int, int] | None) -> None:
    import resource

    while True:
        command = sock.recv(1)
        if command == b"f":
            to_child_r, to_child_w = os.pipe()
            from_child_r, from_child_w = os.pipe()
            try:
                pid = os.fork()
            except OSError as exc:  # processes the solution left fill the limit: say so and live on
                for fd in (to_child_r, to_child_w, from_child_r, from_child_w):
                    os.close(fd)
                sock.sendall(f"E{exc.errno or 0}".encode().rjust(16))
                continue
            if pid == 0:
                try:
                    os.setpgid(0, 0)
                    null = os.open(os.devnull, os.O_RDWR)
                    for fd in (0, 1, 2):
                        os.dup2(null, fd)
                    for fd in _open_fds():
                        if fd not in (to_child_r, from_child_w, 0, 1, 2):
                            with contextlib.suppress(OSError):
                                os.close(fd)
                    signal.signal(signal.SIGINT, signal.SIG_DFL)
                    if user is not None:
                        _become(*user)
                    solution_main(to_child_r, from_child_w)
                finally:
                    os._exit(0)
            os.close(to_child_r)
            os.close(from_child_w)
            socket.send_fds(sock, [str(pid).encode().rjust(16)], [to_child_w, from_child_r])
            os.close(to_child_w)
            os.close(from_child_r)
        elif command == b"w":
            pid = int(sock.recv(15))
            try:
                _, status = os.waitpid(pid, 0)
                sock.sendall(str(status).encode().rjust(16))
            except ChildProcessError:
                sock.sendall(b"-".rjust(16))
        elif user is not None and command in (b"k", b""):
            _kill_every_process_of(user[0])
            with contextlib.suppress(ChildProcessError):
                while True:
                    os.waitpid(-1, 0)
            if not command:
                return  # the judge is gone (or killed at the tool's deadline): nothing of it is left
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)
            sock.sendall(f"{usage.ru_utime + usage.ru_stime:16.6f}".encode())
        else:
            return


def _kill_every_process_of(uid: int) -> None:
    """SIGKILL every process of the solutions' user ``uid``, from the zygote itself.

    kill(-1) with the user's real and effective uid reaches every process of that user, however it
    was started or moved (a fork racing it fails), and none of root's (the judge's real and saved
    uids are root's). It is sent from here, not from a child: a child cannot be forked while the
    user's processes fill the sandbox's process limit, nor count on memory they leave (the zygote
    lacks CAP_KILL, so it cannot signal them as root). The saved uid stays root's to come back.
    """
    os.setresuid(uid, uid, 0)
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:  # none was left
        pass
    finally:
        os.setresuid(0, 0, 0)


def _become(uid: int, gid: int) -> None:
    """Drop from root to ``uid``/``gid`` for good: no groups, no capabilities (bounding set included)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in range(64):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, until past the kernel's last one
            break
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)  # clears the permitted, effective and ambient capabilities
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:  # and the inheritable ones
        raise OSError(ctypes.get_errno(), "cannot clear capabilities")
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise OSError("still privileged after dropping")


def _open_fds() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, 256))


# --- the judge's side: proxies for the solution's objects ------------------------------------------
class SolutionFailed(Exception):
    """The solution process ended, ran past its time or broke the protocol (the test fails)."""


class _Link:
    """The judge's connection to one solution process."""

    def __init__(self, zygote: _Zygote, cores: list[int] | None = None) -> None:
        self.zygote = zygote
        self.pid, self.write_fd, self.read_fd = zygote.spawn()
        if cores:  # the warm judge's solution processes: on the action's cores (it waits for a request)
            with contextlib.suppress(OSError):
                os.sched_setaffinity(self.pid, cores)
        os.set_blocking(self.write_fd, False)
        self.buffer = bytearray()  # requests whose results nobody waits for, not yet written
        self.inbox = b""
        self.deadline = math.inf
        self.timed_out = False
        self.closed = False
        self.sent: dict[int, tuple[Any, int, Any]] = {}  # id -> (the value, its key, a copy as sent)

    def send(self, request: list[Any], wait: bool) -> Any:
        """Send ``request``; with ``wait``, return its decoded result or raise the solution's error."""
        if self.closed:
            raise SolutionFailed("the solution's process ended")
        message = self._encode(request)
        self.buffer += len(message).to_bytes(4, "big") + message
        if not wait and len(self.buffer) < 1 << 16:
            return None
        data, self.buffer = bytes(self.buffer), bytearray()
        if not _write_all(self.write_fd, data, self.deadline):
            self._time_out()
        if not wait:
            return None
        reply = self._receive()
        if type(reply) is not list or not reply or reply[0] not in ("ok", "err"):
            raise SolutionFailed("the solution process broke the harness's protocol")
        if reply[0] == "err":
            raise _remote_error(reply)
        try:
            return decode_value(reply[1], self._proxy)
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            raise SolutionFailed(f"the solution process sent data that cannot be read: {exc}") from None

    def _receive(self) -> Any:
        while b"\n" not in self.inbox:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self._time_out()
            ready, _, _ = select.select([self.read_fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(self.read_fd, 1 << 20)
            if not chunk:
                raise SolutionFailed(f"the solution's process ended{self._how_it_ended()}")
            self.inbox += chunk
            if len(self.inbox) > MAX_MESSAGE_BYTES:
                limit = MAX_MESSAGE_BYTES >> 20
                raise SolutionFailed(f"the solution sent more than {limit} MiB in one reply")
        line, _, self.inbox = self.inbox.partition(b"\n")
        try:
            return json.loads(line)
        except (ValueError, RecursionError):
            raise SolutionFailed("the solution process broke the harness's protocol") from None

    def _time_out(self) -> None:
        self.timed_out = True
        raise SolutionFailed("timed out")

    def _how_it_ended(self) -> str:
        self.kill()
        status = self.zygote.status(self.pid)
        if status is None:
            return ""
        if os.WIFSIGNALED(status):
            number = os.WTERMSIG(status)
            try:
                return f" (killed by {signal.Signals(number).name})"
            except ValueError:
                return f" (killed by signal {number})"
        return f" (exit status {os.WEXITSTATUS(status)})"

    def kill(self) -> None:
        """End the solution process and everything it started (once: its descriptors may be reused)."""
        if self.closed:
            return
        self.closed = True
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                kill(self.pid, signal.SIGKILL)
        for fd in (self.write_fd, self.read_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _encode(self, request: list[Any]) -> bytes:
        op, target = request[0], request[1] if len(request) > 1 else None
        if op in _CALLS and type(target) is _Remote and object.__getattribute__(target, "_link") is self:
            plain = {*map(type, request[-2]), *map(type, request[-1].values())} <= _JSON_SCALARS
            if plain:  # the usual call, f(1, "a"): one short message, no nodes
                handle = object.__getattribute__(target, "_handle")
                return marshal.dumps([op, "F", handle, *request[2:]])
        return marshal.dumps([op, encode_value(tuple(request[1:]), self._reference, self._big)])

    def _big(self, item: list[Any] | tuple[Any, ...]) -> list[Any] | None:
        """A long flat list or tuple of JSON scalars is sent once per process, then referred to by key
        while it stays equal to what was sent (tests that call the solution many times on one big input
        would otherwise spend their time copying it).
        """
        entry = self.sent.get(id(item))
        if entry is not None and entry[0] is item and len(entry[2]) == len(item) and entry[2] == item:
            return ["k", entry[1]]
        if not _flat(item):
            return None
        key = len(self.sent)
        self.sent[id(item)] = (item, key, type(item)(item))
        return ["K", key, [_TAGS[type(item)], list(item)]]

    def _reference(self, value: object) -> list[Any]:
        if type(value) is _Remote and object.__getattribute__(value, "_link") is self:
            return ["h", object.__getattribute__(value, "_handle")]
        raise TypeError(
            f"a test can pass only plain data and the solution's own objects to the solution, "
            f"not a {type(value).__name__}"
        )

    def _proxy(self, node: list[Any]) -> object:
        if len(node) != 3 or type(node[1]) is not int or type(node[2]) is not str:
            raise ValueError("a malformed handle")
        return _Remote(self, node[1], node[2][:200])


_REMOTE_CLASSES: dict[tuple[str, str, type], type[BaseException]] = {}


def _remote_error(reply: list[Any]) -> BaseException:
    """The judge's own exception standing for one raised in the solution process.

    Its class is built here, named as the solution's, under the nearest builtin exception class the
    solution's derives from (an ``Exception``: not even a ``SystemExit`` of the solution's ends the judge).
    """
    try:
        _, name, module, bases, text, where = reply
        name, module, text, where = str(name)[:200], str(module)[:200], str(text), str(where)
        bases = [str(b) for b in bases]
    except (TypeError, ValueError):
        return SolutionFailed("the solution process broke the harness's protocol")
    base: type = Exception
    for candidate in bases:
        found = getattr(builtins, candidate, None)
        if isinstance(found, type) and issubclass(found, Exception):
            base = found
            break
    key = (name, module, base)
    if key not in _REMOTE_CLASSES:
        cls = type(name if name.isidentifier() else "SolutionError", (base,), {"solution_text": ""})
        cls.__module__ = module if module in ("builtins", "solution") else "solution"
        _REMOTE_CLASSES[key] = cls
    message = text.partition(": ")[2] if ": " in text else ""
    error = _REMOTE_CLASSES[key](message)
    error.solution_text = text  # type: ignore[attr-defined]
    error.solution_frames = where  # type: ignore[attr-defined]
    return error


def _binary(name: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def forward(self: _Remote, other: object) -> Any:
        return self._link.send(["binop", name, self, other], True)

    def reflected(self: _Remote, other: object) -> Any:
        return self._link.send(["binop", name, other, self], True)

    return forward, reflected


def _unary(name: str) -> Callable[..., Any]:
    def forward(self: _Remote) -> Any:
        return self._link.send(["unop", name, self], True)

    return forward


class _Remote:
    """An object that lives in the solution process; every use is a request to it."""

    __slots__ = ("_handle", "_link", "_type")

    def __init__(self, link: _Link, handle: int, type_name: str) -> None:
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_handle", handle)
        object.__setattr__(self, "_type", type_name)

    def __getattr__(self, name: str) -> Any:
        return self._link.send(["getattr", self, name], True)

    def __setattr__(self, name: str, value: object) -> None:
        self._link.send(["setattr", self, name, value], True)

    def __delattr__(self, name: str) -> None:
        self._link.send(["delattr", self, name], True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._link.send(["call", self, list(args), kwargs], True)

    def __setitem__(self, key: object, value: object) -> None:
        self._link.send(["setitem", self, key, value], True)

    def __delitem__(self, key: object) -> None:
        self._link.send(["delitem", self, key], True)

    def __contains__(self, item: object) -> bool:
        return bool(self._link.send(["binop", "contains", self, item], True))

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __ne__(self, other: object) -> Any:
        return self._link.send(["binop", "ne", self, other], True)


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
              "lshift", "rshift", "divmod"):  # fmt: skip
    _forward, _reflected = _binary(_name)
    setattr(_Remote, f"__{_name}__", _forward)
    setattr(_Remote, f"__r{_name}__", _reflected)
for _name, _dunder in (("eq", "eq"), ("lt", "lt"), ("le", "le"), ("gt", "gt"), ("ge", "ge"),
                       ("getitem", "getitem")):  # fmt: skip
    setattr(_Remote, f"__{_dunder}__", _binary(_name)[0])
for _name in ("neg", "pos", "abs", "invert", "len", "hash", "bool", "repr", "str", "iter", "next", "int",
              "float", "index", "round"):  # fmt: skip
    setattr(_Remote, f"__{_name}__", _unary(_name))


# --- test code: compiled for the judge -------------------------------------------------------------
_OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
        ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}  # fmt: skip


class _Rewriter(ast.NodeTransformer):
    """Route a test's comparisons and calls through the helpers of :func:`test_helpers`.

    ``assert a OP b`` becomes ``__tg_check__(OP, a, b, text)`` (which explains a failure), any other
    single comparison ``__tg_compare__(OP, a, b)``; ``x.m(...)`` becomes one request
    (``__tg_method__``), and a call whose value is dropped, outside ``try``, is sent without waiting
    for its answer (``__tg_void__``: an error it raised fails the test at the next request).
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.in_try = 0

    def _call(self, helper: str, args: list[ast.expr], keywords: list[ast.keyword] | None = None) -> ast.Call:
        return ast.Call(func=ast.Name(id=helper, ctx=ast.Load()), args=args, keywords=keywords or [])

    def visit_Try(self, node: ast.Try) -> ast.AST:
        self.in_try += 1
        try:
            return self.generic_visit(node)
        finally:
            self.in_try -= 1

    visit_TryStar = visit_Try  # type: ignore[assignment]
    visit_With = visit_Try  # type: ignore[assignment]

    def visit_Expr(self, node: ast.Expr) -> ast.AST:
        if isinstance(node.value, ast.Call) and not self.in_try:
            call = node.value
            self.generic_visit(call)
            if isinstance(call.func, ast.Attribute):
                target = [call.func.value, ast.Constant(call.func.attr)]
            else:
                target = [call.func, ast.Constant(None)]
            node.value = self._call("__tg_void__", [*target, *call.args], call.keywords)
            return node
        return self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.func, ast.Attribute):
            args = [node.func.value, ast.Constant(node.func.attr), *node.args]
            return ast.copy_location(self._call("__tg_method__", args, node.keywords), node)
        return node

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


_COMPILED: dict[tuple[str, str], CodeType | str] = {}


def compile_test(name: str, code: str) -> CodeType | str:
    """Compile one test: its code object, or an error text when it does not compile (kept: a warm
    judge grades the same tests again and again).
    """
    known = _COMPILED.get((name, code))
    if known is not None:
        return known
    _COMPILED[name, code] = compiled = _compile_test(name, code)
    return compiled


def _compile_test(name: str, code: str) -> CodeType | str:
    filename = f"<test {name}>"
    try:
        tree = _Rewriter(code).visit(ast.parse(code, filename))
        compiled = compile(ast.fix_missing_locations(tree), filename, "exec", dont_inherit=True, optimize=0)
    except (SyntaxError, ValueError) as exc:
        return f"the test does not compile: {exc}"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    return compiled


_CONTAINERS = (list, tuple, set, frozenset, dict)
_PLAIN = (*_PLAIN_SCALARS, float, complex, bytes, *_CONTAINERS)
_CALLS = {"call", "call!", "callm", "callm!"}


def impure(value: object) -> str | None:
    """The type name of the first part of ``value`` that is not exact builtin data, or None."""
    stack: list[Any] = [value]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is _Remote:
            return str(object.__getattribute__(item, "_type"))
        if kind not in _PLAIN:
            return kind.__name__
        if kind in _CONTAINERS and id(item) not in seen:
            seen.add(id(item))
            stack.extend(item.items() if kind is dict else item)
    return None


def test_helpers(strict: bool) -> dict[str, Any]:
    """The names rewritten tests call (the judge's own: the solution never reaches them)."""
    ops: dict[str, Callable[[Any, Any], Any]] = {
        "==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
        ">=": operator.ge, "in": lambda a, b: a in b, "not in": lambda a, b: a not in b,
        "is": operator.is_, "is not": operator.is_not,
    }  # fmt: skip
    shorten = reprlib.Repr()
    shorten.maxstring = shorten.maxother = 160
    shorten.maxlist = shorten.maxtuple = shorten.maxset = shorten.maxfrozenset = shorten.maxdict = 12

    def compare(op: str, left: object, right: object) -> bool:
        if strict and op not in ("is", "is not"):
            left_bad, right_bad = impure(left), impure(right)
            one_sided = op in ("in", "not in")  # any element may be looked up in a custom container
            if (left_bad is not None and right_bad is None) or (
                not one_sided and right_bad is not None and left_bad is None
            ):
                raise TypeError(
                    f"strict test comparison: a {left_bad or right_bad} object compared with plain data "
                    "(tests compare plain data only with exact builtin types)"
                )
        return bool(ops[op](left, right))

    def show(value: object) -> str:
        bad = impure(value)
        if bad is None:
            return shorten.repr(value)
        try:
            text = repr(value)
        except Exception:
            text = "?"
        return f"{bad} object {text[:160]}"

    def check(op: str, left: object, right: object, text: str) -> None:
        if not compare(op, left, right):
            raise AssertionError(f"assert {text}\n  left:  {show(left)}\n  right: {show(right)}")

    def raises(expected: type[BaseException], fn: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except expected:
            return
        except SolutionFailed:
            raise
        except Exception as exc:
            raise AssertionError(f"expected {expected.__name__}, got {type(exc).__name__}") from exc
        raise AssertionError(f"expected {expected.__name__}, nothing was raised")

    def method(target: object, name: str, /, *args: Any, **kwargs: Any) -> Any:
        if type(target) is _Remote:
            link = object.__getattribute__(target, "_link")
            return link.send(["callm", target, name, list(args), kwargs], True)
        return getattr(target, name)(*args, **kwargs)

    def void(target: object, name: str | None, /, *args: Any, **kwargs: Any) -> None:
        if type(target) is _Remote:
            link = object.__getattribute__(target, "_link")
            if name is None:
                link.send(["call!", target, list(args), kwargs], False)
            else:
                link.send(["callm!", target, name, list(args), kwargs], False)
        elif name is None:
            target(*args, **kwargs)  # type: ignore[operator]
        else:
            getattr(target, name)(*args, **kwargs)

    return {"__tg_check__": check, "__tg_compare__": compare, "__tg_method__": method,
            "__tg_void__": void, "raises": raises}  # fmt: skip


# --- the run ---------------------------------------------------------------------------------------
def describe(exc: BaseException) -> str:
    """One exception as text: its message, then the innermost frames of the test and the solution."""
    text = getattr(exc, "solution_text", None) or "".join(traceback.format_exception_only(type(exc), exc))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith("<test ")]
    where = "".join(traceback.format_list(frames[-3:])).rstrip()
    remote = getattr(exc, "solution_frames", "")
    return "\n".join(part for part in (text.strip(), where, remote) if part)[:MAX_ERROR_CHARS]


class _Judge:
    """Runs the spec's tests against one solution process at a time (a new one after a failure)."""

    def __init__(self, spec: _Spec, zygote: _Zygote, cores: list[int] | None = None) -> None:
        self.spec = spec
        self.zygote = zygote
        self.cores = cores
        self.link = _Link(zygote, cores)
        self.entry: object = None
        self.module: object = None
        self.broken = False  # the process timed out, ended or broke the protocol: start another

    def load(self) -> tuple[str | None, dict[str, Any]]:
        """Import the solution in the current process: the import error (or None) and its output."""
        link, spec = self.link, self.spec
        link.deadline = time.monotonic() + spec.import_timeout_s
        output: dict[str, Any] = {}
        try:
            link.send(["begin!", spec.max_output_chars], False)
            try:
                self.module, self.entry = link.send(["import", spec.source, spec.entry_point], True)
            except SolutionFailed:
                raise
            except Exception:
                output = link.send(["end"], True)
                raise
            output = link.send(["end"], True)
        except SolutionFailed as exc:
            self.broken = True
            reason = f"ran past its time limit of {spec.import_timeout_s:g}s" if link.timed_out else str(exc)
            return f"importing the solution failed: {reason}", output
        except Exception as exc:
            return describe(exc), output
        name = spec.entry_point
        if self.entry is None:
            return f"the solution does not define {name!r}", output
        if type(self.entry) is not _Remote:
            return f"{name!r} is a {type(self.entry).__name__}, not a function or class", output
        try:
            ok = link.send(["unop", "callable", self.entry], True) is True
        except Exception:
            ok = False
        return (None if ok else f"{name!r} is not a function or class"), output

    def restart(self) -> str | None:
        """A fresh solution process with the solution imported; the import error, if any."""
        self.link.kill()
        try:
            self.link, self.broken = _Link(self.zygote, self.cores), False
        except SpawnFailed as exc:  # the solution's own processes fill the limit: its test fails
            why = os.strerror(exc.errno or 0)
            return f"{exc.strerror} ({why}: the solution's processes fill the sandbox)"
        return self.load()[0]

    def run_test(self, compiled: CodeType) -> tuple[str | None, float, dict[str, Any]]:
        """Run one test: its error (None: passed), duration and output."""
        link = self.link
        started = time.monotonic()
        link.deadline = started + self.spec.timeout_s
        namespace = {"__builtins__": builtins, "__name__": "__test__", self.spec.entry_point: self.entry,
                     "solution": self.module, **test_helpers(self.spec.strict)}  # fmt: skip
        sys.modules["solution"] = self.module  # type: ignore[assignment]  # ``from solution import X``
        error: str | None = None
        output: dict[str, Any] = {}
        try:
            link.send(["begin!", self.spec.max_output_chars], False)
            exec(compiled, namespace)
            output = link.send(["end"], True)  # also the answer of calls nobody waited for
        except SolutionFailed as exc:
            self.broken = True
            error = f"timed out after {self.spec.timeout_s:g}s" if link.timed_out else str(exc)
        except Exception as exc:
            error = describe(exc)
            try:
                output = link.send(["end"], True)
            except Exception:
                self.broken = True
        finally:
            sys.modules.pop("solution", None)
        return error, time.monotonic() - started, output


def run_spec(spec: _Spec, report: _Report, judge: _Judge) -> None:
    """Import the solution and run every test, recording each in ``report`` as it finishes."""
    import_error, output = judge.load()
    report.data["import_stdout"] = output.get("stdout", "")
    report.data["import_stderr"] = output.get("stderr", "")
    report.data["import_error"] = import_error
    report.data["stage"] = "tests"
    report.write()
    for name, code in spec.tests:
        if import_error is not None:
            report.add(name, "not run: the solution failed to import")
            continue
        compiled = compile_test(name, code)
        if isinstance(compiled, str):
            report.add(name, compiled)
            continue
        if judge.broken:
            restart_error = judge.restart()
            if restart_error is not None:
                report.add(name, f"not run: the solution could not be started again: {restart_error}")
                report.write()
                continue
        error, duration, output = judge.run_test(compiled)
        report.add(name, error, duration, judge.link.timed_out, output)
        report.write()
    judge.link.kill()


def _harden() -> None:
    """Make this process non-dumpable (Linux): no other process of this user can read its memory,
    environment or file descriptors, or ptrace it. Done before the spec, and its nonce, is read.
    """
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    with contextlib.suppress(Exception):
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _say(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, text.encode("utf-8", "replace"))


# --- the warm judge ------------------------------------------------------------------------------
def _frame(kind: bytes, payload: bytes) -> bytes:
    return kind + len(payload).to_bytes(4, "big") + payload


def _read_frame(sock: socket.socket) -> tuple[bytes, bytes] | None:
    head = _read_exactly(sock, 5)
    if head is None:
        return None
    body = _read_exactly(sock, int.from_bytes(head[1:], "big"))
    return None if body is None else (head[:1], body)


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def serve(path: str, uid: int, gid: int) -> int:
    """The warm judge: grade specs the tool sends over one connection, until it closes.

    Started as the sandbox's root (``as_root``) and kept in the background, it connects to the
    tool's socket at ``path`` (a listener outside the sandbox's pid namespace, else it refuses),
    forks its zygote (root, holding nothing secret yet), then keeps root as its real and saved uid
    with ``uid`` only as its effective one: it can signal the solution processes, which run as
    ``uid`` and can neither signal nor trace it. After each grading every process of ``uid`` is
    killed. This process then exits once the judge is ready, so that the exec that started it ends.
    """
    _harden()
    ready_r, ready_w = os.pipe()
    if os.fork() != 0:
        os.close(ready_w)
        return 0 if os.read(ready_r, 1) == b"1" else 1
    os.close(ready_r)
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the exec's pipes close with the launcher
        os.dup2(null, fd)
    os.close(null)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as a fresh harness has it, for solution processes
    zygote = _Zygote(user=(uid, gid))  # first: it holds neither the connection nor anything sent on it
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):  # the judge's own: no stray signal ends it
        signal.signal(sig, signal.SIG_IGN)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        peer_pid, peer_uid = int.from_bytes(creds[:4], "little"), int.from_bytes(creds[4:8], "little")
        if peer_pid != 0 or peer_uid != 0:  # a listener inside the sandbox: not the tool's
            return 1
        os.setresgid(0, gid, 0)
        os.setresuid(0, uid, 0)
        os.write(ready_w, b"1")
        os.close(ready_w)
        used = 0.0
        while (request := _read_frame(sock)) is not None:
            used = _grade(sock, json.loads(request[1]), zygote, used)
    finally:
        with contextlib.suppress(OSError):
            zygote.cleanup()
        zygote.close()
    return 0


def _grade(sock: socket.socket, request: dict[str, Any], zygote: _Zygote, used: float) -> float:
    """One grading: every signed report to the tool as it is made, then the CPU seconds it took."""
    started = time.process_time()
    try:
        spec = check_spec(request["spec"])
    except (SpecError, KeyError) as exc:
        sock.sendall(_frame(b"E", str(exc).encode()))
        return used
    cores = request.get("cores") or None
    if cores:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cores)
    report = _Report(spec.nonce, "", send=lambda data: sock.sendall(_frame(b"R", data)))
    try:
        judge = _Judge(spec, zygote, cores)
        report.write()
        run_spec(spec, report, judge)
        report.data["stage"] = "done"
    except OSError:
        raise  # the zygote or the connection is gone: this judge is done
    except BaseException:
        report.data["stage"] = "aborted"
        report.data["harness_error"] = traceback.format_exc()[-MAX_ERROR_CHARS:]
    report.write()
    total = zygote.cleanup()  # before the tool hears the end: nothing of this grading is left
    cpu = time.process_time() - started + total - used
    sock.sendall(_frame(b"D", f"{cpu:.6f}".encode()))
    return total


def main(argv: list[str]) -> int:
    """Run the spec at ``argv[1]``, writing the report to ``argv[2]``; returns the exit status."""
    if len(argv) == 5 and argv[1] == "--serve":
        return serve(argv[2], int(argv[3]), int(argv[4]))
    if len(argv) != 3:
        _say(USAGE)
        return 2
    _harden()
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    zygote = _Zygote()  # forked before the secret is read: no solution process can have a copy of it
    try:
        spec = load_spec(argv[1])
    except SpecError as exc:
        zygote.close()
        _say(f"harness: {exc}\n")
        return 2
    judge = _Judge(spec, zygote)
    report = _Report(spec.nonce, os.path.abspath(argv[2]))
    try:
        report.write()
    except OSError as exc:
        judge.link.kill()
        _say(f"harness: cannot write the report: {exc}\n")
        return 1
    if argv[1] != "-":
        with contextlib.suppress(OSError):
            os.unlink(argv[1])
    try:
        run_spec(spec, report, judge)
        report.data["stage"] = "done"
    except BaseException:  # a bug of the harness's own: say so in the report
        report.data["stage"] = "aborted"
        report.data["harness_error"] = traceback.format_exc()[-MAX_ERROR_CHARS:]
    try:
        report.write()
    except OSError:
        return 1
    return 0


if __name__ == "__main__":
    os._exit(main(sys.argv))
