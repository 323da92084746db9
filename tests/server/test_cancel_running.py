"""Cancelling an action that runs stops it: its owner gets ``cancelled`` at once, and what it held
(cores, a sandbox command) is free again instead of working for nobody until its time limit."""

from __future__ import annotations

import time

from tangram_env import Action, Client
from tests.conftest import ServerProcess, wait_for
from tests.server.sandbox.helpers import processes_running


def _running(client: Client) -> int:
    return int(client.stats()["running"])


def test_a_running_process_tool_is_stopped_and_its_cores_freed() -> None:
    srv = ServerProcess("--cpus", "1")
    try:
        with Client(srv.address) as client:
            slow = Action(kind="sleep", payload={"seconds": 30})
            (fut,) = client.submit([slow])
            wait_for(lambda: _running(client) == 1, 10, "the sleep to start")
            t0 = time.monotonic()
            client.cancel([slow.id])
            result = fut.result(10)
            assert result.error_type == "cancelled" and "after it started" in result.message, result
            assert time.monotonic() - t0 < 3.0 and _running(client) == 0
            assert client.run("sleep", {"seconds": 0}, timeout=5).ok  # its core is free again
    finally:
        srv.stop()


def test_a_running_sandbox_command_is_killed_and_its_session_goes_on() -> None:
    # The command ran on for its whole time limit, holding its cores, after its trainer had given up.
    command = "sleep 31.7"
    srv = ServerProcess("--cpus", "2")
    try:
        with Client(srv.address) as client:
            slow = Action(kind="bash", payload={"command": command}, affinity="cancel-me")
            (fut,) = client.submit([slow])
            wait_for(lambda: processes_running(command), 20, "the command to start")
            t0 = time.monotonic()
            client.cancel([slow.id])
            result = fut.result(10)
            assert result.error_type == "cancelled", result
            assert time.monotonic() - t0 < 3.0
            wait_for(lambda: not processes_running(command), 5, "the command to be killed")
            wait_for(lambda: _running(client) == 0, 5, "nothing to run")
            after = client.run("bash", {"command": "echo still here"}, affinity="cancel-me")
            assert after.ok and "still here" in after.value["stdout"], after
            client.close_sessions(["cancel-me"])
    finally:
        srv.stop()
