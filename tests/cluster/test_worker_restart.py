"""A worker outlives its orchestrator: what the dead one granted it must not run on beside what the
restarted one grants (that one reported those actions lost and ignores their results)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tangram_env import Client
from tangram_env.protocol import Action
from tests.cluster.procs import Processes, start_orchestrator, start_worker, wait_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(120)
def test_a_worker_kills_the_runs_of_an_orchestrator_that_restarted(procs: Processes, tmp_path: Path) -> None:
    address = f"tcp://127.0.0.1:{_free_port()}"  # the restarted orchestrator binds the same one
    first, _ = start_orchestrator(procs, address)
    start_worker(procs, address, "w1", cpus=0.25)  # one cluster.mark at a time
    with Client(address) as client:
        wait_for(lambda: "w1" in client.stats()["workers"], 30, "the worker to join")
        orphan = Action(id="orphan", kind="cluster.mark", payload={"dir": str(tmp_path), "seconds": 18})
        client.submit([orphan])
        start = wait_for(lambda: list(tmp_path.glob("orphan.*.start")), 20, "the action to start")
    pid = int(start[0].name.split(".")[1])
    first.kill()
    first.wait()
    start_orchestrator(procs, address)
    with Client(address) as client:
        wait_for(lambda: "w1" in client.stats()["workers"], 30, "the worker to register again")
        # Killed before it registered again, so its capacity is free for the new orchestrator's grants.
        wait_for(lambda: not _running(pid), 2, "the dead orchestrator's action to be killed")
        ran = client.run("cluster.mark", {"dir": str(tmp_path), "seconds": 0})
        assert ran.ok and ran.value["worker"] == "w1", ran
        assert client.stats()["workers"]["w1"]["running"] == 0
    assert not list(tmp_path.glob("orphan.*.done"))
