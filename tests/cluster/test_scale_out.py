"""Scale-out on loopback: workers join, one dies mid-run, another joins; two trainers get every result."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tangram_env import Client
from tests.cluster.procs import (
    Processes,
    TrainerRun,
    check_observability,
    child_env,
    free_port,
    start_orchestrator,
    start_worker,
    wait_for,
)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_worker_killed_and_added_mid_run(
    procs: Processes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = child_env(TANGRAM_SERVER_WORKER_TIMEOUT_S="2s")
    metrics_port = free_port()
    _, address = start_orchestrator(procs, "tcp://127.0.0.1:0", "--metrics-port", str(metrics_port), env=env)
    workers = {f"w{i}": start_worker(procs, address, f"w{i}") for i in range(3)}
    with Client(address) as client:
        run = TrainerRun(procs, client, address, tmp_path)

        # Mid-run: once some work is done and w1 has actions in flight, kill it outright.
        def w1_busy() -> bool:
            figures = client.stats()
            return figures["finished"] >= run.N_PER_TRAINER // 4 and figures["workers"]["w1"]["running"] >= 2

        wait_for(w1_busy, 40, "w1 to be busy mid-run", every_s=0.02)
        os.kill(workers["w1"].pid, signal.SIGKILL)
        workers["w1"].wait()
        start_worker(procs, address, "w3")
        wait_for(
            lambda: "w3" in (w := client.stats()["workers"]) and "w1" not in w,
            30,
            "w3 to join and w1 to be declared lost",
        )
        run.second_half()  # the trainers go on with their second halves on the changed cluster
        figures = client.stats()
        check_observability(metrics_port, address, 2 * run.N_PER_TRAINER, {"local", "w0", "w2", "w3"}, capsys)

    seen, _ = run.check(figures, faulty={"w1"}, workers={"local", "w0", "w2", "w3"})
    assert seen.get("w1", 0) > 0, seen  # the run really went through a departure
    # Each worker announced what its flags say (`--cpus 1 --mem-mb 1024`: a bare number is MiB).
    assert figures["workers"]["w3"]["capacity"] == {"cpu": 1.0, "mem_mb": 1024, "gpu": 0.0, "gpu_mem_mb": 0}
