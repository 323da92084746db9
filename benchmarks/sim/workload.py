"""A seeded workload shaped like agentic RL: synchronous steps of multi-turn trajectories.

Each RL step starts a batch of trajectories together and ends when the last one's reward is in; the
trainer then updates for ``update_s`` before the next step. A trajectory resets its sandbox, then
alternates LLM generation (a gap that holds nothing in Tangram) with one tool action per turn, and
ends with its reward action(s). Action run times are long-tailed (log-normal or Pareto) around each
kind's median; test runs shard over cores and reward scoring splits its batch over GPUs, both with an
Amdahl parallel fraction the scheduler does not know. More than one env kind shares the pool.

Everything random is drawn up front from ``seed`` (one generator per trajectory), so every policy
sees exactly the same work and the same seed gives the same numbers.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Literal

from tangram_env.server.scheduler.events import Resources
from tangram_env.server.scheduler.sandbox_memory import SandboxMemory


@dataclass(frozen=True)
class ActionKind:
    """One kind of action: its demand per unit, elasticity and (hidden) true duration law."""

    name: str
    demand: Resources
    median_s: float  # median run time on one unit
    sigma: float = 1.0  # log-normal shape (ignored for Pareto)
    parallel: float = 0.0  # true Amdahl parallel fraction
    min_par: int = 1
    max_par: int = 1
    dist: Literal["lognormal", "pareto"] = "lognormal"
    pareto_alpha: float = 1.8
    setup: Literal["sandbox", "model", "none"] = "sandbox"  # what a cold start must bring up
    cap_s: float = 1800.0  # run times are cut here (the kind's timeout)
    load_s: float | None = None  # loading its model onto a device (None: the workload's model_load_s)

    def draw(self, rng: random.Random) -> float:
        """One run time on one unit."""
        if self.dist == "pareto":
            # Pareto with the given median: x_m * 2**(1/alpha) = median.
            xm = self.median_s / 2 ** (1 / self.pareto_alpha)
            value = xm * rng.paretovariate(self.pareto_alpha)
        else:
            value = rng.lognormvariate(math.log(self.median_s), self.sigma)
        return min(value, self.cap_s)

    def run_s(self, t1: float, k: int) -> float:
        """Run time of work that takes ``t1`` on one unit, on ``k`` units."""
        return t1 * ((1 - self.parallel) + self.parallel / k)

    def mean_s(self) -> float:
        """Mean run time on one unit (ignoring the cut)."""
        if self.dist == "pareto":
            a = self.pareto_alpha
            xm = self.median_s / 2 ** (1 / a)
            return xm * a / (a - 1) if a > 1 else float("inf")
        return self.median_s * math.exp(self.sigma**2 / 2)


@dataclass(frozen=True)
class EnvKind:
    """One environment kind: its share of each batch, trajectory shape and trajectory-bound slot."""

    env_id: str
    image: str
    share: float
    reset: str
    turns: tuple[tuple[str, float], ...]  # kind -> probability, for the action of each turn
    rewards: tuple[str, ...]
    turns_mean: float
    turns_min: int
    turns_max: int
    gap_median_s: float  # LLM generation before each action
    gap_sigma: float
    slot: Resources  # what one trajectory holds from reset to close under trajectory-bound
    # Its sandbox's memory: the limit (the slot's memory), and the idle footprint held from create to
    # close (the server's default share of the limit; benchmarks/README.md argues it per workload).
    sandbox: SandboxMemory | None = None


def default_kinds() -> dict[str, ActionKind]:
    """The action kinds of the default workload (see benchmarks/README.md for why these numbers)."""
    gb = 1024
    # Commands run inside their sandbox: their memory is the sandbox's (WorkloadConfig.demand).
    kinds = [
        ActionKind("reset", Resources(1), median_s=2.0, sigma=0.5),
        ActionKind("bash", Resources(1), median_s=0.8, sigma=1.2),
        ActionKind("run_tests", Resources(1), median_s=40.0, sigma=0.8, parallel=0.92, max_par=16),
        ActionKind("exec_python", Resources(1), median_s=1.5, sigma=1.0),
        ActionKind(
            "score",
            Resources(1, 8 * gb, 1, 40 * gb),
            median_s=6.0,
            sigma=0.5,
            parallel=0.95,
            max_par=4,
            setup="model",
        ),
    ]
    return {k.name: k for k in kinds}


def default_envs() -> tuple[EnvKind, ...]:
    """The env kinds of the default workload: SWE-style coding and tool-using code/maths."""
    return (
        EnvKind(
            "swe",
            "swe-py",
            share=0.6,
            reset="reset",
            turns=(("bash", 0.85), ("run_tests", 0.15)),
            rewards=("run_tests",),
            turns_mean=12,
            turns_min=4,
            turns_max=30,
            gap_median_s=15.0,
            gap_sigma=0.6,
            slot=Resources(2, 2048),
            sandbox=SandboxMemory(2048),
        ),
        EnvKind(
            "code",
            "py-sci",
            share=0.4,
            reset="reset",
            turns=(("exec_python", 1.0),),
            rewards=("score",),
            turns_mean=6,
            turns_min=2,
            turns_max=12,
            gap_median_s=10.0,
            gap_sigma=0.6,
            slot=Resources(1, 1024),
            sandbox=SandboxMemory(1024),
        ),
    )


@dataclass(frozen=True)
class WorkloadConfig:
    """Everything that shapes the workload. ``trajectories`` is the batch size of each RL step."""

    seed: int = 0
    steps: int = 3
    trajectories: int = 64
    update_s: float = 30.0
    kinds: dict[str, ActionKind] = field(default_factory=default_kinds)
    envs: tuple[EnvKind, ...] = field(default_factory=default_envs)
    sandbox_create_s: float = 3.0  # median cold creation of a sandbox (log-normal, sigma 0.3)
    sandbox_reset_s: float = 0.3  # taking a warm one from the pool
    model_load_s: float = 8.0  # loading a reward model onto a GPU (kinds may set their own ``load_s``)
    sessions: bool = True  # actions run in their trajectory's sandbox (affinity); off for --real
    # A batch of reward requests for one model costs its longest item plus this fraction of each other
    # item: 0.2 gives 3.8x the throughput of one-by-one scoring at 13 items, what the GPU runner
    # measured on distinct answers (benchmarks.reward: 3.8x distinct, 11.6x with shared references).
    batch_marginal: float = 0.2

    def with_(self, **changes: object) -> WorkloadConfig:
        """A copy with ``changes``."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def gpu_kinds(self) -> frozenset[str]:
        """The kinds that need a GPU (what GPU workers serve)."""
        return frozenset(k.name for k in self.kinds.values() if k.demand.gpu > 0)

    def demand(self, kind: str, env: EnvKind) -> Resources:
        """Per unit, what an action of ``kind`` in ``env`` demands while it runs.

        A command in its trajectory's sandbox also holds what it may use of the sandbox's memory above
        the idle footprint (:meth:`SandboxMemory.command_mb`); the idle footprint is the session's.
        """
        k = self.kinds[kind]
        if not (self.sessions and k.setup == "sandbox" and env.sandbox is not None):
            return k.demand
        return k.demand + Resources(mem_mb=env.sandbox.command_mb(k.max_par))

    def load_s(self, kind: str) -> float:
        """Loading ``kind``'s model onto a device."""
        own = self.kinds[kind].load_s
        return self.model_load_s if own is None else own


