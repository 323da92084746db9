"""``tangram-worker`` run as users run it: each mistake on its command line is one line naming it, and
status 2, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_module


def _worker(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANGRAM_SERVER_")}
    return run_module("tangram_env.server.worker", *args, env=env)


# No orchestrator listens there: each mistake must be found before the worker would try it.
NOWHERE = "tcp://127.0.0.1:9"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--connect", "garbage"], "--connect garbage: Invalid argument"),
        (["--connect", NOWHERE, "--cpus", "-2"], "--cpus must be a positive number of cores, got -2"),
        (["--connect", NOWHERE, "--mem-mb", "abc"], "--mem-mb abc: cannot read 'abc'"),
        (["--connect", NOWHERE, "--sandbox", "nope"], "no sandbox provider named 'nope'"),
        (
            ["--connect", NOWHERE, "--plugin", "nonexistent_mod_xyz"],
            "--plugin nonexistent_mod_xyz: cannot import it: No module named 'nonexistent_mod_xyz'",
        ),
        (
            ["--connect", NOWHERE, "--plugin-file", "/nonexistent.py"],
            "--plugin-file /nonexistent.py: no such",
        ),
        (["--connect", NOWHERE, "--log-level", "LOUD"], "--log-level LOUD: not a level; use DEBUG"),
        (["--connect", NOWHERE, "--runner", "gpu", "--gpus", "cuda:99"], "--gpus: no cuda:99 here"),
        (["--connect", NOWHERE, "--runner", "gpu", "--cpus", "0"], "--cpus must be a positive number"),
    ],
)
def test_a_mistake_on_the_command_line_is_one_line_and_status_2(args: list[str], said: str) -> None:
    run = _worker(*args)
    lines = [line for line in run.stderr.splitlines() if line.startswith("tangram-worker:")]
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert len(lines) == 1 and said in lines[0], run.stderr


def test_an_invalid_setting_from_the_environment_names_the_setting() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TANGRAM_SERVER_WARM_IDLE_S": "abc"}
    run = subprocess.run(
        [sys.executable, "-m", "tangram_env.server.worker", "--connect", NOWHERE, "--sandbox", "none"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "tangram-worker: invalid settings: warm_idle_s: cannot read 'abc' as a number with an optional unit"
    )
