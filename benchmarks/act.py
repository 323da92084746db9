"""ACT benchmark: Tangram's elastic scheduler against four baselines, on several agentic-RL workloads.

    python -m benchmarks.act                 # tables per workload at 64, 512 and 4,096 cores, and a plot
                                             # in benchmarks/out/ (--save-plot: also benchmarks/plots/)
    python -m benchmarks.act --json          # one JSON object (see benchmarks/README.md)
    python -m benchmarks.act --quick         # the default workload, 64 cores, one step (what tests run)
    python -m benchmarks.act --workloads default,swe_fast
    python -m benchmarks.act --real          # also the scaled-down workload on the real orchestrator
    python -m benchmarks.act --decision-cost # also the scheduler's decision cost (benchmarks.scheduler_cost)

Every policy is the real scheduler object the server runs, driven by the discrete-event simulator of
:mod:`benchmarks.sim`. Tangram is ``ElasticScheduler()`` with the server's defaults, whatever the
workload. The baselines: trajectory-bound on the same pool (trajectories queue for slots) and on a
pool over-provisioned so that every trajectory of a step holds a slot at once; task-isolated quotas;
action-level FCFS. Tangram and FCFS also run along a sweep of smaller pools (which pools depends on
the scale alone, see ``sweep``), which gives the pool and resource-seconds Tangram needs to match each
baseline's mean ACT (:mod:`benchmarks.act_report`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from benchmarks.act_report import (
    OUT,
    PLOTS,
    assemble,
    floors,
    plot,
    print_tables,
)
from benchmarks.sim.cluster import GPU_WEIGHT, MEM_WEIGHT_PER_GIB, ClusterSpec, weighted
from benchmarks.sim.shapes import SHAPES, Shape
from benchmarks.sim.simulator import simulate
from benchmarks.sim.workload import WorkloadConfig, expected_kind_work, expected_shares, generate
from tangram_env.server.scheduler import (
    ElasticScheduler,
    FCFSScheduler,
    TaskIsolatedScheduler,
    TrajectoryBoundScheduler,
)
from tangram_env.server.scheduler.events import Resources, Scheduler

TANGRAM = "elastic"
TB_OVER = "trajectory_bound_over"
BASELINES = (TB_OVER, "trajectory_bound", "task_isolated", "fcfs")
POLICIES = (TANGRAM, *BASELINES)
#: Pool sizes (fractions of the base pool) Tangram and FCFS run along, by scale: the seven-pool grid
#: below 256 cores, five pools below 2,048, three above (for time). Which pools a floor covers
#: depends on the scale only, never on whether a plot is drawn (see ``sweep``).
GRID = (1.0, 0.75, 0.5, 0.35, 0.25, 0.18, 0.125)
SWEEP = (1.0, 0.75, 0.5, 0.35, 0.25)
SWEEP_LARGE = (1.0, 0.5, 0.25)
#: Policies that run along the sweep at every scale (the rest run at the full pool, and along the
#: sweep at the plotted scale, for the plot only).
SWEPT = (TANGRAM, "fcfs")


def sweep(cores: int) -> tuple[float, ...]:
    """The pool fractions Tangram and FCFS run along at ``cores`` (the pools the floors cover)."""
    return GRID if cores < 256 else SWEEP if cores < 2048 else SWEEP_LARGE


def gpu_replicas(workload: WorkloadConfig, gpus: float) -> dict[str, tuple[int, Resources]]:
    """Fixed reward-model replicas for trajectory-bound: the GPUs split by each kind's expected GPU work.

    A replica is one action at ``min_par`` units; every GPU kind gets at least one.
    """
    work = expected_kind_work(workload)
    kinds = [k for k in workload.kinds.values() if k.demand.gpu > 0]
    total = sum(work.get(k.name, Resources()).gpu for k in kinds) or 1.0
    out: dict[str, tuple[int, Resources]] = {}
    for k in kinds:
        one = k.demand.scaled(k.min_par)
        share = gpus * work.get(k.name, Resources()).gpu / total
        out[k.name] = (max(1, int(share / one.gpu + 1e-9)), one)
    return out


def over_provisioned(workload: WorkloadConfig, cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` grown until every trajectory of the busiest step holds its slot at once (GPUs in ratio)."""
    need_cpu = need_mem = 0.0
    for step in generate(workload):
        cpu = sum(t.env.slot.cpu for t in step)
        mem = sum(t.env.slot.mem_mb for t in step)
        need_cpu, need_mem = max(need_cpu, cpu), max(need_mem, mem)
    per_worker = min(cluster.cores_per_worker, cluster.mem_mb_per_worker * need_cpu / max(need_mem, 1.0))
    # Slots are whole: leave a worker's worth of slack for the cores no slot can use.
    return cluster.grown(math.ceil(need_cpu / per_worker + 1) * cluster.cores_per_worker)


