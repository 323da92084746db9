"""The workload shapes ``benchmarks.act`` runs, each argued from public descriptions of agentic RL.

A shape is a :class:`~benchmarks.sim.workload.WorkloadConfig` (action kinds and env kinds) plus how
big its batch is per core and how many cores share a GPU in its pool. The scheduler sees none of
this: every policy gets the same events whatever the shape (benchmarks/README.md argues the numbers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.sim.workload import ActionKind, EnvKind, WorkloadConfig, default_envs, default_kinds
from tangram_env.server.scheduler.events import Resources
from tangram_env.server.scheduler.sandbox_memory import SandboxMemory

GB = 1024


@dataclass(frozen=True)
class Shape:
    """One workload shape: how to build it, its batch per core and its pool's cores per GPU."""

    name: str
    summary: str
    build: Callable[[], WorkloadConfig]
    per_core: float = 2.0
    cores_per_gpu: int = 16

    def workload(self, seed: int, steps: int, cores: int, per_core: float | None = None) -> WorkloadConfig:
        """The shape's workload for a pool of ``cores`` CPU cores (``per_core`` overrides the batch)."""
        n = round((self.per_core if per_core is None else per_core) * cores)
        return self.build().with_(seed=seed, steps=steps, trajectories=max(1, n))


def _default() -> WorkloadConfig:
    return WorkloadConfig()


def _swe_fast() -> WorkloadConfig:
    # SWE agents (SWE-agent / OpenHands style) on repository tasks: long episodes of shell and editor
    # calls (tens of turns, up to 100), targeted test runs, a full test suite as the reward; inference
    # fast enough (a small policy on dedicated GPUs, short per-turn outputs) that the sandbox, not the
    # model, is what a trajectory waits on most of the time.
    kinds = [
        ActionKind("reset", Resources(1), median_s=4.0, sigma=0.5),
        ActionKind("bash", Resources(1), median_s=0.6, sigma=1.3),
        ActionKind("edit", Resources(0.25), median_s=0.15, sigma=0.5),
        ActionKind("run_tests", Resources(1), median_s=15.0, sigma=0.9, parallel=0.85, max_par=8),
        ActionKind("full_tests", Resources(1), median_s=90.0, sigma=0.7, parallel=0.93, max_par=16),
    ]
    env = EnvKind(
        "swe",
        "swe-repo",
        share=1.0,
        reset="reset",
        turns=(("bash", 0.5), ("edit", 0.38), ("run_tests", 0.12)),
        rewards=("full_tests",),
        turns_mean=40,
        turns_min=10,
        turns_max=100,
        gap_median_s=3.0,
        gap_sigma=0.7,
        slot=Resources(2, 3 * GB),
        sandbox=SandboxMemory(3 * GB),
    )
    return WorkloadConfig(kinds={k.name: k for k in kinds}, envs=(env,), sandbox_create_s=6.0)


def _judge_kinds() -> list[ActionKind]:
    # Reward models as GPU deployments: a 7B reward model (one GPU, splits its batch over two), a small
    # safety classifier, and a 70B LLM judge that needs two GPUs (its weights do not fit in one).
    return [
        ActionKind(
            "rm_7b",
            Resources(1, 4 * GB, 1, 20 * GB),
            median_s=3.0,
            sigma=0.5,
            parallel=0.9,
            max_par=2,
            setup="model",
            load_s=6.0,
        ),
        ActionKind(
            "safety", Resources(1, 2 * GB, 1, 8 * GB), median_s=0.8, sigma=0.4, setup="model", load_s=3.0
        ),
        ActionKind(
            "judge",
            Resources(2, 16 * GB, 1, 70 * GB),
            median_s=24.0,
            sigma=0.6,
            parallel=0.9,
            min_par=2,
            max_par=4,
            setup="model",
            load_s=30.0,
        ),
    ]


def _gpu_judged() -> WorkloadConfig:
    # RLHF-style and verifiable-reasoning tasks judged on GPUs: short tool use (search, a Python
    # interpreter), then several reward models per trajectory (a reward model and a safety classifier
    # for chat; an LLM judge for open-ended maths). GPU-heavy: one GPU per 4 cores.
    kinds = [
        ActionKind("reset", Resources(1), median_s=1.0, sigma=0.5),
        ActionKind("search", Resources(0.5, 256), median_s=0.5, sigma=0.8, setup="none"),
        ActionKind("exec_python", Resources(1), median_s=1.2, sigma=1.0),
        *_judge_kinds(),
    ]
    envs = (
        EnvKind(
            "chat",
            "tools",
            share=0.5,
            reset="reset",
            turns=(("search", 0.7), ("exec_python", 0.3)),
            rewards=("rm_7b", "safety"),
            turns_mean=4,
            turns_min=1,
            turns_max=8,
            gap_median_s=6.0,
            gap_sigma=0.6,
            slot=Resources(1, 1 * GB),
            sandbox=SandboxMemory(1 * GB),
        ),
        EnvKind(
            "math",
            "py-sci",
            share=0.5,
            reset="reset",
            turns=(("exec_python", 1.0),),
            rewards=("judge",),
            turns_mean=5,
            turns_min=2,
            turns_max=10,
            gap_median_s=12.0,
            gap_sigma=0.6,
            slot=Resources(1, 1 * GB),
            sandbox=SandboxMemory(1 * GB),
        ),
    )
    return WorkloadConfig(kinds={k.name: k for k in kinds}, envs=envs)


def _mixed() -> WorkloadConfig:
    # A mixed fleet: the default SWE and code envs beside a browser agent (a heavy sandbox: a headless
    # browser) and GPU-judged chat, all on one pool.
    kinds = {**default_kinds(), **{k.name: k for k in _judge_kinds() if k.name != "judge"}}
    kinds["browse"] = ActionKind("browse", Resources(1), median_s=2.5, sigma=0.8)
    swe, code = default_envs()
    envs = (
        EnvKind(**{**swe.__dict__, "share": 0.35}),
        EnvKind(**{**code.__dict__, "share": 0.25}),
        EnvKind(
            "web",
            "browser",
            share=0.2,
            reset="reset",
            turns=(("browse", 1.0),),
            rewards=("rm_7b",),
            turns_mean=15,
            turns_min=5,
            turns_max=30,
            gap_median_s=8.0,
            gap_sigma=0.6,
            slot=Resources(1, 3 * GB),
            sandbox=SandboxMemory(3 * GB),
        ),
        EnvKind(
            "chat",
            "tools",
            share=0.2,
            reset="reset",
            turns=(("exec_python", 1.0),),
            rewards=("rm_7b", "safety"),
            turns_mean=3,
            turns_min=1,
            turns_max=6,
            gap_median_s=6.0,
            gap_sigma=0.6,
            slot=Resources(1, 1 * GB),
            sandbox=SandboxMemory(1 * GB),
        ),
    )
    return WorkloadConfig(kinds=kinds, envs=envs)


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("default", "SWE-style coding (60%) and code/maths with a GPU reward model (40%)", _default),
        Shape(
            "swe_fast",
            "SWE agents: 10-100 turns, 3 s inference gaps, a full test suite as reward",
            _swe_fast,
            per_core=1.0,
        ),
        Shape(
            "gpu_judged",
            "short tool use judged by three reward models (7B RM, safety classifier, 2-GPU 70B judge)",
            _gpu_judged,
            per_core=1.0,
            cores_per_gpu=4,
        ),
        Shape("mixed", "SWE, code, browser agents and GPU-judged chat on one pool", _mixed, cores_per_gpu=8),
    )
}
