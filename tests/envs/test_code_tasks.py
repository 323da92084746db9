"""The code env's task set and its test harness, run as a real subprocess (``python -I harness.py``)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tangram_env.envs.code_tasks import (
    CodeTask,
    CodeTest,
    HarnessReport,
    HarnessSpec,
    TaskDataError,
    get_task,
    harness_source,
    load_tasks,
    parse_tasks,
    read_report,
    read_tasks,
    task_ids,
)
from tangram_env.envs.code_tasks import harness as harness_module
from tangram_env.envs.code_tasks.local import run_unsandboxed
from tangram_env.errors import TangramError, UnknownNameError
from tangram_env.sandbox import ExecResult

HARNESS = Path(harness_module.__file__)
#: The ``run_harness`` fixture of conftest.py: ``(source, tests=..., **spec_fields)`` to
#: ``(report, process, spec)``.
RunHarness = Callable[..., tuple[HarnessReport, "subprocess.CompletedProcess[bytes]", HarnessSpec]]


def outcomes(report: HarnessReport) -> dict[str, bool]:
    return {test.name: test.passed for test in report.tests}


# --- the task set ----------------------------------------------------------------------------------
def test_task_set_is_large_varied_and_valid() -> None:
    tasks = load_tasks()
    assert len(tasks) >= 24
    assert len({task.id for task in tasks}) == len(tasks)
    assert all(5 <= len(task.tests) <= 10 for task in tasks)
    assert {task.difficulty for task in tasks} == {"easy", "medium", "hard"}
    topics = {tag for task in tasks for tag in task.tags}
    assert {"strings", "lists", "dicts", "math", "parsing", "recursion", "algorithms", "classes"} <= topics
    assert sum(task.kind == "class" for task in tasks) >= 3
    assert task_ids() == [task.id for task in tasks]


@pytest.mark.parametrize("task", load_tasks(), ids=lambda task: task.id)
def test_signature_matches_reference_solution(task: CodeTask) -> None:
    signature = ast.parse(task.signature + ("\n    ..." if task.kind == "function" else "")).body[0]
    defined = {node.name: node for node in ast.parse(task.reference_solution).body if hasattr(node, "name")}
    assert isinstance(signature, ast.FunctionDef | ast.ClassDef)
    assert signature.name == task.entry_point
    assert task.entry_point in defined
    if isinstance(signature, ast.FunctionDef):
        reference = defined[task.entry_point]
        assert isinstance(reference, ast.FunctionDef)
        assert [a.arg for a in reference.args.args] == [a.arg for a in signature.args.args]


def test_load_tasks_is_cached_but_returns_a_fresh_list() -> None:
    first, second = load_tasks(), load_tasks()
    assert first == second and first is not second
    first.clear()
    assert load_tasks() == second
    assert all(a is b for a, b in zip(load_tasks(), second, strict=True))


def test_get_task_and_did_you_mean() -> None:
    assert get_task("run-length-encode").entry_point == "run_length_encode"
    with pytest.raises(UnknownNameError, match="did you mean 'run-length-encode'") as caught:
        get_task("run-length-encod")
    assert isinstance(caught.value, KeyError)
    with pytest.raises(KeyError, match=r"no code task named 'zzzzzz'$"):
        get_task("zzzzzz")


def _task_dict(**changes: object) -> dict[str, object]:
    base = get_task("digital-root").model_dump(mode="json")
    base.update(changes)
    return base


ONLY_AN_ERROR_CASE = {"name": "t", "code": "raises(ValueError, digital_root, -1)", "error_case": True}


@pytest.mark.parametrize(
    ("tasks", "message"),
    [
        ([_task_dict(), _task_dict()], "task ids must be unique"),
        ([_task_dict(tests=[{"name": "t", "code": "pass"}] * 2)], "test names must be unique"),
        ([_task_dict(entry_point="other")], "signature must start with"),
        ([_task_dict(id="Not A Slug")], "id"),
        ([_task_dict(difficulty="trivial")], "difficulty"),
        ([_task_dict(tests=[])], "tests"),
        ([_task_dict(tests=[ONLY_AN_ERROR_CASE])], "needs at least one test that is not an error_case"),
    ],
)
def test_bad_task_data_is_a_typed_error(tasks: list[dict[str, object]], message: str) -> None:
    with pytest.raises(TaskDataError, match=message) as caught:
        parse_tasks(json.dumps({"version": 1, "tasks": tasks}))
    assert isinstance(caught.value, TangramError) and isinstance(caught.value, ValueError)


def test_read_tasks_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"version": 1, "tasks": [_task_dict(id="mine")]}))
    assert [task.id for task in read_tasks(path)] == ["mine"]
    path.write_text("{not json")
    with pytest.raises(TaskDataError, match="not JSON"):
        read_tasks(path)
    with pytest.raises(TaskDataError, match="cannot read"):
        read_tasks(tmp_path / "missing.json")


def test_harness_is_standard_library_only() -> None:
    tree = ast.parse(harness_source())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}  # fmt: skip
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}  # fmt: skip
    assert imported - {"__future__"} <= set(sys.stdlib_module_names)


def test_error_case_tests_are_marked_and_every_task_has_an_ordinary_test() -> None:
    # An error-case test counts only once an ordinary test passes: one left unmarked would pay a
    # solution that only raises again.
    for task in load_tasks():
        for test in task.tests:
            assert test.error_case == ("raises(" in test.code), (task.id, test.name)
        assert any(not test.error_case for test in task.tests), task.id


UNEARNED = "error-case tests count only once one of the task's ordinary tests passes"


def _refuses_everything(task: CodeTask, exc: str) -> str:
    if task.kind == "class":
        return f"class {task.entry_point}:\n    def __init__(self, *a, **k):\n        raise {exc}('no')\n"
    return f"def {task.entry_point}(*a, **k):\n    raise {exc}('no')\n"


def test_a_solution_that_only_raises_earns_nothing() -> None:
    # Raising ValueError on every call passed each raises(ValueError, f, bad_input) test: 15 of 32
    # tasks paid for no work at all (a mean reward of 0.101 over the task set).
    jobs = [
        (task.id, exc, HarnessSpec.for_task(task, _refuses_everything(task, exc), timeout_s=10.0))
        for task in load_tasks()
        for exc in sorted({m for t in task.tests for m in re.findall(r"raises\((\w+),", t.code)})
    ]
    assert len({task_id for task_id, _, _ in jobs}) >= 15  # half the tasks test a refusal
    with ThreadPoolExecutor(max_workers=2) as pool:
        reports = list(pool.map(lambda job: run_unsandboxed(job[2]), jobs))
    paid = {(task_id, exc): r.passed for (task_id, exc, _), r in zip(jobs, reports, strict=True) if r.passed}
    assert paid == {}
    assert any(UNEARNED in (t.error or "") for r in reports for t in r.tests)  # they did raise


def test_error_cases_count_once_an_ordinary_test_passes(run_harness: RunHarness) -> None:
    tests = [
        CodeTest(name="one", code="assert f(1) == 1"),
        CodeTest(name="two", code="assert f(2) == 2"),
        CodeTest(name="refuses", code="raises(ValueError, f, -1)", error_case=True),
    ]
    refusing, _, _ = run_harness("def f(x):\n    raise ValueError(x)\n", tests=tests)
    assert outcomes(refusing) == {"one": False, "two": False, "refuses": False} and refusing.fraction == 0.0
    assert UNEARNED in (refusing.tests[2].error or "")
    partial, _, _ = run_harness("def f(x):\n    if x < 0: raise ValueError(x)\n    return 1\n", tests=tests)
    assert outcomes(partial) == {"one": True, "two": False, "refuses": True}  # scored as before
    right, _, _ = run_harness("def f(x):\n    if x < 0: raise ValueError(x)\n    return x\n", tests=tests)
    assert right.fraction == 1.0


# --- every task through the harness ----------------------------------------------------------------
@pytest.mark.parametrize("task_id", task_ids())
def test_reference_solution_passes_every_test(
    graded: dict[str, dict[str, HarnessReport]], task_id: str
) -> None:
    report = graded[task_id]["reference"]
    failures = {test.name: test.error for test in report.tests if not test.passed}
    assert failures == {}
    assert report.stage == "done" and report.problem is None and report.import_error is None
    assert report.fraction == 1.0 and report.total == len(get_task(task_id).tests)


@pytest.mark.parametrize("task_id", task_ids())
def test_wrong_solutions_fail(graded: dict[str, dict[str, HarnessReport]], task_id: str) -> None:
    # A function that returns None passes no test: "the input is left unchanged" passed for it (the
    # solution only ever sees a copy) and unlocked the error cases, 0.019 of a reward on average
    # (audit). What any object does (being unequal to a tuple) is the one test it may pass.
    passed = {test.name for test in graded[task_id]["none"].tests if test.passed}
    assert passed <= ({"other_types_unequal"} if task_id == "vector2" else set()), passed
    # Every test calls the entry point: a stub that raises fails all of them.
    raising = graded[task_id]["raising"]
    assert raising.passed == 0 and raising.stage == "done"
    assert all("NotImplementedError" in (test.error or "") for test in raising.tests)


def test_ordinary_python_works_under_the_harness(run_harness: RunHarness) -> None:
    source = """
        from __future__ import annotations
        import collections, dataclasses, logging, sys, threading, typing
        @dataclasses.dataclass(frozen=True)
        class Point:
            x: int
        Pair = collections.namedtuple("Pair", "a b")
        class Typed(typing.NamedTuple):
            a: int
        def depth(n):
            return 0 if n == 0 else 1 + depth(n - 1)
        def f(x):
            logging.getLogger("solution").warning("careful")
            box = []
            worker = threading.Thread(target=box.append, args=(x,))
            worker.start()
            worker.join()
            try:
                input()
            except EOFError:
                pass
            return Point(box[0]).x + Pair(0, 0).a + Typed(0).a + depth(900) - 900
        if __name__ == "__main__":
            raise SystemExit("the solution is imported, not run as a script")
    """
    tests = [
        CodeTest(name="a", code="assert f(1) == 1"),
        CodeTest(name="module", code="from solution import Point\nassert Point(2).x == 2"),
    ]
    report, _, _ = run_harness(source, tests=tests)
    assert report.import_error is None
    assert outcomes(report) == {"a": True, "module": True}
    assert "careful" in report.tests[0].stderr


def test_a_long_list_sent_once_arrives_unchanged_at_every_call(run_harness: RunHarness) -> None:
    source = """
        def f(items):
            total = sum(items)
            items.append(-1)  # its own copy: the next call still gets what the test sent
            items[0] = 10**9
            return total
    """
    tests = [
        CodeTest(name="a", code="xs = list(range(5000))\nfor _ in range(5):\n    assert f(xs) == 12497500"),
        CodeTest(name="changed", code="xs = list(range(5000))\nf(xs)\nxs[1] = 0\nassert f(xs) == 12497499"),
    ]
    report, _, _ = run_harness(source, tests=tests)
    assert outcomes(report) == {"a": True, "changed": True}, report


# --- hostile solutions -----------------------------------------------------------------------------
def test_a_looping_test_times_out_and_the_others_still_run(run_harness: RunHarness) -> None:
    source = """
        def f(x):
            while x == 2:
                pass
            return x
    """
    report, done, _ = run_harness(source, timeout_s=0.5)
    assert done.returncode == 0
    assert outcomes(report) == {"a": True, "b": False, "c": True}
    assert report.tests[1].timed_out and report.tests[1].error == "timed out after 0.5s"
    assert report.stage == "done" and report.problem is None


def test_a_loop_that_swallows_every_signal_is_killed_and_the_next_test_gets_a_fresh_process(
    run_harness: RunHarness,
) -> None:
    source = """
        import signal, time
        def f(x):
            while x == 2:
                try:
                    for sig in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT):
                        signal.signal(sig, signal.SIG_IGN)
                    time.sleep(0.01)
                except BaseException:
                    pass
            return x
    """
    report, done, _ = run_harness(source, timeout_s=0.5)
    assert done.returncode == 0
    assert outcomes(report) == {"a": True, "b": False, "c": True}
    assert report.tests[1].timed_out and report.tests[1].error == "timed out after 0.5s"
    assert report.stage == "done" and report.problem is None


def test_a_loop_that_never_returns_to_python_is_killed(run_harness: RunHarness) -> None:
    source = """
        def f(x):
            if x == 2:
                sum(range(10 ** 13))  # one C call: no signal handler or thread of its own gets to run
            return x
    """
    report, done, _ = run_harness(source, timeout_s=0.5)
    assert done.returncode == 0
    assert outcomes(report) == {"a": True, "b": False, "c": True}
    assert report.tests[1].timed_out and report.stage == "done"


def test_os_exit_at_import_fails_every_test(run_harness: RunHarness) -> None:
    report, done, _ = run_harness("import os\nos._exit(0)\ndef f(x): return x\n")
    assert done.returncode == 0
    assert report.stage == "done" and report.passed == 0
    assert "the solution's process ended (exit status 0)" in (report.import_error or "")
    assert {test.error for test in report.tests} == {"not run: the solution failed to import"}


def test_os_exit_in_a_test_fails_that_test_only(run_harness: RunHarness) -> None:
    source = """
        import os
        def f(x):
            if x == 2:
                os._exit(7)
            return x
    """
    report, done, _ = run_harness(source)
    assert done.returncode == 0  # the judge is another process: the solution cannot end it
    assert outcomes(report) == {"a": True, "b": False, "c": True}
    assert report.tests[1].error == "the solution's process ended (exit status 7)"
    assert report.stage == "done" and report.problem is None


def test_printing_50_mb_is_captured_and_capped(run_harness: RunHarness, tmp_path: Path) -> None:
    source = """
        import os, sys
        print("x" * 50_000_000)
        os.write(1, b"y" * 50_000_000)
        def f(x):
            sys.stderr.write("e" * 50_000_000)
            os.write(2, b"z" * 50_000_000)
            print(f"value {x}")
            return x
    """
    report, done, _ = run_harness(source, max_output_chars=100)
    assert report.passed == 3 and report.stage == "done"
    assert report.import_stdout == "x" * 100
    first = report.tests[0]
    assert first.stdout == "value 1\n" and not first.stdout_truncated
    assert first.stderr == "e" * 100 and first.stderr_truncated
    assert len(done.stdout) + len(done.stderr) == 0  # fd-level writes went to /dev/null
    assert (tmp_path / "report.json").stat().st_size < 10_000


def test_raising_at_import_is_an_import_error(run_harness: RunHarness) -> None:
    report, _, _ = run_harness('raise RuntimeError("boom")\n')
    assert report.import_error is not None and report.import_error.startswith("RuntimeError: boom")
    assert 'File "<solution>", line 1' in report.import_error
    assert report.passed == 0 and report.stage == "done"
    assert {test.error for test in report.tests} == {"not run: the solution failed to import"}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f(x) return x\n", "SyntaxError"),
        ("def g(x):\n    return x\n", "the solution does not define 'f'"),
        ("f = 3\n", "'f' is a int, not a function or class"),
        ("import sys\nsys.exit(4)\n", "SystemExit: 4"),
    ],
)
def test_broken_solutions_fail_to_import(run_harness: RunHarness, source: str, expected: str) -> None:
    report, done, _ = run_harness(source)
    assert done.returncode == 0 and report.passed == 0
    assert expected in (report.import_error or "")


def test_sys_exit_in_a_test_fails_only_that_test(run_harness: RunHarness) -> None:
    source = """
        import sys
        def f(x):
            if x == 2:
                sys.exit(3)
            return x
    """
    report, done, _ = run_harness(source)
    assert done.returncode == 0
    assert outcomes(report) == {"a": True, "b": False, "c": True}
    assert (report.tests[1].error or "").startswith("SystemExit: 3")


def test_redefined_builtins_do_not_change_the_verdict(run_harness: RunHarness) -> None:
    source = """
        import builtins
        builtins.sorted = lambda items, **kw: [1, 2, 3]
        builtins.len = lambda items: 3
        builtins.AssertionError = type("Quiet", (Exception,), {})
        print = None
        def f(x):
            return [9, 8] if x == 2 else [3, 1, 2]
    """
    tests = [
        CodeTest(name="right", code="assert sorted(f(1)) == [1, 2, 3]"),
        CodeTest(name="wrong_sorted", code="assert sorted(f(2)) == [1, 2, 3]"),
        CodeTest(name="wrong_len", code="assert len(f(2)) == 3"),
    ]
    report, _, _ = run_harness(source, tests=tests)
    assert outcomes(report) == {"right": True, "wrong_sorted": False, "wrong_len": False}
    assert "left:  [8, 9]" in (report.tests[1].error or "")


def test_tampering_with_the_harness_and_stdlib_changes_nothing(run_harness: RunHarness) -> None:
    source = """
        import builtins, json, os, sys
        harness = type(sys.stdout).write.__globals__  # the solution process's copy of the harness
        for name in list(harness):
            if not name.startswith("__") and callable(harness[name]):
                harness[name] = lambda *a, **k: None
        json.dumps = json.dump = lambda *a, **k: '{"passed": true}'
        os.replace = os.rename = lambda *a, **k: None
        def f(x):
            builtins.type = lambda *a: int
            os.write = lambda fd, data: len(data)
            return x if x != 2 else -1
    """
    report, done, _ = run_harness(source)
    assert done.returncode == 0 and report.stage == "done"
    assert not outcomes(report)["b"]  # breaking its own process can only fail its own tests


def test_objects_that_equal_everything_do_not_pass(run_harness: RunHarness) -> None:
    source = """
        class Anything(str):
            def __eq__(self, other): return True
            def __ne__(self, other): return False
            __hash__ = str.__hash__
        def f(x):
            return Anything("?")
    """
    tests = [CodeTest(name="eq", code="assert f(1) == 1"), CodeTest(name="in", code="assert f(1) in [1, 2]"),
             CodeTest(name="bare", code="ok = f(1) == 1\nassert ok"),
             CodeTest(name="nested", code="assert [f(1)] == [1]")]  # fmt: skip
    report, _, _ = run_harness(source, tests=tests)
    assert report.passed == 0
    assert all("strict test comparison: a Anything object" in (test.error or "") for test in report.tests)
    loose, _, _ = run_harness(source, tests=tests, strict=False)
    assert loose.passed == 4  # what the strict default prevents


def test_walking_frames_reaches_nothing_of_the_judges(run_harness: RunHarness) -> None:
    source = """
        import sys
        def f(x):
            frame = sys._getframe()
            while frame is not None:
                frame.f_globals["__tg_check__"] = lambda *a: None
                frame.f_globals["check"] = frame.f_globals["compare"] = lambda *a: True
                frame = frame.f_back
            return -1
    """
    tests = [CodeTest(name="a", code="value = f(1)\nassert value == 1")]
    report, _, _ = run_harness(source, tests=tests)
    assert outcomes(report) == {"a": False}
    assert "assert value == 1\n  left:  -1" in (report.tests[0].error or "")


def test_a_solution_cannot_forge_the_report(run_harness: RunHarness, tmp_path: Path) -> None:
    source = """
        import atexit, json, os, time
        SEEN = {"spec": os.path.exists("spec.json"), "report": open("report.json").read()}
        def forge():
            fake = {"version": 1, "nonce": "0" * 32, "stage": "done",
                    "tests": [{"name": n, "passed": True} for n in "abc"]}
            with open("report.json", "w") as handle:
                json.dump(fake, handle)
        forge()
        atexit.register(forge)
        if os.fork() == 0:  # a child that comes back into the harness after the import
            time.sleep(0.2)
        def f(x):
            return -1 if SEEN["spec"] or x == 2 else x
    """
    report, done, spec = run_harness(source)
    assert done.returncode == 0 and report.stage == "done"
    assert outcomes(report) == {"a": True, "b": False, "c": True}  # the spec was gone before the import
    written = (tmp_path / "report.json").read_text()
    assert spec.nonce not in written  # the nonce signs the report but is never written anywhere
    signed = json.loads(written)
    body = json.loads(signed["report"])
    for test in body["tests"]:
        test.update(passed=True, error=None)
    tampered = json.dumps({**signed, "report": json.dumps(body)})
    rejected = read_report(tampered, spec)
    assert rejected.passed == 0 and "not signed with this run's nonce" in (rejected.problem or "")


def test_a_lingering_child_cannot_replace_the_report(run_harness: RunHarness, tmp_path: Path) -> None:
    source = """
        import json, os, time
        before = open("report.json").read()  # signed: it holds no nonce to sign a forgery with
        if os.fork() == 0:
            time.sleep(1.0)  # try to outlive the judge, then put back the older report
            with open("report.json", "w") as handle:
                handle.write(before)
            os._exit(0)
        def f(x):
            return -1
    """
    report, _, spec = run_harness(source)
    assert report.passed == 0 and report.stage == "done"
    time.sleep(1.5)
    final = read_report((tmp_path / "report.json").read_bytes(), spec)
    assert final.stage == "done" and final.passed == 0  # the solution's processes ended with the judge


def test_an_exception_whose_message_hangs_is_still_reported(run_harness: RunHarness) -> None:
    source = """
        class Stuck(Exception):
            def __str__(self):
                while True:
                    pass
        def f(x):
            if x == 2:
                raise Stuck()
            return x
    """
    report, _, _ = run_harness(source)
    assert outcomes(report) == {"a": True, "b": False, "c": True}
    # traceback gives up on the message when the harness's timer interrupts it
    assert (report.tests[1].error or "").startswith("solution.Stuck: <exception str() failed>")


def test_failures_explain_themselves(run_harness: RunHarness) -> None:
    tests = [CodeTest(name="t", code="assert f([3, 1]) == [1, 3]"), CodeTest(name="u", code="assert f(0)")]
    report, _, _ = run_harness("def f(x):\n    return x\n", tests=tests)
    assert report.tests[0].error == (
        "AssertionError: assert f([3, 1]) == [1, 3]\n  left:  [3, 1]\n  right: [1, 3]\n"
        '  File "<test t>", line 1, in <module>\n    assert f([3, 1]) == [1, 3]'
    )
    assert (report.tests[1].error or "").startswith("AssertionError: assert f(0)")


def test_a_test_that_does_not_compile_fails_alone(run_harness: RunHarness) -> None:
    tests = [CodeTest(name="bad", code="assert f(1) ==="), CodeTest(name="good", code="assert f(1) == 1")]
    report, _, _ = run_harness("def f(x):\n    return x\n", tests=tests)
    assert outcomes(report) == {"bad": False, "good": True}
    assert (report.tests[0].error or "").startswith("the test does not compile: invalid syntax")


# --- the report, read by the caller ----------------------------------------------------------------
def test_missing_or_unreadable_reports_fail_every_test() -> None:
    spec = HarnessSpec.for_task(get_task("digital-root"), "")
    killed = ExecResult(exit_code=-9, killed_by="memory")
    missing = read_report(None, spec, killed)
    assert missing.passed == 0 and missing.stage == "none"
    assert missing.problem == "the harness wrote no report (the sandbox stopped it: memory)"
    garbage = read_report(b"{oops", spec)
    assert garbage.passed == 0 and "could not be read" in (garbage.problem or "")


def test_bad_command_lines_and_specs_exit_2(tmp_path: Path) -> None:
    usage = subprocess.run([sys.executable, "-I", str(HARNESS)], capture_output=True)
    assert usage.returncode == 2 and b"usage:" in usage.stderr
    (tmp_path / "spec.json").write_text(json.dumps({"source": "", "entry_point": "not valid", "tests": []}))
    bad = subprocess.run([sys.executable, "-I", str(HARNESS), "spec.json", "r.json"], cwd=tmp_path,
                         capture_output=True)  # fmt: skip
    assert bad.returncode == 2 and b"not a Python identifier" in bad.stderr
    assert not (tmp_path / "r.json").exists()


def test_sandbox_timeout_covers_the_worst_case() -> None:
    spec = HarnessSpec.for_task(get_task("digital-root"), "", timeout_s=2.0)
    # Import and every test at their watchdog limits, each also describing a hanging exception.
    assert spec.sandbox_timeout_s() >= (3.0 + 3.0) + len(spec.tests) * (3.0 + 3.0)


@pytest.mark.parametrize(
    "value", ["plain", "\u00e9\u4e2d\U0001f600", "\ud800 lone surrogate", '\x00\x1f"\\/']
)
def test_report_encoder_round_trips(value: str) -> None:
    data = {"s": value, "n": [1, -2.5, None, True, False], "d": {"k": [value]}}
    text = harness_module.encode_json(data)
    assert text.isascii() and json.loads(text) == data


def test_the_harness_runs_from_source_where_the_sandboxs_python_differs(tmp_path: Path) -> None:
    from tangram_env.envs.code_tasks import harness_invocation

    task = get_task("digital-root")
    spec = HarnessSpec.for_task(task, task.reference_solution)
    argv, stdin = harness_invocation(spec, str(tmp_path / "report.json"), python=sys.executable)
    tag, rest = stdin.split(b" ", 1)
    assert tag.decode() == sys.implementation.cache_tag  # the compiled harness is used where it can be
    done = subprocess.run(argv, input=b"cpython-0 " + rest, capture_output=True, timeout=60)  # other bytecode
    assert done.returncode == 0, done.stderr
    report = read_report((tmp_path / "report.json").read_bytes(), spec)
    assert report.passed == report.total


@pytest.mark.parametrize(
    "value",
    [
        None, True, 0, -(10**30), 1.5, float("inf"), "é", b"\x00\xff", 3 + 4j,
        [1, [2, (3, {4: frozenset({5})})]], list(range(50)), tuple("abcdefghijklmnopq"),
        {"k": [1.0, None, "x"] * 10, (1, 2): {b"z"}}, [[[[[[[[[[[]]]]]]]]]]],
    ],
)  # fmt: skip
def test_plain_data_crosses_the_pipes_exactly(value: object) -> None:
    def no_handles(item: object) -> list[object]:
        raise AssertionError(f"plain data needed a handle: {item!r}")

    back = harness_module.decode_value(
        json.loads(json.dumps(harness_module.encode_value(value, no_handles))), None
    )  # type: ignore[arg-type]
    assert back == value and repr(back) == repr(value)


def test_objects_and_cycles_cross_as_handles_and_shared_parts_stay_shared() -> None:
    handles: list[object] = []

    def handle_of(item: object) -> list[object]:
        handles.append(item)
        return ["h", len(handles) - 1, type(item).__name__]

    cycle: list[object] = [1]
    cycle.append(cycle)
    shared = [1, 2]
    nodes = harness_module.encode_value({"o": object(), "c": cycle, "s": (shared, shared)}, handle_of)
    back = harness_module.decode_value(json.loads(json.dumps(nodes)), lambda node: ("handle", node[1]))
    assert back["o"] == ("handle", 0) and back["c"][1] == ("handle", 1) and handles[1] is cycle
    assert back["s"][0] is back["s"][1] == [1, 2]
    with pytest.raises(ValueError, match="does not come before"):
        harness_module.decode_value([["l", [0]]], lambda node: None)
