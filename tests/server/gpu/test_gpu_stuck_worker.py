"""A reward-model worker whose device is stuck in a model's code exits, with the reason, for its
supervisor to start it afresh; the orchestrator runs its other work again. Real server and worker."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import Future
from pathlib import Path

from tangram_env import Action, Client
from tangram_env.launch import ServerProcess
from tangram_env.protocol import Result
from tangram_env.server.worker import EXIT_UNRECOVERABLE
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[3]
PLUGIN = "tests.server.gpu.hang_plugin"


def _start_worker(address: str, env: dict[str, str]) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "tangram_env.server.worker", "--connect", address, "--runner", "gpu"]
    return subprocess.Popen(
        [*argv, "--gpus", "cpu", "--plugin", PLUGIN, "--worker-id", "g-stuck", "--stuck-after-s", "1"],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )


def _hang_then_queue_behind(client: Client, worker_id: str) -> tuple[Future[Result], Future[Result]]:
    """Once ``worker_id`` has joined: a request whose forward pass never returns (limit 1 s), then one
    sent to the same device, which waits there behind it."""
    wait_for(lambda: worker_id in client.stats()["workers"], 60, f"{worker_id} to join")
    [hung] = client.submit([Action(kind="test.hangs", payload={"items": ["hang"]}, timeout_s=1.0)])
    time.sleep(0.2)
    [behind] = client.submit([Action(kind="test.hangs", payload={"items": ["fine"]}, timeout_s=60)])
    return hung, behind


def test_a_worker_stuck_in_a_model_exits_for_its_supervisor() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    srv = ServerProcess("--plugin", PLUGIN, "--no-gpu-worker", env=env, cwd=ROOT)
    workers = [_start_worker(srv.address, env)]
    try:
        with Client(srv.address) as client:
            hung, behind = _hang_then_queue_behind(client, "g-stuck")
            assert hung.result(30).error_type == "timeout"  # at its limit; the device is still inside
            code = workers[0].wait(30)  # a second past that limit it is stuck; the next heartbeat exits
            _, stderr = workers[0].communicate()
            assert code == EXIT_UNRECOVERABLE, stderr
            assert "cpu is stuck in reward model 'test.hangs': its forward pass has run" in stderr
            assert "exits (status 75) for its supervisor to start it afresh" in stderr
            workers.append(_start_worker(srv.address, env))  # what its supervisor does
            result = behind.result(60)  # the orchestrator ran it again, on the fresh worker
            assert result.ok and result.value == [1.0], result
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        srv.stop()


def test_the_servers_own_reward_model_worker_is_restarted_when_stuck() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TANGRAM_SERVER_GPU_STUCK_AFTER_S": "1"}
    srv = ServerProcess("--plugin", PLUGIN, env=env, cwd=ROOT)  # it starts and supervises "local-gpu"
    try:
        with Client(srv.address) as client:
            hung, behind = _hang_then_queue_behind(client, "local-gpu")
            assert hung.result(30).error_type == "timeout"
            result = behind.result(60)  # the worker exited stuck; the server started it again
            assert result.ok and result.value == [1.0], result
    finally:
        srv.stop()