def make_policy(name: str, workload: WorkloadConfig, cluster: ClusterSpec) -> Scheduler:
    """The scheduler object of policy ``name``, configured for ``workload`` where a baseline needs it."""
    if name == TANGRAM:
        return ElasticScheduler()  # exactly the server's default
    if name == "fcfs":
        return FCFSScheduler()
    if name == "task_isolated":
        return TaskIsolatedScheduler(quotas=expected_shares(workload))
    if name in ("trajectory_bound", TB_OVER):  # the pool differs (see Job.cluster), not the policy
        return TrajectoryBoundScheduler(
            slot={env.env_id: env.slot for env in workload.envs},
            rm_replicas=gpu_replicas(workload, cluster.gpus),
            idle_release_s=float("inf"),  # the simulator closes every trajectory
        )
    raise ValueError(f"unknown policy {name!r}; choose one of {POLICIES}")


@dataclass(frozen=True)
class Job:
    """One simulated run: a policy on a workload shape, on a pool (``over``: the over-provisioned one)."""

    shape: str
    policy: str
    cores: int
    fraction: float
    steps: int
    seed: int
    over: bool = False

    def workload(self) -> WorkloadConfig:
        """The run's workload."""
        return SHAPES[self.shape].workload(self.seed, self.steps, self.cores)

    def cluster(self) -> ClusterSpec:
        """The run's pool."""
        shape = SHAPES[self.shape]
        wl = self.workload()
        base = ClusterSpec.for_cores(self.cores, shape.cores_per_gpu, wl.gpu_kinds())
        if self.over:
            return over_provisioned(wl, base)
        return base.scaled(self.fraction)


def pool_size(cluster: ClusterSpec) -> float:
    """A pool's capacity in core-equivalents, every resource counted (cores, GPUs, memory)."""
    cap = cluster.capacity()
    return cap.cpu + GPU_WEIGHT * cap.gpu + MEM_WEIGHT_PER_GIB * cap.mem_mb / 1024


def least_resource_s(workload: WorkloadConfig) -> float:
    """The fewest resource-seconds any action-level policy can hold for ``workload``'s plan.

    Each action holds at least its demand at ``min_par`` units for its run there (under Amdahl, more
    units hold more unit-seconds), a reward request batched with others at least ``batch_marginal`` of
    that (what it adds to its batch); each sandbox holds its idle footprint at least from its first
    action's run to its trajectory's end, with every run at ``max_par`` (the shortest it can live).
    Set-up, waits and warm pools add to it: no policy holds less, so a saving above
    ``1 - least / baseline`` cannot be reached.
    """
    total = 0.0
    for step in generate(workload):
        for traj in step:
            lived = 0.0
            for i, planned in enumerate(traj.actions):
                kind = workload.kinds[planned.kind]
                units = weighted(workload.demand(planned.kind, traj.env)) * kind.min_par
                held = units * kind.run_s(planned.t1, kind.min_par)
                total += held * (workload.batch_marginal if kind.setup == "model" else 1.0)
                lived += traj.gaps[i] + kind.run_s(planned.t1, kind.max_par)
            if workload.sessions and traj.env.sandbox is not None:
                total += weighted(Resources(mem_mb=traj.env.sandbox.idle_mb)) * lived
    return total


