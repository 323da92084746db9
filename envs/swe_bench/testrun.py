"""Runs a list of pytest node ids in shards, in parallel, and reports each shard's per-test outcomes.

It runs inside a sandbox with the instance's interpreter (``python testrun.py SPEC OUT``; OUT ``-``:
stdout), so it uses the standard library only. SPEC is JSON: ``tests`` (node ids), ``shards``,
``pytest_args``, ``env``, ``timeout_s``, ``plugin_dir`` (where ``tangram_swe_report.py`` lies),
``trace_root`` (optional), ``plant`` (``{path: source}``: files written before the run and removed after
it), ``insert`` (``{path: source}``: functions inserted at a random place among the top-level
statements of an existing test file for the run, then taken out; see ``canaries.py``),
``every_shard`` (node ids every shard runs first: the planted tests) and ``legacy_runner``
(start pytest as ``python -m pytest``, the repository importable first: for comparisons only). OUT gets
``{"shards": [{returncode, timed_out, tail, "tests": {nodeid: {status, message[, calls]}}}],
"wall_s"}``.

It is a runner, not a judge: the agent's code runs in the processes it starts and can change anything
it writes, so the grader reads OUT back as untrusted data (see ``verdict.py``). Each pytest process
imports pytest and the report plugin before the repository is on ``sys.path``, so files in the
repository cannot stand in for them.

That code runs as the runner's user, so it can signal the runner: every signal a process can catch
and that would end or stop it is caught and does nothing (the run goes on and the report is written).
Just before the first test process starts, the runner prints :data:`STARTED` to stderr: a runner
that dies after that line (SIGKILL cannot be caught) died while the code under test was running,
which the grader counts against the patch; one that dies before it never ran that code.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from typing import Any

_TAIL = 4000
#: Printed to stderr when the tests start (see the module docstring).
STARTED = "tangram-testrun: starting the tests"
#: Signals that are not caught: SIGKILL and SIGSTOP cannot be; faults a handler would return into
#: (SEGV, BUS, FPE, ILL, SYS, TRAP); SIGXCPU and SIGXFSZ, the sandbox's own limits; and those whose
#: default is to do nothing.
_UNCAUGHT = {
    getattr(signal, name)
    for name in (
        "SIGKILL",
        "SIGSTOP",
        "SIGSEGV",
        "SIGBUS",
        "SIGFPE",
        "SIGILL",
        "SIGSYS",
        "SIGTRAP",
        "SIGXCPU",
        "SIGXFSZ",
        "SIGCHLD",
        "SIGCONT",
        "SIGURG",
        "SIGWINCH",
    )
    if hasattr(signal, name)
}
#: Imports pytest and the plugin with the repository off ``sys.path``, then puts it back and runs.
_BOOT = (
    "import os, sys\n"
    "sys.path[:] = [p for p in sys.path if p not in ('', os.getcwd())]\n"
    "import pytest, tangram_swe_report\n"
    "repo = [p for p in os.environ.pop('TANGRAM_SWE_PYTHONPATH', '').split(os.pathsep) if p]\n"
    "sys.path[:0] = [os.getcwd()] + repo\n"
    "os.environ['PYTHONPATH'] = os.pathsep.join(repo + [os.environ.get('PYTHONPATH', '')])\n"
    "sys.exit(pytest.main(sys.argv[1:], plugins=[tangram_swe_report]))\n"
)


def split_shards(tests: list[str], shards: int) -> list[list[str]]:
    """Contiguous runs of whole test files, balanced by test count (files share module fixtures)."""
    shards = max(1, min(shards, len(tests)))
    by_file: dict[str, list[str]] = {}
    for t in tests:
        by_file.setdefault(t.split("::", 1)[0], []).append(t)
    groups = sorted(by_file.values(), key=len, reverse=True)
    out: list[list[str]] = [[] for _ in range(shards)]
    for group in groups:  # largest first onto the lightest shard; split a file only if it dominates
        if len(group) > len(tests) / shards and shards > 1:
            for t in group:
                min(out, key=len).append(t)
        else:
            min(out, key=len).extend(group)
    return [s for s in out if s]


def _shield(received: list[str]) -> None:
    """Catch every signal that would end or stop the runner, noting each in ``received``.

    A handler (unlike ``SIG_IGN``) is reset to the default by ``exec``: the test processes get the
    dispositions they would anywhere else.
    """

    def note(signum: int, _frame: object) -> None:
        if len(received) < 20:  # real-time signals past SIGRTMIN have no name in ``signal.Signals``
            names = {s.value: s.name for s in signal.Signals}
            received.append(names.get(signum, f"signal {signum}"))

    for sig in signal.valid_signals():
        if sig not in _UNCAUGHT:
            try:
                signal.signal(sig, note)
            except (OSError, ValueError):
                continue  # one this platform keeps for itself


def _plant(files: dict[str, str]) -> None:
    for path, source in files.items():
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(source)


def _insert(path: str, source: str) -> bytes | None:
    """Insert the functions ``source`` defines at a random place among the top-level statements of
    the existing test file ``path`` (never before a ``__future__`` import, never splitting a
    statement); return the file's bytes as they were, to put back. Nothing is inserted (None) into a
    file that is missing, not a regular file, not UTF-8 Python, or that already defines one of the
    names: the grader then finds those tests missing, which it excuses.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return None
            original = fh.read()
        text = original.decode("utf-8")
        body = ast.parse(text).body
    except (OSError, ValueError, SyntaxError):
        return None
    ours = {node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
    if any(name in ours for top in body for node in ast.walk(top) for name in _bound_names(node)):
        return None
    future = [i for i, n in enumerate(body) if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
    first = future[-1] + 1 if future else 1
    # A place before one of the statements after the first (a decorated one starts at its first
    # decorator), or the end of the file.
    starts = [min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) for node in body]
    lines = text.splitlines(keepends=True)
    places = [start - 1 for start in starts[first:]] + [len(lines)]
    at = random.SystemRandom().choice(places)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    lines[at:at] = ["\n\n", source, "\n\n"]
    with open(path, "wb") as fh:
        fh.write("".join(lines).encode("utf-8"))
    return original


def _bound_names(node: ast.AST) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.alias):
        return [(node.asname or node.name).split(".")[0]]
    return []


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="tangram-swe-run-")
    planted = dict(spec.get("plant") or {})
    originals: dict[str, bytes] = {}
    try:
        _plant(planted)
        for path, source in (spec.get("insert") or {}).items():
            original = _insert(path, source)
            if original is not None:
                originals[path] = original
        return _run_in(spec, work)
    finally:
        for path in planted:
            if os.path.isfile(path) and not os.path.islink(path):
                os.remove(path)
        for path, original in originals.items():
            with contextlib.suppress(OSError):  # the tests may have made it a link: put a file back
                if os.path.islink(path) or not os.path.isfile(path):
                    os.remove(path)
                with open(path, "wb") as fh:
                    fh.write(original)
        shutil.rmtree(work, ignore_errors=True)


