"""A server that cannot start says why at once, through the launcher and the embedded orchestrator."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tangram_env import launch
from tangram_env.errors import ServerUnavailable
from tests.conftest import ROOT, ServerProcess


def test_the_cause_and_fix_arrive_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(ServerUnavailable, match=r"could not start: .*no sandbox provider named 'dockr'"):
        ServerProcess("--sandbox", "dockr")
    assert time.monotonic() - started < 30  # not the 60 s start timeout


def test_a_missing_docker_engine_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("docker")
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(ServerUnavailable, match=r"no Docker engine answers here.*dockerd"):
        ServerProcess("--sandbox", "docker")


def test_bad_settings_are_named() -> None:
    with pytest.raises(ServerUnavailable, match=r"invalid settings: .*max_retries"):
        launch.ServerProcess(env={**os.environ, "TANGRAM_SERVER_MAX_RETRIES": "-1"}, cwd=ROOT)


def test_the_embedded_orchestrator_carries_the_cause() -> None:
    # A fresh process, so that its embedded orchestrator starts with this environment.
    code = (
        "import tangram_env\n"
        "env = tangram_env.make('code')\n"
        "try:\n"
        "    env.reset()\n"
        "    env.step('def f(): pass')\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TANGRAM_ADDRESS"}
    env["TANGRAM_SERVER_SANDBOX_PROVIDER"] = "no-such-provider"
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert (
        "ServerUnavailable" in out.stdout and "no sandbox provider named 'no-such-provider'" in out.stdout
    ), out.stdout + out.stderr
    assert "embedded orchestrator" in out.stdout and time.monotonic() - started < 60