def run_job(job: Job) -> dict[str, Any]:
    """Simulate ``job``; its figures plus its pool and the wall time it took."""
    t0 = time.perf_counter()
    wl, cl = job.workload(), job.cluster()
    res = simulate(make_policy(job.policy, wl, cl), cl, wl, validate_every=5000)
    fig = res.figures()
    fig["pool"] = {"cores": cl.cores, "gpus": cl.gpus, "size": pool_size(cl), "cpu_workers": cl.cpu_workers}
    fig["wall_s"] = time.perf_counter() - t0
    fig["handle_calls"] = res.handle_calls
    return fig


def plan(
    shapes: list[str], scales: list[int], steps: list[int], seed: int, plot_cores: int | None
) -> list[Job]:
    """Every run the benchmark needs, per workload shape and scale.

    ``plot_cores`` adds the runs only the plot shows (trajectory-bound and task-isolated along the
    sweep); it changes no run a floor reads.
    """
    jobs: list[Job] = []
    for shape in shapes:
        for c, n in zip(scales, steps, strict=True):
            pools = sweep(c)
            jobs += [Job(shape, p, c, 1.0, n, seed) for p in POLICIES if p != TB_OVER]
            jobs += [Job(shape, p, c, 1.0, n, seed, over=True) for p in (TB_OVER, TANGRAM)]
            jobs += [Job(shape, p, c, f, n, seed) for p in SWEPT for f in pools[1:]]
            if c == plot_cores:
                jobs += [
                    Job(shape, p, c, f, n, seed)
                    for p in ("trajectory_bound", "task_isolated")
                    for f in pools[1:]
                ]
    return list(dict.fromkeys(jobs))


