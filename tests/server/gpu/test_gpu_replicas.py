"""Elastic replicas across devices, batch splits by parallelism, retirement, and static placement.

Two "devices" here are two CPU slots (``devices=["cpu", "cpu"]``): separate threads and budgets on
the same host, which is what the placement logic needs to be exercised honestly without a GPU.
"""

from __future__ import annotations

import time

from tangram_env.kinds import RewardModel, reward_model
from tangram_env.server.gpu import LruReplicaPolicy, StaticPolicy, run_grants, score_grant


def test_a_backlogged_model_gets_a_replica_on_the_free_device(make_runner, affine_model):
    calls = affine_model(max_batch=1, max_wait_ms=0, score_delay_s=0.15, load_delay_s=0.05)
    runner = make_runner(devices=["cpu", "cpu"])
    run_grants(runner, [score_grant("affine", [0.0])])  # measured: a load is cheaper than the backlog
    grants = [score_grant("affine", [float(i)]) for i in range(8)]
    results = run_grants(runner, grants)
    assert [r.value for r in results] == [[2.0 * i + 1.0] for i in range(8)]
    assert len(calls.loads) == 2 and set(calls.loads) == {"cpu"}
    stats = runner.stats()["models"]["affine"]
    assert stats["replicas"] == 2 and stats["loaded_on"] == ["cpu#0", "cpu#1"]
    assert {d["device"] for d in runner.stats()["devices"] if "affine" in d["models"]} == {"cpu#0", "cpu#1"}


def test_no_replica_when_loading_costs_more_than_waiting(make_runner, affine_model):
    calls = affine_model(max_batch=8, max_wait_ms=0, load_delay_s=0.5)
    runner = make_runner(devices=["cpu", "cpu"])
    run_grants(runner, [score_grant("affine", [0.0])])
    run_grants(runner, [score_grant("affine", [float(i)]) for i in range(6)])
    assert len(calls.loads) == 1


def test_parallelism_splits_one_action_across_replicas(make_runner, affine_model):
    calls = affine_model(max_batch=4, max_wait_ms=0, score_delay_s=0.2, load_delay_s=0.01)
    runner = make_runner(devices=["cpu", "cpu"])
    run_grants(runner, [score_grant("affine", [0.0])])
    run_grants(runner, [score_grant("affine", [float(i)]) for i in range(12)])  # backlog: a 2nd replica
    assert runner.stats()["models"]["affine"]["replicas"] == 2
    calls.forwards.clear()
    calls.threads.clear()
    items = [float(i) for i in range(8)]
    (result,) = run_grants(runner, [score_grant("affine", items, parallelism=2)])
    assert result.ok and result.value == [2.0 * x + 1.0 for x in items]
    assert result.parallelism == 2
    assert [n for n, _ in calls.forwards] == [4, 4]
    assert sorted(calls.threads) == ["tangram-gpu-cpu#0", "tangram-gpu-cpu#1"]  # one half on each device


def test_parallelism_one_keeps_an_action_on_one_batch_at_a_time(make_runner, affine_model):
    calls = affine_model(max_batch=4, max_wait_ms=0)
    runner = make_runner(devices=["cpu", "cpu"])
    (result,) = run_grants(runner, [score_grant("affine", [float(i) for i in range(8)])])
    assert result.ok and [n for n, _ in calls.forwards] == [4, 4]


def test_an_idle_extra_replica_is_retired(make_runner, affine_model):
    calls = affine_model(max_batch=1, max_wait_ms=0, score_delay_s=0.15, load_delay_s=0.02)
    runner = make_runner(devices=["cpu", "cpu"], policy=LruReplicaPolicy(retire_idle_s=0.3))
    run_grants(runner, [score_grant("affine", [0.0])])
    run_grants(runner, [score_grant("affine", [float(i)]) for i in range(6)])
    assert len(calls.loads) == 2
    deadline = time.monotonic() + 10
    while runner.stats()["models"]["affine"]["replicas"] > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = runner.stats()["models"]["affine"]
    assert stats["replicas"] == 1 and stats["retirements"] == 1 and len(calls.unloads) == 1


def test_static_placement_pins_each_model_to_its_device(make_runner, affine_model):
    a = affine_model("a", max_batch=1, max_wait_ms=0, score_delay_s=0.1, load_delay_s=0.01)
    b = affine_model("b", max_batch=1, max_wait_ms=0)
    runner = make_runner(devices=["cpu", "cpu"], policy=StaticPolicy({"a": 1, "b": 0}))
    run_grants(runner, [score_grant("a", [float(i)]) for i in range(6)] + [score_grant("b", [1.0])])
    assert len(a.loads) == 1 and len(b.loads) == 1  # no replica of a despite its backlog
    models = runner.stats()["models"]
    assert models["a"]["loaded_on"] == ["cpu#1"] and models["b"]["loaded_on"] == ["cpu#0"]


def test_an_extra_replica_that_fails_to_load_leaves_the_queue_to_the_first(make_runner, registry):
    loads = []

    @reward_model(name="half_broken", gpu=0.1, max_batch=1, max_wait_ms=0, registry=registry)
    class HalfBroken(RewardModel):
        def load(self, device: str) -> None:
            loads.append(device)
            time.sleep(0.02)
            if len(loads) == 2:
                raise OSError("second device's copy of the weights is unreadable")

        def score(self, batch: list[float]) -> list[float]:
            time.sleep(0.15)
            return [2.0 * x for x in batch]

    runner = make_runner(devices=["cpu", "cpu"])
    run_grants(runner, [score_grant("half_broken", [0.0])])  # measured: a load is cheaper than the backlog
    results = run_grants(runner, [score_grant("half_broken", [float(i)]) for i in range(8)])
    # the failed replica's load failed none of the waiting actions: the loaded replica scored them all
    assert [r.value for r in results] == [[2.0 * i] for i in range(8)]
    stats = runner.stats()["models"]["half_broken"]
    assert stats["load_failures"] == 1 and stats["replicas"] == 1
    assert len(loads) == 2  # not retried on the failing device while the backlog lasted


def test_a_model_raising_system_exit_fails_its_action_and_the_device_keeps_serving(make_runner, affine_model):
    affine_model(fail={-1.0: SystemExit(3), -2.0: KeyboardInterrupt()}, max_wait_ms=0)
    runner = make_runner()
    (exits,) = run_grants(runner, [score_grant("affine", [-1.0])])
    (interrupted,) = run_grants(runner, [score_grant("affine", [-2.0])])
    assert exits.error_type == "model_error" and "SystemExit: 3" in exits.message
    assert interrupted.error_type == "model_error" and "KeyboardInterrupt" in interrupted.message
    (after,) = run_grants(runner, [score_grant("affine", [1.0])], timeout_s=10)
    assert after.ok and after.value == [3.0]
