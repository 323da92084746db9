"""Memory budget, load on demand and least-recently-used eviction in the GPU runner."""

from __future__ import annotations

from tangram_env.kinds import RewardModel, reward_model
from tangram_env.server.gpu import run_grants, score_grant


def test_least_recently_used_model_is_evicted_when_a_new_one_does_not_fit(make_runner, affine_model):
    a, b, _c = (affine_model(name, memory_mb=100, max_wait_ms=0) for name in "abc")
    runner = make_runner(mem_budget_mb=250)  # room for two of the three
    for name in ["a", "b", "a"]:  # b is now the least recently used
        assert run_grants(runner, [score_grant(name, [1.0])])[0].ok
    assert (len(a.loads), len(b.loads)) == (1, 1)
    run_grants(runner, [score_grant("c", [1.0])])
    assert b.unloads == ["cpu"] and a.unloads == []
    models = runner.stats()["models"]
    assert models["a"]["loaded_on"] == ["cpu"] and models["c"]["loaded_on"] == ["cpu"]
    assert models["b"]["loaded_on"] == [] and models["b"]["evictions"] == 1
    run_grants(runner, [score_grant("b", [1.0])])  # b comes back: a is now the oldest
    assert a.unloads == ["cpu"] and len(b.loads) == 2
    device = runner.stats()["devices"][0]
    assert device["models"] == ["b", "c"] and device["used_mb"] == 200.0


def test_models_that_fit_together_are_all_kept(make_runner, affine_model):
    calls = [affine_model(name, memory_mb=100, max_wait_ms=0) for name in "abc"]
    runner = make_runner(mem_budget_mb=300)
    for name in "abcabc":
        run_grants(runner, [score_grant(name, [1.0])])
    assert [len(c.loads) for c in calls] == [1, 1, 1]
    assert all(c.unloads == [] for c in calls)


def test_a_model_larger_than_any_device_fails_with_the_reason(make_runner, affine_model):
    affine_model("huge", memory_mb=4000)
    runner = make_runner(mem_budget_mb=1000)
    (result,) = run_grants(runner, [score_grant("huge", [1.0])])
    assert not result.ok and result.error_type == "model_error"
    assert "needs 4000 MiB" in result.message and "1000 MiB" in result.message


def test_measured_size_replaces_the_declared_one(make_runner, registry):
    @reward_model(name="grows", gpu=0.5, registry=registry)
    class Grows(RewardModel):
        memory_mb = 10

        def load(self, device: str) -> None:
            self.memory_mb = 60  # what it found once loaded

        def score(self, batch: list[float]) -> list[float]:
            return [0.0] * len(batch)

    runner = make_runner(mem_budget_mb=100)
    run_grants(runner, [score_grant("grows", [1])])
    assert runner.stats()["models"]["grows"]["memory_mb"] == 60.0
    assert runner.stats()["devices"][0]["used_mb"] == 60.0


def test_capacity_counts_devices_and_sums_budgets(make_runner):
    runner = make_runner(devices=["cpu", "cpu"], mem_budget_mb=512)
    cap = runner.capacity()
    assert cap.gpu == 2.0 and cap.gpu_mem_mb == 1024.0
    assert cap.cpu == 2.0  # one feeding core per device, not the host's cores (its CPU worker has those)
    labels = [d["device"] for d in runner.stats()["devices"]]
    assert labels == ["cpu#0", "cpu#1"]  # host-lane slots come with their models
    assert make_runner(devices=None).capacity().gpu >= 1.0  # CUDA devices, or the CPU as one device