def run_all(jobs: list[Job], workers: int) -> dict[Job, dict[str, Any]]:
    """Run ``jobs``, the biggest first, on ``workers`` processes (1: in this process)."""
    order = sorted(jobs, key=lambda j: -j.cores * j.steps * SHAPES[j.shape].per_core)
    if workers <= 1:
        return {j: run_job(j) for j in order}
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return dict(zip(order, pool.map(run_job, order), strict=True))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.act``."""
    p = argparse.ArgumentParser(description="Tangram's elastic scheduler against baselines (simulated ACT).")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--workloads", default=None, help=f"workload shapes (of {', '.join(SHAPES)}; default all)")
    p.add_argument(
        "--scales",
        type=_positive_ints,
        default=None,
        help="pool sizes in CPU cores (comma-separated; default 64,512,4096)",
    )
    p.add_argument(
        "--steps",
        type=_positive_ints,
        default=None,
        help="RL steps per run, one number or one per scale (default: 4 below 256 cores, 2 below 2,048, "
        "then 1: more steps where runs are cheap and noisy, fewer where they are big)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes (default 2)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="the default workload, 64 cores, one step, no plot (refuses --workloads, --scales, --steps)",
    )
    p.add_argument(
        "--no-plot", action="store_true", help="skip the ACT-against-pool plot (it changes no floor)"
    )
    p.add_argument(
        "--save-plot",
        action="store_true",
        help="also copy the plot (always written to benchmarks/out/act_vs_pool.png) to "
        "benchmarks/plots/act_vs_pool.png, the tracked image benchmarks/README.md shows",
    )
    p.add_argument("--real", action="store_true", help="also run the scaled-down workload on the real server")
    p.add_argument("--decision-cost", action="store_true", help="also measure the scheduler's decision cost")
    args = p.parse_args(argv)
    if args.quick:
        # --quick fixes these three; say so rather than ignore what was asked for.
        given = [
            f
            for f, v in (("--workloads", args.workloads), ("--scales", args.scales), ("--steps", args.steps))
            if v is not None
        ]
        if given:
            p.error(f"--quick sets the workload, scale and steps itself; leave out {', '.join(given)}")
    if args.save_plot and (args.quick or args.no_plot):
        p.error("--save-plot needs the plot (not with --quick or --no-plot)")
    shapes = ["default"] if args.quick else [s for s in (args.workloads or ",".join(SHAPES)).split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not shapes:
        p.error(f"unknown workload {unknown}; choose from {sorted(SHAPES)}")
    scales = [64] if args.quick else (args.scales or [64, 512, 4096])
    steps = [4 if c < 256 else 2 if c < 2048 else 1 for c in scales] if args.steps is None else args.steps
    if args.quick:
        steps = [1]
    elif len(steps) == 1:
        steps = steps * len(scales)
    elif len(steps) != len(scales):
        p.error(f"--steps gives {len(steps)} numbers for {len(scales)} scales")
    if len(set(scales)) != len(scales):
        p.error(f"--scales repeats a scale: {scales}")
    plot_cores = None if (args.quick or args.no_plot) else min(scales)
    t0 = time.perf_counter()
    done = run_all(plan(shapes, scales, steps, args.seed, plot_cores), args.jobs)
    result: dict[str, Any] = {
        "seed": args.seed,
        "steps": dict(zip(map(str, scales), steps, strict=True)),
        "weights": {"gpu": GPU_WEIGHT, "mem_per_gib": MEM_WEIGHT_PER_GIB},
        "workloads": {},
    }
    for shape in shapes:
        s: Shape = SHAPES[shape]
        entry: dict[str, Any] = {
            "summary": s.summary,
            "per_core": s.per_core,
            "cores_per_gpu": s.cores_per_gpu,
        }
        entry["scales"] = {
            str(c): assemble(
                {
                    (j.policy, j.fraction, j.over): fig
                    for j, fig in done.items()
                    if j.shape == shape and j.cores == c
                },
                least_resource_s(s.workload(args.seed, n, c)),
            )
            for c, n in zip(scales, steps, strict=True)
        }
        result["workloads"][shape] = entry
    result["floors"] = floors(result)
    result["floors_met"] = all(f["met"] for f in result["floors"])
    first = result["workloads"][shapes[0]]["scales"]
    default = str(512 if 512 in scales else scales[0])
    result["policies"] = first[default]["policies"]  # the first workload at 512 cores, for a quick look
    result["tangram_vs"] = first[default]["tangram_vs"]
    if plot_cores is not None:
        png = OUT / "act_vs_pool.png"
        plot(result, plot_cores, png)
        result["plot"] = str(png)
        if args.save_plot:  # the tracked image changes only when asked
            PLOTS.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png, PLOTS / "act_vs_pool.png")
            result["plot_saved"] = str(PLOTS / "act_vs_pool.png")
    if args.decision_cost:
        from benchmarks.scheduler_cost import run as decision_cost

        result["decision_cost_us"] = decision_cost()
    if args.real:
        from benchmarks.act_real import run_real

        result["real"] = run_real(seed=args.seed)
    result["wall_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(result, indent=2, default=_jsonable))
    else:
        print_tables(result)
        if "decision_cost_us" in result:
            from benchmarks.scheduler_cost import print_table as cost_table

            print()
            cost_table(result["decision_cost_us"])
        if "real" in result:
            from benchmarks.act_real import print_real

            print()
            print_real(result["real"])
        print(f"\n({result['wall_s']:.0f} s; plot: {result.get('plot', 'none')})")
    return 0


def _positive_ints(text: str) -> list[int]:
    """``--scales`` / ``--steps``: comma-separated whole numbers above 0."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated whole numbers: {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"needs numbers of at least 1: {text!r}")
    return out


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return str(obj)


if __name__ == "__main__":
    raise SystemExit(main())