@dataclass(frozen=True)
class PlannedAction:
    """One action of a trajectory, with its hidden run time on one unit."""

    action_id: str
    kind: str
    t1: float
    create_s: float  # what creating its sandbox would take, if it has to
    reward: bool


@dataclass(frozen=True)
class Trajectory:
    """One trajectory: its actions in order and the LLM gap before each (the first is 0: reset)."""

    traj_id: str
    env: EnvKind
    step: int
    actions: tuple[PlannedAction, ...]
    gaps: tuple[float, ...]


def _turns(env: EnvKind, rng: random.Random) -> int:
    # Geometric around the mean, clipped: most trajectories are short, some run long.
    p = 1.0 / max(1.0, env.turns_mean - env.turns_min + 1)
    n = env.turns_min + int(math.log(1.0 - rng.random()) / math.log(1.0 - p)) if p < 1 else env.turns_min
    return max(env.turns_min, min(env.turns_max, n))


def _pick(choices: tuple[tuple[str, float], ...], rng: random.Random) -> str:
    r, acc = rng.random(), 0.0
    for name, prob in choices:
        acc += prob
        if r < acc:
            return name
    return choices[-1][0]


def trajectory(cfg: WorkloadConfig, step: int, index: int) -> Trajectory:
    """The ``index``-th trajectory of RL step ``step`` (its own generator: independent of all others)."""
    rng = random.Random(f"{cfg.seed}/{step}/{index}")
    shares = [e.share for e in cfg.envs]
    env = rng.choices(cfg.envs, weights=shares)[0]
    tid = f"s{step}t{index}"
    names = [env.reset] + [_pick(env.turns, rng) for _ in range(_turns(env, rng))] + list(env.rewards)
    n_reward = len(env.rewards)
    actions = []
    for i, name in enumerate(names):
        kind = cfg.kinds[name]
        create = rng.lognormvariate(math.log(cfg.sandbox_create_s), 0.3)
        actions.append(PlannedAction(f"{tid}a{i}", name, kind.draw(rng), create, i >= len(names) - n_reward))
    gaps = [0.0] + [rng.lognormvariate(math.log(env.gap_median_s), env.gap_sigma) for _ in names[1:]]
    return Trajectory(tid, env, step, tuple(actions), tuple(gaps))


