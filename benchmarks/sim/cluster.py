"""The simulated pool: CPU workers and GPU workers (GPU workers serve only GPU kinds)."""

from __future__ import annotations

from dataclasses import dataclass

from tangram_env.server.scheduler.events import Resources, WorkerAdded


@dataclass(frozen=True)
class ClusterSpec:
    """A pool of identical CPU workers and identical GPU workers."""

    cpu_workers: int = 2
    cores_per_worker: float = 32
    mem_mb_per_worker: float = 128 * 1024
    gpu_workers: int = 1
    gpus_per_worker: float = 4
    gpu_mem_mb_per_gpu: float = 80 * 1024
    gpu_worker_cores: float = 16
    gpu_worker_mem_mb: float = 256 * 1024
    gpu_kinds: frozenset[str] = frozenset({"score"})

    @classmethod
    def for_cores(cls, cores: int, cores_per_gpu: int = 16) -> ClusterSpec:
        """A pool of ``cores`` CPU cores in 32-core workers, with one GPU per ``cores_per_gpu`` cores."""
        return cls(cpu_workers=max(1, cores // 32), gpu_workers=max(1, cores // cores_per_gpu // 4))

    def scaled(self, f: float) -> ClusterSpec:
        """The same topology with every worker's capacity times ``f`` (at least one core and one GPU)."""
        return ClusterSpec(
            cpu_workers=self.cpu_workers,
            cores_per_worker=max(1.0, round(self.cores_per_worker * f)),
            mem_mb_per_worker=self.mem_mb_per_worker * f,
            gpu_workers=self.gpu_workers,
            gpus_per_worker=max(1.0, round(self.gpus_per_worker * f)),
            gpu_mem_mb_per_gpu=self.gpu_mem_mb_per_gpu,
            gpu_worker_cores=max(1.0, round(self.gpu_worker_cores * f)),
            gpu_worker_mem_mb=self.gpu_worker_mem_mb * max(f, 0.25),
            gpu_kinds=self.gpu_kinds,
        )

    @property
    def cores(self) -> float:
        """CPU cores of the CPU workers (what the scale is named by)."""
        return self.cpu_workers * self.cores_per_worker

    @property
    def gpus(self) -> float:
        """GPU units in all."""
        return self.gpu_workers * self.gpus_per_worker

    def capacity(self) -> Resources:
        """Everything the pool has."""
        return Resources(
            self.cores + self.gpu_workers * self.gpu_worker_cores,
            self.cpu_workers * self.mem_mb_per_worker + self.gpu_workers * self.gpu_worker_mem_mb,
            self.gpus,
            self.gpus * self.gpu_mem_mb_per_gpu,
        )

    def workers(self) -> list[WorkerAdded]:
        """The registration events of every worker."""
        out = [
            WorkerAdded(f"cpu{i}", Resources(self.cores_per_worker, self.mem_mb_per_worker))
            for i in range(self.cpu_workers)
        ]
        gpu_cap = Resources(
            self.gpu_worker_cores,
            self.gpu_worker_mem_mb,
            self.gpus_per_worker,
            self.gpus_per_worker * self.gpu_mem_mb_per_gpu,
        )
        out += [WorkerAdded(f"gpu{i}", gpu_cap, kinds=self.gpu_kinds) for i in range(self.gpu_workers)]
        return out
