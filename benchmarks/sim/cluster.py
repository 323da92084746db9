"""The simulated pool: CPU workers and GPU workers (GPU workers serve only GPU kinds)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tangram_env.server.scheduler.events import Resources, WorkerAdded

#: Weights that turn a pool's resources into one figure, in cores: one GPU counts as 16 cores and one
#: GiB of memory as a quarter of a core (the default pool's own ratios: a 32-core worker has 128 GiB,
#: and there is one GPU per 16 cores). Resource-seconds and pool savings use the same weights.
GPU_WEIGHT = 16.0
MEM_WEIGHT_PER_GIB = 0.25


def weighted(r: Resources) -> float:
    """``r`` in core-equivalents (see :data:`GPU_WEIGHT` and :data:`MEM_WEIGHT_PER_GIB`)."""
    return r.cpu + GPU_WEIGHT * r.gpu + MEM_WEIGHT_PER_GIB * r.mem_mb / 1024


@dataclass(frozen=True)
class ClusterSpec:
    """A pool of identical CPU workers and GPU workers of ``gpus_per_worker`` GPUs each.

    ``gpu_remainder`` GPUs (fewer than ``gpus_per_worker``) sit on one more, smaller GPU worker with
    cores and memory in proportion: that is how a pool scaled by a fraction keeps its GPU count
    faithful (:meth:`scaled`).
    """

    cpu_workers: int = 2
    cores_per_worker: float = 32
    mem_mb_per_worker: float = 128 * 1024
    gpu_workers: int = 1
    gpus_per_worker: int = 4
    gpu_mem_mb_per_gpu: float = 80 * 1024
    gpu_worker_cores: float = 16
    gpu_worker_mem_mb: float = 256 * 1024
    gpu_kinds: frozenset[str] = frozenset({"score"})
    gpu_remainder: int = 0

    @classmethod
    def for_cores(
        cls, cores: int, cores_per_gpu: int = 16, gpu_kinds: frozenset[str] = frozenset({"score"})
    ) -> ClusterSpec:
        """A pool of ``cores`` CPU cores in 32-core workers, with one GPU per ``cores_per_gpu`` cores.

        No GPUs at all when no kind needs one (``gpu_kinds`` empty).
        """
        gpus = max(1, cores // cores_per_gpu) if gpu_kinds else 0
        return cls(cpu_workers=max(1, cores // 32), gpu_kinds=gpu_kinds).with_gpus(gpus)

    def with_gpus(self, gpus: int) -> ClusterSpec:
        """The same pool with ``gpus`` GPUs in all (full workers, then one smaller worker for the rest)."""
        gpus = max(0, gpus)
        return replace(
            self, gpu_workers=gpus // self.gpus_per_worker, gpu_remainder=gpus % self.gpus_per_worker
        )

    def scaled(self, f: float) -> ClusterSpec:
        """The same pool with every resource times ``f``.

        CPU workers keep their number and get ``f`` of their cores (rounded, at least one) and memory;
        the GPU count is rounded (at least one) and laid out as in :meth:`with_gpus`, so that each
        resource of the pool scales by ``f`` as nearly as whole cores and GPUs allow.
        """
        return replace(
            self,
            cores_per_worker=max(1.0, round(self.cores_per_worker * f)),
            mem_mb_per_worker=self.mem_mb_per_worker * f,
        ).with_gpus(max(1, round(self.gpus * f)) if self.gpus else 0)

    def grown(self, cores: float) -> ClusterSpec:
        """The same pool with at least ``cores`` CPU cores (more workers) and GPUs in the same ratio."""
        factor = cores / self.cores
        if factor <= 1:
            return self
        workers = math.ceil(cores / self.cores_per_worker)
        return replace(self, cpu_workers=workers).with_gpus(math.ceil(self.gpus * workers / self.cpu_workers))

    @property
    def cores(self) -> float:
        """CPU cores of the CPU workers (what the scale is named by)."""
        return self.cpu_workers * self.cores_per_worker

    @property
    def gpus(self) -> int:
        """GPU units in all."""
        return self.gpu_workers * self.gpus_per_worker + self.gpu_remainder

    def _gpu_worker(self, gpus: int) -> Resources:
        share = gpus / self.gpus_per_worker
        return Resources(
            self.gpu_worker_cores * share,
            self.gpu_worker_mem_mb * share,
            float(gpus),
            gpus * self.gpu_mem_mb_per_gpu,
        )

    def capacity(self) -> Resources:
        """Everything the pool has."""
        total = Resources(self.cores, self.cpu_workers * self.mem_mb_per_worker)
        for w in self.workers()[self.cpu_workers :]:
            total = total + w.capacity
        return total

    def workers(self) -> list[WorkerAdded]:
        """The registration events of every worker."""
        out = [
            WorkerAdded(f"cpu{i}", Resources(self.cores_per_worker, self.mem_mb_per_worker))
            for i in range(self.cpu_workers)
        ]
        full = self._gpu_worker(self.gpus_per_worker)
        out += [WorkerAdded(f"gpu{i}", full, kinds=self.gpu_kinds) for i in range(self.gpu_workers)]
        if self.gpu_remainder:
            out.append(
                WorkerAdded(
                    f"gpu{self.gpu_workers}", self._gpu_worker(self.gpu_remainder), kinds=self.gpu_kinds
                )
            )
        return out