def generate(cfg: WorkloadConfig) -> list[list[Trajectory]]:
    """Every step's trajectories."""
    return [[trajectory(cfg, s, i) for i in range(cfg.trajectories)] for s in range(cfg.steps)]


def expected_kind_work(cfg: WorkloadConfig) -> dict[str, Resources]:
    """Each action kind's expected resource-seconds per trajectory (at one unit each)."""
    work: dict[str, Resources] = {}
    for env in cfg.envs:
        mean_turns = min(env.turns_max, max(env.turns_min, env.turns_mean))
        names = (
            [(env.reset, 1.0)] + [(k, p * mean_turns) for k, p in env.turns] + [(r, 1.0) for r in env.rewards]
        )
        for name, count in names:
            kind = cfg.kinds[name]
            held_s = kind.min_par * kind.run_s(kind.mean_s(), kind.min_par)
            add = kind.demand.scaled(held_s * count * env.share)
            work[name] = work.get(name, Resources()) + add
    return work


def expected_shares(cfg: WorkloadConfig) -> dict[str, Resources]:
    """Each env kind's expected share of CPU and GPU work (the static quotas of task-isolated pools)."""
    work: dict[str, list[float]] = {}
    for env in cfg.envs:
        mean_turns = min(env.turns_max, max(env.turns_min, env.turns_mean))
        names = (
            [(env.reset, 1.0)] + [(k, p * mean_turns) for k, p in env.turns] + [(r, 1.0) for r in env.rewards]
        )
        acc = [0.0, 0.0, 0.0, 0.0]
        for name, count in names:
            kind = cfg.kinds[name]
            d = cfg.demand(name, env)
            t = kind.mean_s() * count * env.share
            for i, amount in enumerate((d.cpu, d.mem_mb, d.gpu, d.gpu_mem_mb)):
                acc[i] += amount * t
        work[env.env_id] = acc
    totals = [sum(w[i] for w in work.values()) or 1.0 for i in range(4)]
    return {env: Resources(*(w[i] / totals[i] for i in range(4))) for env, w in work.items()}
