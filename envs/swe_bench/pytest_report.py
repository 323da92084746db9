"""A pytest plugin that runs inside a sandbox: it writes one JSON line per test with its outcome.

Loaded by the runner as ``tangram_swe_report`` (the file is copied into the sandbox under that name),
before the repository is importable, it works with whatever pytest the instance's environment has.
``TANGRAM_SWE_REPORT`` names the output file.
``TANGRAM_SWE_SELECT`` names a JSON list of node ids (or file paths) to run out of what the command
line collected: a test id that does not exist is then simply not run (and so counts as failed)
instead of stopping the whole run. With ``TANGRAM_SWE_TRACE`` set to a directory it also records which
functions under that directory each test called (prepare uses that to find the functions whose
mutations some test can see).

Statuses are SWE-bench's (``PASSED``, ``FAILED``, ``SKIPPED``, ``ERROR``, ``XFAIL``) and ``XPASS``
for an expected failure that passed (pytest calls it passed; SWE-bench's log parser does not count
it as a pass). A selected id cut short inside its parameters (more ``[`` than ``]``) selects the
tests it is a prefix of.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

_MESSAGE_CAP = 2000


class _Tracer:
    """Collects the code objects a test calls: a trace function that answers only ``call`` events
    (it returns None, so no line events follow, and C calls never reach it).
    """

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root) + os.sep
        self.codes: set[Any] = set()
        self.paths: dict[str, str | None] = {}  # file name -> path under root (None: outside)

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        self.codes.add(frame.f_code)

    def start(self) -> None:
        self.codes = set()
        sys.settrace(self.hook)
        threading.settrace(self.hook)

    def stop(self) -> list[list[Any]]:
        sys.settrace(None)
        threading.settrace(None)
        out = []
        for code in self.codes:
            name = code.co_filename
            if name not in self.paths:
                real = os.path.realpath(name)
                self.paths[name] = real[len(self.root) :] if real.startswith(self.root) else None
            rel = self.paths[name]
            if rel is not None:
                out.append([rel, code.co_firstlineno, code.co_name])
        return sorted(out)


class _Recorder:
    def __init__(self, path: str, trace_root: str | None) -> None:
        self.out = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the whole session
        self.tracer = _Tracer(trace_root) if trace_root else None
        self.phases: dict[str, dict[str, Any]] = {}

    def logreport(self, report: Any) -> None:
        entry = self.phases.setdefault(report.nodeid, {"status": None, "message": ""})
        failed = report.outcome == "failed"
        if report.when == "call":
            if hasattr(report, "wasxfail"):
                entry["status"] = (
                    "XFAIL" if report.outcome == "skipped" else ("FAILED" if failed else "XPASS")
                )
            else:
                entry["status"] = {"passed": "PASSED", "failed": "FAILED", "skipped": "SKIPPED"}[
                    report.outcome
                ]
        elif failed:  # a failing setup or teardown is an error, whatever the call did
            entry["status"] = "ERROR"
        elif report.outcome == "skipped" and entry["status"] is None:
            entry["status"] = "XFAIL" if hasattr(report, "wasxfail") else "SKIPPED"
        if failed and not entry["message"]:
            entry["message"] = _crash_message(report)

    def finish(self, nodeid: str, calls: list[list[Any]] | None) -> None:
        entry = self.phases.pop(nodeid, {"status": None, "message": ""})
        record: dict[str, Any] = {
            "nodeid": nodeid,
            "status": entry["status"] or "ERROR",
            "message": entry["message"],
        }
        if calls is not None:
            record["calls"] = calls
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()  # written per test: a run that dies still reports what it finished


def _crash_message(report: Any) -> str:
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    text = getattr(crash, "message", None) or str(getattr(report, "longrepr", "") or "")
    return text[:_MESSAGE_CAP]


_recorder: _Recorder | None = None


def pytest_configure(config: Any) -> None:
    """Open the report file named by ``TANGRAM_SWE_REPORT`` (no file: the plugin does nothing)."""
    global _recorder
    path = os.environ.get("TANGRAM_SWE_REPORT")
    if path and _recorder is None:
        _recorder = _Recorder(path, os.environ.get("TANGRAM_SWE_TRACE") or None)


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    """Keep only the tests named in ``TANGRAM_SWE_SELECT`` (if set)."""
    path = os.environ.get("TANGRAM_SWE_SELECT")
    if not path:
        return
    with open(path, encoding="utf-8") as fh:
        wanted = set(json.load(fh))
    paths = tuple(w.rstrip("/") for w in wanted if "::" not in w)  # whole files or directories
    cut = tuple(w for w in wanted if w.count("[") > w.count("]"))  # ids cut short in their parameters
    keep: list[Any] = []
    drop: list[Any] = []
    for item in items:
        where = item.nodeid.split("::", 1)[0]
        chosen = (
            item.nodeid in wanted
            or any(where == p or where.startswith(p + "/") for p in paths)
            or item.nodeid.startswith(cut)
        )
        (keep if chosen else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_runtest_logreport(report: Any) -> None:
    """Fold each phase's outcome into the test's status."""
    if _recorder is not None:
        _recorder.logreport(report)


def _protocol(item: Any) -> Any:
    rec = _recorder
    if rec is None:
        yield
        return
    if rec.tracer is not None:
        rec.tracer.start()
    try:
        yield
    finally:
        calls = rec.tracer.stop() if rec.tracer is not None else None
        rec.finish(item.nodeid, calls)


def _hookwrapper(fn: Any) -> Any:
    try:
        import pytest

        return pytest.hookimpl(hookwrapper=True)(fn)
    except (ImportError, AttributeError):  # very old pytest: the attribute form
        fn.hookwrapper = True
        return fn


pytest_runtest_protocol = _hookwrapper(_protocol)


def pytest_unconfigure(config: Any) -> None:
    """Close the report file."""
    global _recorder
    if _recorder is not None:
        _recorder.out.close()
        _recorder = None
