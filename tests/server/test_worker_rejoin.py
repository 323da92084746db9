"""A worker the orchestrator took out while it lives on joins again: its heartbeats are answered with
``not_registered`` (which makes a worker register), not as if it were still in the books."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tangram_env import Client
from tangram_env.kinds import KindRegistry
from tangram_env.protocol import Error, Heartbeat, Register, Resources, Results
from tangram_env.server.lifecycle import Lifecycle, Limits, Send
from tangram_env.server.scheduler import FCFSScheduler
from tests.conftest import PLUGINS, ROOT, ServerProcess, wait_for


def test_a_worker_taken_out_while_it_stalled_joins_again_and_runs_actions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Stalled past worker_timeout_s but under its own 5 s silence limit, the worker heard heartbeats
    # as usual once it went on, never registered again, and idled for good (as did one whose grant was
    # held past its limit): its kinds' actions waited for a worker that never came.
    monkeypatch.setenv("TANGRAM_SERVER_WORKER_TIMEOUT_S", "2")
    srv = ServerProcess("--cpus", "0.01", "--no-gpu-worker", "--sandbox", "none")  # too small for test.touch
    argv = [sys.executable, "-m", "tangram_env.server.worker", "--connect", srv.address, "--worker-id", "w1"]
    argv += ["--cpus", "1", "--mem-mb", "512", "--plugin", PLUGINS, "--sandbox", "none"]
    worker = subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    try:
        with Client(srv.address) as client:
            joined = lambda: "w1" in client.stats()["workers"]  # noqa: E731
            wait_for(joined, 30, "w1 to join")
            os.kill(worker.pid, signal.SIGSTOP)
            try:
                wait_for(lambda: not joined(), 10, "w1 to be taken out while stopped")
                time.sleep(0.5)
            finally:
                os.kill(worker.pid, signal.SIGCONT)
            wait_for(joined, 10, "w1 to join again")
            result = client.run("test.touch", {"path": os.devnull, "line": "x"}, timeout_s=20)
            assert result.ok and result.worker == "w1", result
            assert worker.poll() is None
    finally:
        worker.terminate()
        worker.wait(10)
        srv.stop()


def test_a_dropped_workers_heartbeats_ask_it_to_register_and_a_clients_do_not() -> None:
    core = Lifecycle(KindRegistry(), FCFSScheduler(), server_id="S", limits=Limits(worker_timeout_s=2))
    worker, impostor, client = b"w1/secret", b"w1/other", b"client"
    register = Register(worker_id="w1", capacity=Resources(cpu=1, mem_mb=100))

    def reply(peer: bytes, now: float) -> object:
        (send,) = core.receive(peer, Heartbeat(server_id="S"), now)
        assert isinstance(send, Send) and send.peer == peer
        return send.message

    core.receive(worker, register, 0.0)
    assert isinstance(reply(worker, 1.0), Heartbeat)
    core.tick(4.0)  # silent past worker_timeout_s: taken out
    assert "w1" not in core.workers
    answer = reply(worker, 5.0)
    assert isinstance(answer, Error) and answer.code == "not_registered" and "w1" in answer.message
    assert isinstance(reply(client, 5.0), Heartbeat)  # a client's heartbeat is answered as ever
    core.receive(worker, register, 5.1)  # what the worker does on not_registered
    assert core.workers["w1"].identity == worker and isinstance(reply(worker, 5.2), Heartbeat)
    # Another process registering under its name takes its place: the first must not take the name
    # back (each would evict the other in turn), and is told why.
    core.receive(impostor, register, 6.0)
    answer = reply(worker, 6.1)
    assert isinstance(answer, Error) and answer.code == "conflict" and "--worker-id" in answer.message
    assert core.workers["w1"].identity == impostor
    (send,) = core.receive(worker, Results(results=[]), 6.2)  # nor do its late results take it back
    assert isinstance(send.message, Error) and send.message.code == "conflict"
