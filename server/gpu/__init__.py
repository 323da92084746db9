"""GPU resource manager: reward models hosted on devices, with batching, placement, eviction and replicas.

:class:`GpuRunner` is the runner a worker hosts for reward-model actions; the policies decide where
models live (:class:`LruReplicaPolicy` by default, :class:`StaticPolicy` as the benchmarks' baseline).
"""

from __future__ import annotations

from tangram_env.server.gpu.devices import DeviceSlot, cuda_devices, is_out_of_memory
from tangram_env.server.gpu.driver import run_grants, score_grant, wait_for
from tangram_env.server.gpu.models import RewardModelError, check_scores
from tangram_env.server.gpu.policy import LruReplicaPolicy, StaticPolicy
from tangram_env.server.gpu.runner import GpuRunner

__all__ = [
    "DeviceSlot",
    "GpuRunner",
    "LruReplicaPolicy",
    "RewardModelError",
    "StaticPolicy",
    "check_scores",
    "cuda_devices",
    "is_out_of_memory",
    "run_grants",
    "score_grant",
    "wait_for",
]
