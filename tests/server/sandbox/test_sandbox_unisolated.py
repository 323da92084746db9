"""The unisolated provider's exec: limits applied through a gate, not a ``preexec_fn``."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tangram_env.sandbox import SandboxSpec
from tangram_env.server.sandbox.procrun import kill_session, run_captured
from tangram_env.server.sandbox.unisolated import UnisolatedProvider, UnisolatedSandbox
from tests.server.sandbox.helpers import processes_running


@pytest.fixture
def sandbox(tmp_path: Path) -> Iterator[UnisolatedSandbox]:
    provider = UnisolatedProvider(state_dir=str(tmp_path / "state"))
    spec = SandboxSpec(image="default", max_open_files=123, disk_mb=7, cpu_time_s=5)
    sb = provider.create(spec)
    yield sb
    provider.close()


def test_limits_and_cores_bind_the_command(sandbox: UnisolatedSandbox) -> None:
    core = min(os.sched_getaffinity(0))
    script = "ulimit -Sn; ulimit -Hn; ulimit -f; ulimit -t; grep Cpus_allowed_list /proc/self/status"
    result = sandbox.exec(["bash", "-c", script], cores=(core,))
    assert result.ok, result
    lines = result.stdout.split("\n")
    assert lines[:4] == ["123", "123", str(7 * 1024), "5"]  # bash counts file size in KiB
    assert lines[4].split() == ["Cpus_allowed_list:", str(core)]


def test_stdin_passes_the_gate_intact(sandbox: UnisolatedSandbox) -> None:
    data = "first\n\nthird, with no newline at the end"
    assert sandbox.exec(["cat"], stdin=data.encode()).stdout == data
    assert sandbox.exec(["od", "-An", "-c"], stdin=b"\n\n").stdout.split() == ["\\n", "\\n"]
    assert sandbox.exec(["cat"]).stdout == ""  # no stdin: the command reads end-of-file at once


def test_the_time_limit_kills_the_command_and_what_it_started(sandbox: UnisolatedSandbox) -> None:
    result = sandbox.exec("sleep 41.25 & sleep 41.5", timeout_s=0.5)
    assert result.killed_by == "timeout"
    time.sleep(0.2)
    assert not processes_running("sleep 41.")


def test_a_gated_command_whose_limits_fail_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    def refuse(pid: int) -> None:
        raise PermissionError(f"cannot limit {pid}")

    with pytest.raises(PermissionError):
        run_captured(
            ["sh", "-c", f"touch {marker}"],
            env={"PATH": "/usr/bin:/bin"},
            cwd=str(tmp_path),
            stdin=None,
            timeout_s=5,
            max_output_bytes=1000,
            output_kill_bytes=2000,
            kill=kill_session,
            on_spawn=refuse,
            gated=True,
        )
    time.sleep(0.1)
    assert not marker.exists()


def test_spawning_does_not_copy_the_calling_process(sandbox: UnisolatedSandbox) -> None:
    # A fork copies the caller's page tables while it holds the GIL (every thread of an orchestrator
    # waits); the gated exec is a vfork, whose cost does not grow with the caller's memory.
    ballast = bytearray(512 << 20)
    ballast[:: 1 << 12] = b"x" * len(ballast[:: 1 << 12])  # touched: every page is mapped

    def forked() -> None:
        subprocess.run(["true"], preexec_fn=lambda: None, check=True)

    def gated() -> None:
        assert sandbox.exec(["true"]).ok

    fork_s = min(_timed(forked) for _ in range(5))
    gated_s = min(_timed(gated) for _ in range(5))
    del ballast
    assert gated_s < fork_s / 2, (gated_s, fork_s)


def _timed(call: object) -> float:
    assert callable(call)
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0