def _run_in(spec: dict[str, Any], work: str) -> dict[str, Any]:
    tests: list[str] = list(spec["tests"])
    every: list[str] = list(spec.get("every_shard") or [])
    env = dict(os.environ)
    env.update(spec.get("env") or {})
    if spec.get("legacy_runner"):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (spec["plugin_dir"], env.get("PYTHONPATH")) if p)
    else:
        env["TANGRAM_SWE_PYTHONPATH"] = env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = spec["plugin_dir"]
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    if spec.get("trace_root"):
        env["TANGRAM_SWE_TRACE"] = spec["trace_root"]
    procs = []
    sys.stderr.write(STARTED + "\n")
    sys.stderr.flush()
    started = time.monotonic()
    for i, shard in enumerate(split_shards(tests, int(spec.get("shards") or 1))):
        shard = [*every, *shard]  # first: a shard cut short after real tests ran has run these
        report = os.path.join(work, f"shard{i}.jsonl")
        select = os.path.join(work, f"shard{i}.select.json")
        with open(select, "w", encoding="utf-8") as fh:
            json.dump(shard, fh)
        # Files on the command line, tests picked by the plugin: a test id that no longer exists is
        # not run, instead of making pytest refuse the whole command; a missing file is left out.
        files = [f for f in dict.fromkeys(t.split("::", 1)[0] for t in shard) if os.path.exists(f)]
        log = open(os.path.join(work, f"shard{i}.log"), "wb")  # noqa: SIM115 - closed below
        start = ["-m", "pytest", "-p", "tangram_swe_report"] if spec.get("legacy_runner") else ["-c", _BOOT]
        cmd = [
            sys.executable,
            *start,
            "-p",
            "no:cacheprovider",
            "-q",
            "--continue-on-collection-errors",
            *spec.get("pytest_args", []),
            "--",
            *files,
        ]
        shard_env = dict(env, TANGRAM_SWE_REPORT=report, TANGRAM_SWE_SELECT=select)
        if not files:
            log.close()
            continue
        # No pinning per shard: the whole run is already held to the granted cores, and the kernel
        # spreads the shards' processes over them.
        procs.append(
            (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=shard_env), report, log)
        )
    deadline = started + float(spec.get("timeout_s") or 600)
    shards_out = []
    for proc, report, log in procs:
        timed_out = False
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            timed_out = True
        log.close()
        with open(log.name, "rb") as fh:
            tail = fh.read()[-_TAIL:].decode("utf-8", "replace")
        results: dict[str, Any] = {}
        if os.path.exists(report):
            with open(report, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    try:
                        record = json.loads(line)
                        results[record.pop("nodeid")] = record
                    except (ValueError, KeyError, TypeError, AttributeError):
                        continue  # a line cut short by a kill (the grader judges what is left)
        shards_out.append(
            {"returncode": proc.returncode, "timed_out": timed_out, "tail": tail, "tests": results}
        )
    return {"shards": shards_out, "wall_s": time.monotonic() - started}


def main(argv: list[str]) -> int:
    """``testrun.py SPEC_JSON OUT_JSON``: run the spec's tests and write the merged report (OUT ``-``:
    to stdout).
    """
    if len(argv) != 2:
        print("usage: testrun.py SPEC_JSON OUT_JSON", file=sys.stderr)
        return 2
    received: list[str] = []
    _shield(received)
    with open(argv[0], encoding="utf-8") as fh:
        spec = json.load(fh)
    with contextlib.suppress(OSError):  # it names the planted tests: the tests must not read it
        os.remove(argv[0])
    out = _run(spec)
    if argv[1] == "-":
        json.dump(out, sys.stdout)
        sys.stdout.flush()
    else:
        with open(argv[1], "w", encoding="utf-8") as fh:
            json.dump(out, fh)
    if received:
        print(f"tangram-testrun: ignored {', '.join(received)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
