"""Run the harness in a plain subprocess on this machine: no sandbox, so only for trusted code.

This is how the task set checks itself (every reference solution passes its tests) and how the
harness is tested; graded agent code goes through a sandbox (see :mod:`.grading`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tangram_env.envs.code_tasks.grading import HarnessReport, HarnessSpec, harness_invocation, read_report
from tangram_env.sandbox import ExecResult


def run_unsandboxed(
    spec: HarnessSpec, *, python: str = sys.executable, timeout_s: float | None = None
) -> HarnessReport:
    """Run the harness in a fresh temporary directory, as the ``code`` env's tool does; read its report.

    The harness and the spec go in on stdin, as they do in a sandbox.

    ``timeout_s`` (default: the spec's :meth:`~HarnessSpec.sandbox_timeout_s`) bounds the whole run;
    past it the process group is killed. Not isolated in any way: trusted code only.
    """
    limit = spec.sandbox_timeout_s() if timeout_s is None else timeout_s
    with tempfile.TemporaryDirectory(prefix="tangram-harness-") as workdir:
        report_path = Path(workdir, "report.json")
        command, stdin = harness_invocation(spec, str(report_path), python)
        process = subprocess.Popen(
            command, cwd=workdir, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,  # so that a timeout kills the solution's children too
        )  # fmt: skip
        killed_by = None
        try:
            stdout, stderr = process.communicate(stdin, timeout=limit)
        except subprocess.TimeoutExpired:
            killed_by = "timeout"
            stdout, stderr = b"", b""
        finally:
            _kill_group(process.pid)
            if killed_by:
                stdout, stderr = process.communicate()
        run = ExecResult(
            exit_code=process.returncode,
            stdout=stdout.decode("utf-8", "replace")[-4096:],
            stderr=stderr.decode("utf-8", "replace")[-4096:],
            killed_by=killed_by,
        )
        data = report_path.read_bytes() if report_path.exists() else None
    return read_report(data, spec, run)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
