"""Orchestrator settings: resolved once at the edge (CLI flags over ``TANGRAM_SERVER_*`` variables)."""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tangram_env.units import Bytes, MiB, Seconds


def _total_mem_mb() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20)
    except (ValueError, OSError):
        return 4096


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class RaySettings(BaseSettings):
    """Attaching to a Ray cluster (``tangram-server --ray``). Each field also reads ``TANGRAM_RAY_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="TANGRAM_RAY_", extra="forbid")

    address: str | None = Field(
        None, description="Ray cluster to attach to: auto, ray://HOST:PORT, HOST:PORT, local; unset: no Ray"
    )
    namespace: str = Field("tangram", description="Ray namespace of the worker actors")
    runtime_env: dict[str, Any] | None = Field(
        None, description="Ray runtime environment of the worker actors (pip, py_modules, env_vars ...)"
    )
    node_resource: str | None = Field(
        None, description="only nodes that declare this custom Ray resource get a worker; unset: every node"
    )
    reserve_cpu: float = Field(0.0, ge=0, description="cores per node left to other Ray work")
    reserve_mem: MiB = Field(0, description="memory per node left to other Ray work")
    reserve_gpu: float = Field(0.0, ge=0, description="GPUs per node left to other Ray work")
    max_restarts: int = Field(-1, ge=-1, description="restarts Ray gives a crashed worker actor (-1: always)")
    poll_s: Seconds = Field(1.0, gt=0, description="how often Ray's node table is read")
    autoscale: bool = Field(
        True, description="ask Ray's autoscaler for nodes when the queue outgrows the pool"
    )
    scale_up_after_s: Seconds = Field(
        5.0, description="queued demand must exceed free capacity this long before a request"
    )
    release_after_s: Seconds = Field(60.0, description="an idle pool releases its request after this long")
    max_cpus: float = Field(1024.0, ge=0, description="most CPUs a request asks for (the pool included)")
    max_gpus: float = Field(64.0, ge=0, description="most GPUs a request asks for (the pool included)")


class ServerSettings(BaseSettings):
    """Everything the orchestrator needs to start. Each field also reads ``TANGRAM_SERVER_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="TANGRAM_SERVER_", extra="forbid")

    bind: str = Field("tcp://127.0.0.1:5555", description="ZeroMQ address clients and workers connect to")
    plugins: list[str] = Field(
        default_factory=list, description="modules to import for tools and reward models"
    )
    plugin_files: list[str] = Field(default_factory=list, description="script files imported as plugins")
    entry_point_plugins: bool = Field(True, description="also import the `tangram_env.plugins` entry points")
    cpus: float = Field(default_factory=_usable_cpus, gt=0, description="cores the local executor lends")
    mem_mb: MiB = Field(default_factory=lambda: int(_total_mem_mb() * 0.8), description="memory it lends")
    scheduler: str = Field("", description="scheduling policy; empty: the default policy")
    max_body: Bytes = Field(16 * 2**20, description="largest message body accepted (checked before decoding)")
    result_ttl_s: Seconds = Field(600.0, description="unacknowledged results are kept this long")
    worker_timeout_s: Seconds = Field(10.0, description="a worker silent this long is declared lost")
    sandbox_provider: str = Field(
        "local", description="sandbox provider: local (isolated), e2b, docker, none, or a declared one"
    )
    gpu_worker: bool = Field(True, description="start a local reward-model worker when reward models exist")
    state_db: str | None = Field(
        None, description="SQLite file that keeps the queue and results across restarts"
    )
    max_queued_per_client: int = Field(
        20_000, ge=1, description="outstanding actions per client before 'busy'"
    )
    max_retries: int = Field(2, ge=0, description="times an action is requeued after its worker is lost")
    client_timeout_s: Seconds = Field(
        60.0, description="a client silent this long has its queued work cancelled"
    )
    curve_secret_key_file: str | None = Field(
        None, description="CurveZMQ secret key file (tangram-server keygen)"
    )
    curve_clients_dir: str | None = Field(None, description="public keys of the only clients to accept")
    metrics_port: int | None = Field(None, description="serve Prometheus metrics on this port (0: any)")
    parent_pid: int | None = Field(None, description="exit when this process dies (embedded mode)")
    allow_remote: bool = Field(
        False, description="accept a non-loopback bind (CurveZMQ keys are still required)"
    )
    ray: RaySettings = Field(
        default_factory=RaySettings, description="Ray cluster to take workers from (docs/ray.md)"
    )

    @field_validator("bind")
    @classmethod
    def _known_transport(cls, value: str) -> str:
        if not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"bind address {value!r} must start with tcp://, ipc:// or inproc://")
        return value
