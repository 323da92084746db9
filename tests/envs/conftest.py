"""Fixtures for the code env's task set and harness: a harness runner and every task graded once."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tangram_env.envs.code_tasks import (
    CodeTask,
    CodeTest,
    HarnessReport,
    HarnessSpec,
    load_tasks,
    read_report,
)
from tangram_env.envs.code_tasks import harness as harness_module
from tangram_env.envs.code_tasks.local import run_unsandboxed
from tangram_env.sandbox import ExecResult

HARNESS = Path(harness_module.__file__)
ABC_TESTS = (
    CodeTest(name="a", code="assert f(1) == 1"),
    CodeTest(name="b", code="assert f(2) == 2"),
    CodeTest(name="c", code="assert f(3) == 3"),
)
Harnessed = tuple[HarnessReport, "subprocess.CompletedProcess[bytes]", HarnessSpec]


@pytest.fixture
def run_harness(tmp_path: Path) -> Callable[..., Harnessed]:
    """``run_harness(source, tests=ABC_TESTS, **spec_fields)``: the harness run as a sandbox would.

    It runs ``python -I harness.py spec.json report.json`` in ``tmp_path`` on a solution defining
    ``f`` (tested by default with ``f(1) == 1``, ``f(2) == 2``, ``f(3) == 3``), and returns the report
    as the caller reads it, the finished process, and the spec.
    """

    def run(
        source: str, tests: tuple[CodeTest, ...] | list[CodeTest] = ABC_TESTS, **fields: Any
    ) -> Harnessed:
        spec = HarnessSpec(source=textwrap.dedent(source), entry_point="f", tests=tests, **fields)
        spec_path, report_path = tmp_path / "spec.json", tmp_path / "report.json"
        spec_path.write_text(spec.to_json())
        done = subprocess.run(
            [sys.executable, "-I", str(HARNESS), str(spec_path), str(report_path)],
            cwd=tmp_path, capture_output=True, timeout=60, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        run = ExecResult(exit_code=done.returncode, stdout=done.stdout.decode(), stderr=done.stderr.decode())
        data = report_path.read_bytes() if report_path.exists() else None
        return read_report(data, spec, run), done, spec

    return run


def _stub(task: CodeTask, body: str) -> str:
    return f"def {task.entry_point}(*args, **kwargs):\n    {body}\n"


@pytest.fixture(scope="module")
def graded() -> dict[str, dict[str, HarnessReport]]:
    """Each task graded three ways, in parallel: its reference, a stub returning None, one that raises."""
    jobs = [
        (task.id, kind, HarnessSpec.for_task(task, source, timeout_s=10.0))
        for task in load_tasks()
        for kind, source in [
            ("reference", task.reference_solution),
            ("none", _stub(task, "return None")),
            ("raising", _stub(task, "raise NotImplementedError")),
        ]
    ]
    with ThreadPoolExecutor(max_workers=4) as pool:
        reports = list(pool.map(lambda job: run_unsandboxed(job[2]), jobs))
    graded: dict[str, dict[str, HarnessReport]] = {}
    for (task_id, kind, _), report in zip(jobs, reports, strict=True):
        graded.setdefault(task_id, {})[kind] = report
    return graded
