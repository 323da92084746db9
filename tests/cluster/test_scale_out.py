"""Scale-out on loopback: workers join, one dies mid-run, another joins; two trainers get every result."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tangram_env import Client
from tests.cluster.procs import (
    Processes,
    check_delivery,
    check_observability,
    child_env,
    free_port,
    read_marks,
    read_records,
    start_orchestrator,
    start_trainer,
    start_worker,
    wait_for,
)

N_PER_TRAINER = 200
GATE_AT = N_PER_TRAINER // 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_worker_killed_and_added_mid_run(
    procs: Processes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    gate = tmp_path / "second-half"
    env = child_env(TANGRAM_SERVER_WORKER_TIMEOUT_S="2s")
    metrics_port = free_port()
    _, address = start_orchestrator(procs, "tcp://127.0.0.1:0", "--metrics-port", str(metrics_port), env=env)
    workers = {f"w{i}": start_worker(procs, address, f"w{i}") for i in range(3)}
    with Client(address) as client:
        wait_for(lambda: {"w0", "w1", "w2"} <= set(client.stats()["workers"]), 30, "three workers to join")
        outs = [tmp_path / f"t{i}.json" for i in range(2)]
        trainers = [
            start_trainer(
                procs,
                address,
                f"t{i}",
                N_PER_TRAINER,
                marks,
                outs[i],
                seconds=0.2,
                gate=gate,
                gate_at=GATE_AT,
            )
            for i in range(2)
        ]

        # Mid-run: once some work is done and w1 has actions in flight, kill it outright.
        def w1_busy() -> bool:
            figures = client.stats()
            return figures["finished"] >= N_PER_TRAINER // 4 and figures["workers"]["w1"]["running"] >= 2

        wait_for(w1_busy, 40, "w1 to be busy mid-run", every_s=0.02)
        os.kill(workers["w1"].pid, signal.SIGKILL)
        workers["w1"].wait()
        start_worker(procs, address, "w3")
        wait_for(
            lambda: "w3" in (w := client.stats()["workers"]) and "w1" not in w,
            30,
            "w3 to join and w1 to be declared lost",
        )
        gate.touch()  # the trainers go on with their second halves on the changed cluster

        for t in trainers:
            assert t.wait(timeout=60) == 0
        figures = client.stats()
        check_observability(metrics_port, address, 2 * N_PER_TRAINER, {"local", "w0", "w2", "w3"}, capsys)

    records = read_records(*outs)
    expected = {f"t{i}-{j}" for i in range(2) for j in range(N_PER_TRAINER)}
    seen = check_delivery(records, expected, read_marks(marks), faulty={"w1"})
    print("results per worker and requeues:", seen)
    # The orchestrator finished each action once and no other way.
    assert figures["submitted"] == figures["finished"] == len(expected)
    assert not figures["errors"]
    assert figures["pending"] == figures["running"] == 0
    # The run really went through a departure and an arrival.
    assert seen.get("w1", 0) > 0 and seen.get("w3", 0) > 0, seen
    assert seen["requeued"] >= 1, seen  # w1 was killed with actions in flight; they ran again elsewhere
    assert set(figures["workers"]) == {"local", "w0", "w2", "w3"}
    # Each worker announced what its flags say (`--cpus 1 --mem-mb 1024`: a bare number is MiB).
    assert figures["workers"]["w3"]["capacity"] == {"cpu": 1.0, "mem_mb": 1024, "gpu": 0.0, "gpu_mem_mb": 0}
