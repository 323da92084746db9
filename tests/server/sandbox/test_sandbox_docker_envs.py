"""The built-in ``code`` env and the README quickstart, unchanged, on an orchestrator run with
``--sandbox docker`` (needs the engine and ``tangram/default``, as `.ci/run` provides)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

import tangram_env
from tests.conftest import ROOT, ServerProcess
from tests.server.sandbox.test_sandbox_docker import needs_engine

pytestmark = needs_engine

RIGHT = """
def run_length_encode(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        j = i
        while j < len(text) and text[j] == text[i]:
            j += 1
        out.append(f"{j - i}{text[i]}")
        i = j
    return "".join(out)
"""
TASK = "run-length-encode"
WRONG = "def run_length_encode(text):\n    return None\n"


@pytest.fixture(scope="module")
def docker_server() -> Iterator[ServerProcess]:
    srv = ServerProcess("--sandbox", "docker")
    yield srv
    srv.stop()


def test_code_env_grades_in_containers(docker_server: ServerProcess) -> None:
    env = tangram_env.make("code", address=docker_server.address, max_turns=2)
    try:
        env.reset(options={"task_id": "run-length-encode"})
        _obs, reward, terminated, _truncated, info = env.step(RIGHT)
        assert reward == 1.0 and terminated and info["passed"] == info["total"] >= 5
        env.reset(options={"task_id": "run-length-encode"})
        _obs, reward, terminated, _truncated, info = env.step(WRONG)
        assert reward == 0.0 and info["passed"] == 0 and not terminated
    finally:
        env.close()


def test_a_wrong_solution_that_kills_every_process_is_graded_zero(docker_server: ServerProcess) -> None:
    # Its tests run as the container's root: `os.kill(-1, 9)` at import killed Docker's init's child, the
    # container stopped, and the grading came back with no reward (masked) instead of its 0.0.
    env = tangram_env.make(
        "code",
        address=docker_server.address,
        max_turns=1,
        invalid_reward="flag",
        task_ids=["run-length-encode"],
    )
    try:
        env.reset(seed=0)
        _obs, reward, _terminated, _truncated, info = env.step("import os\nos.kill(-1, 9)\n" + WRONG)
        assert reward == 0.0 and info["reward_valid"] is True, info
    finally:
        env.close()


def test_quickstart_runs_under_docker() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TANGRAM_ADDRESS"}
    env["TANGRAM_SERVER_SANDBOX_PROVIDER"] = "docker"  # what `--sandbox docker` sets, for the embedded one
    out = subprocess.run(
        [sys.executable, "examples/quickstart.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    rewards = dict(re.findall(r"^(right|wrong) answer: reward ([0-9.]+)", out.stdout, re.M))
    assert float(rewards["right"]) == 1.0 and float(rewards["wrong"]) < 1.0, out.stdout


def test_a_killed_servers_containers_are_removed_without_another_start() -> None:
    # They ran, holding their memory and what their commands left, until another server started on
    # the host and swept them.
    import docker

    from tangram_env import Client
    from tangram_env.server.sandbox.docker import LABEL, OWNER_LABEL

    srv = ServerProcess("--sandbox", "docker")
    engine = docker.from_env()
    try:
        with Client(srv.address) as client, client.sandbox() as box:
            assert box.bash("echo up").stdout == "up\n"
            owned = [
                c
                for c in engine.containers.list(filters={"label": LABEL})
                if c.labels[OWNER_LABEL].split(":")[1] == str(srv.pid)
            ]
            assert owned, "the session's container"
            srv.process.kill()
            srv.process.wait()
            deadline = time.monotonic() + 30
            while any(c.id in {o.id for o in owned} for c in engine.containers.list(all=True)):
                assert time.monotonic() < deadline, "the killed server's containers are still there"
                time.sleep(0.5)
    finally:
        srv.stop()
        engine.close()
