"""An orchestrator with a worker token admits only workers that give it: without one, any peer that
reached it could register under a worker's name, receive its actions and answer them with anything."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from tangram_env import Client, wire
from tangram_env.protocol import Heartbeat
from tangram_env.server.worker import EXIT_NOT_ADMITTED
from tests.cluster.procs import Processes, child_env, start_orchestrator, start_worker, wait_for


@pytest.mark.timeout(120)
def test_only_workers_with_the_token_join_and_a_refused_one_exits(procs: Processes, tmp_path: Path) -> None:
    env = child_env(TANGRAM_SERVER_WORKER_TOKEN="a-long-shared-secret")
    _, address = start_orchestrator(procs, "tcp://127.0.0.1:0", env=env)
    refused = start_worker(procs, address, "stranger")
    assert refused.wait(30) == EXIT_NOT_ADMITTED  # at once, saying why (not heartbeating forever)
    admitted = start_worker(procs, address, "ours", env={"TANGRAM_WORKER_TOKEN": "a-long-shared-secret"})
    with Client(address) as client:
        wait_for(lambda: "ours" in client.stats()["workers"], 30, "the worker with the token to join")
        assert "stranger" not in client.stats()["workers"]
        # The orchestrator hands a connection over to a new peer of the same identity: one that
        # connects under the worker's public name must not get its connection (and its actions).
        impostor = zmq.Context.instance().socket(zmq.DEALER)
        impostor.setsockopt(zmq.LINGER, 0)
        impostor.setsockopt(zmq.ROUTING_ID, b"ours")
        impostor.connect(address)
        try:
            impostor.send(wire.encode(Heartbeat()))
            impostor.recv(copy=True)  # the server heard it
            ran = client.run("cluster.mark", {"dir": str(tmp_path), "seconds": 0})
            assert ran.ok and ran.value["worker"] == "ours", ran
            assert not impostor.poll(500)  # nothing more came its way
        finally:
            impostor.close()
    assert admitted.poll() is None


@pytest.mark.timeout(120)
def test_a_worker_whose_name_is_refused_or_taken_exits(procs: Processes) -> None:
    # Refused with `conflict`, a worker used to log one warning and idle on, unregistered, for good.
    _, address = start_orchestrator(procs, "tcp://127.0.0.1:0")
    assert start_worker(procs, address, "local").wait(30) == EXIT_NOT_ADMITTED  # the orchestrator's own
    first = start_worker(procs, address, "twin")
    with Client(address) as client:
        wait_for(lambda: "twin" in client.stats()["workers"], 30, "the first worker to join")
        second = start_worker(procs, address, "twin")  # takes the name: the first is told so
        assert first.wait(30) == EXIT_NOT_ADMITTED
        assert second.poll() is None
        wait_for(lambda: "twin" in client.stats()["workers"], 30, "the second worker to hold the name")
