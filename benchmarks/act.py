"""ACT benchmark: Tangram's elastic scheduler against three baselines on a simulated agentic-RL workload.

    python -m benchmarks.act                 # table, three scales (64, 512 and 4,096 cores)
    python -m benchmarks.act --json          # one JSON object (see benchmarks/README.md)
    python -m benchmarks.act --quick         # 64 cores only, one step (seconds; what the tests run)
    python -m benchmarks.act --real          # also the scaled-down workload on the real orchestrator
    python -m benchmarks.act --decision-cost # also the scheduler's decision cost (benchmarks.scheduler_cost)

Every policy is the real scheduler object the server runs (``make_scheduler``-equivalent, with the
server's defaults for Tangram), driven by the discrete-event simulator of :mod:`benchmarks.sim`.
Figures per policy: mean, p50 and p99 action completion time (ACT), mean RL step duration,
resource-seconds held (cores + 16 x GPUs) and utilisation. For Tangram, ratios against each
baseline at equal resources, and the resources it needs to match each baseline's mean ACT (found by
shrinking its pool along a grid and interpolating).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.sim.cluster import ClusterSpec
from benchmarks.sim.simulator import GPU_WEIGHT, simulate
from benchmarks.sim.workload import WorkloadConfig, expected_shares
from tangram_env.server.scheduler import (
    ElasticScheduler,
    FCFSScheduler,
    TaskIsolatedScheduler,
    TrajectoryBoundScheduler,
)
from tangram_env.server.scheduler.events import Scheduler

TANGRAM = "elastic"
BASELINES = ("trajectory_bound", "task_isolated", "fcfs")
POLICIES = (TANGRAM, *BASELINES)
#: Pool sizes (fractions of each worker's capacity) for the ACT-against-pool curves (plotted scale).
GRID = (1.0, 0.75, 0.5, 0.35, 0.25, 0.18, 0.125)
#: Tangram's pool sweep at the other scales: enough to bracket each baseline's mean ACT.
SWEEP = (1.0, 0.5, 0.35, 0.25, 0.18)
#: The issue's floors for Tangram against trajectory-bound on the default workload.
FLOORS = {"act_ratio": 4.3, "step_ratio": 1.5, "resource_saving": 0.71}
OUT = Path(__file__).resolve().parent / "out"
PLOTS = Path(__file__).resolve().parent / "plots"


def make_policy(name: str, workload: WorkloadConfig, cluster: ClusterSpec) -> Scheduler:
    """The scheduler object of policy ``name``, configured for ``workload`` where a baseline needs it."""
    if name == TANGRAM:
        return ElasticScheduler()  # exactly the server's default
    if name == "fcfs":
        return FCFSScheduler()
    if name == "task_isolated":
        return TaskIsolatedScheduler(quotas=expected_shares(workload))
    if name == "trajectory_bound":
        score = workload.kinds["score"].demand
        replicas = int(cluster.gpus // score.gpu) if score.gpu else 1
        return TrajectoryBoundScheduler(
            slot={env.env_id: env.slot for env in workload.envs},
            rm_replicas={"score": (replicas, score)},
            idle_release_s=float("inf"),  # the simulator closes every trajectory
        )
    raise ValueError(f"unknown policy {name!r}; choose one of {POLICIES}")


@dataclass(frozen=True)
class Job:
    """One simulated run."""

    policy: str
    cores: int
    fraction: float
    steps: int
    seed: int
    per_core: float

    def workload(self) -> WorkloadConfig:
        """The run's workload."""
        return WorkloadConfig(
            seed=self.seed, steps=self.steps, trajectories=round(self.per_core * self.cores)
        )

    def cluster(self) -> ClusterSpec:
        """The run's pool."""
        return ClusterSpec.for_cores(self.cores).scaled(self.fraction)


def run_job(job: Job) -> dict[str, Any]:
    """Simulate ``job``; its figures plus the wall time it took."""
    t0 = time.perf_counter()
    wl, cl = job.workload(), job.cluster()
    res = simulate(make_policy(job.policy, wl, cl), cl, wl, validate_every=5000)
    fig = res.figures()
    fig["wall_s"] = time.perf_counter() - t0
    fig["handle_calls"] = res.handle_calls
    return fig


def _crossing(points: list[tuple[float, float, float]], target: float) -> dict[str, Any]:
    """The smallest pool fraction whose mean ACT reaches ``target``, interpolated on log ACT.

    ``points`` are ``(fraction, mean ACT, resource-seconds)`` sorted by fraction, largest first.
    """
    ok = [p for p in points if p[1] <= target]
    if not ok:
        return {"fraction": None, "resource_s": None, "bound": "not reached even at the full pool"}
    last_ok = min(ok, key=lambda p: p[0])
    smaller = [p for p in points if p[0] < last_ok[0]]
    if not smaller:
        return {"fraction": last_ok[0], "resource_s": last_ok[2], "bound": "at most (smallest pool tried)"}
    nxt = max(smaller, key=lambda p: p[0])  # the next pool down, which misses the target
    a, b = math.log(max(last_ok[1], 1e-9)), math.log(max(nxt[1], 1e-9))
    w = (math.log(target) - a) / (b - a) if b != a else 0.0
    frac = last_ok[0] + w * (nxt[0] - last_ok[0])
    res = last_ok[2] + w * (nxt[2] - last_ok[2])
    return {"fraction": frac, "resource_s": res, "bound": "interpolated"}


def assemble(cores: int, runs: dict[tuple[str, float], dict[str, Any]]) -> dict[str, Any]:
    """The figures of one scale: each policy at the full pool, Tangram's ratios and savings."""
    policies = {p: runs[(p, 1.0)] for p in POLICIES}
    tangram = policies[TANGRAM]
    sweep = sorted(
        ((f, fig["mean_act_s"], fig["resource_s"]) for (p, f), fig in runs.items() if p == TANGRAM),
        reverse=True,
    )
    vs: dict[str, Any] = {}
    for base in BASELINES:
        b = policies[base]
        cross = _crossing(sweep, b["mean_act_s"])
        entry: dict[str, Any] = {
            "act_ratio": b["mean_act_s"] / tangram["mean_act_s"],
            # The same without each trajectory's first action, whose ACT holds the wait for a sandbox
            # slot under trajectory-bound: what the other actions alone show.
            "act_ratio_after_first": b["mean_act_after_first_s"] / tangram["mean_act_after_first_s"],
            "step_ratio": b["mean_step_s"] / tangram["mean_step_s"],
            "p99_ratio": b["p99_act_s"] / tangram["p99_act_s"],
            "resource_saving": None
            if cross["resource_s"] is None
            else 1 - cross["resource_s"] / b["resource_s"],
            "pool_saving": None if cross["fraction"] is None else 1 - cross["fraction"],
            "resource_saving_equal_pool": 1 - tangram["resource_s"] / b["resource_s"],
            "equal_act_pool_fraction": cross["fraction"],
            "equal_act_how": cross["bound"],
        }
        vs[base] = entry
    curves: dict[str, list[list[float]]] = {}
    for (p, f), fig in sorted(runs.items()):
        curves.setdefault(p, []).append([f, fig["mean_act_s"], fig["resource_s"]])
    cl = ClusterSpec.for_cores(cores)
    return {
        "cluster": {
            "cores": cl.cores,
            "gpus": cl.gpus,
            "cpu_workers": cl.cpu_workers,
            "gpu_workers": cl.gpu_workers,
        },
        "policies": policies,
        "tangram_vs": vs,
        "act_vs_pool": curves,
    }


def _floors(scale: dict[str, Any]) -> dict[str, Any]:
    tb = scale["tangram_vs"]["trajectory_bound"]
    return {
        key: {"floor": floor, "got": tb[key], "met": tb[key] is not None and tb[key] >= floor}
        for key, floor in FLOORS.items()
    }


def plan(
    scales: list[int], steps: list[int], seed: int, per_core: float, plot_cores: int | None
) -> list[Job]:
    """Every run the benchmark needs: all policies at full pools, Tangram's pool sweep, the plot's curves."""
    jobs: list[Job] = []
    for c, n in zip(scales, steps, strict=True):
        jobs += [Job(p, c, 1.0, n, seed, per_core) for p in POLICIES]
        grid = GRID if c == plot_cores else SWEEP
        jobs += [Job(TANGRAM, c, f, n, seed, per_core) for f in grid[1:]]
        if c == plot_cores:
            jobs += [Job(p, c, f, n, seed, per_core) for p in BASELINES for f in GRID[1:]]
    return list(dict.fromkeys(jobs))


def run_all(jobs: list[Job], workers: int) -> dict[Job, dict[str, Any]]:
    """Run ``jobs``, the biggest first, on ``workers`` processes (1: in this process)."""
    order = sorted(jobs, key=lambda j: -j.cores * j.steps)
    if workers <= 1:
        return {j: run_job(j) for j in order}
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return dict(zip(order, pool.map(run_job, order), strict=True))


def plot(result: dict[str, Any], cores: int, path: Path) -> None:
    """ACT against pool size for each policy at one scale (matplotlib PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale = result["scales"][str(cores)]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    styles = {
        "elastic": ("Tangram (elastic)", "o-"),
        "trajectory_bound": ("trajectory-bound", "s--"),
        "task_isolated": ("task-isolated", "^--"),
        "fcfs": ("action-level FCFS", "d--"),
    }
    full = scale["cluster"]["cores"]
    for name, pts in scale["act_vs_pool"].items():
        if len(pts) < 2:
            continue
        label, style = styles[name]
        ax.plot([p[0] * full for p in pts], [p[1] for p in pts], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"CPU cores in the pool (GPUs in proportion; full pool = {full:.0f} cores)")
    ax.set_ylabel("mean ACT (s)")
    ax.set_title(
        f"Mean action completion time against pool size ({result['workload']['trajectories_per_core']:g}"
        f" trajectories per full-pool core)",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def print_table(result: dict[str, Any], file: Any = sys.stdout) -> None:
    """The figures as tables, one per scale."""
    for scale in result["scales"].values():
        cl = scale["cluster"]
        workers = f"{cl['cpu_workers']} + {cl['gpu_workers']} workers"
        print(
            f"\n== {cl['cores']:.0f} cores, {cl['gpus']:.0f} GPUs ({workers}) ==",
            file=file,
        )
        print(
            f"{'policy':<18}{'mean ACT':>10}{'p50':>8}{'p99':>9}{'no 1st':>8}{'step s':>9}{'res-s held':>12}"
            f"{'util':>7}{'actions':>9}",
            file=file,
        )
        for name, f in scale["policies"].items():
            print(
                f"{name:<18}{f['mean_act_s']:>10.2f}{f['p50_act_s']:>8.2f}{f['p99_act_s']:>9.1f}"
                f"{f['mean_act_after_first_s']:>8.2f}{f['mean_step_s']:>9.1f}{f['resource_s']:>12.3g}"
                f"{f['utilisation']:>7.2f}{f['actions']:>9}",
                file=file,
            )
        print(
            f"{'tangram vs':<18}{'ACT x':>8}{'no 1st':>8}{'step x':>8}{'p99 x':>8}{'res saved':>11}"
            f"{'pool saved':>11}{'res saved, equal pool':>23}",
            file=file,
        )
        for base, v in scale["tangram_vs"].items():
            rs = "n/a" if v["resource_saving"] is None else f"{100 * v['resource_saving']:.1f}%"
            ps = "n/a" if v["pool_saving"] is None else f"{100 * v['pool_saving']:.1f}%"
            print(
                f"{base:<18}{v['act_ratio']:>8.2f}{v['act_ratio_after_first']:>8.2f}{v['step_ratio']:>8.2f}"
                f"{v['p99_ratio']:>8.2f}{rs:>11}{ps:>11}{100 * v['resource_saving_equal_pool']:>22.1f}%",
                file=file,
            )
        floors = _floors(scale)
        met = ", ".join(
            f"{k} {v['got'] if v['got'] is None else round(v['got'], 3)} "
            f"({'met' if v['met'] else 'MISSED'} floor {v['floor']})"
            for k, v in floors.items()
        )
        print(f"floors vs trajectory-bound: {met}", file=file)
        print(
            "(no 1st: mean ACT without each trajectory's first action, which under trajectory-bound holds the"
            " wait for a sandbox slot)",
            file=file,
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.act``."""
    p = argparse.ArgumentParser(description="Tangram's elastic scheduler against baselines (simulated ACT).")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--scales", default="64,512,4096", help="pool sizes in CPU cores (comma-separated)")
    p.add_argument(
        "--steps",
        default=None,
        help="RL steps per run, one number or one per scale (default: 2, and 1 from 2,048 cores up, "
        "so that the 4,096-core runs, 8,192 trajectories a step, keep the default run to minutes)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--per-core", type=float, default=2.0, help="trajectories per RL step per core (default 2)"
    )
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes (default 2)")
    p.add_argument("--quick", action="store_true", help="64 cores, one step, no plot")
    p.add_argument("--no-plot", action="store_true", help="skip the ACT-against-pool plot")
    p.add_argument("--real", action="store_true", help="also run the scaled-down workload on the real server")
    p.add_argument("--decision-cost", action="store_true", help="also measure the scheduler's decision cost")
    args = p.parse_args(argv)
    scales = [64] if args.quick else [int(x) for x in args.scales.split(",")]
    steps = (
        [1 if c >= 2048 else 2 for c in scales]
        if args.steps is None
        else [int(x) for x in args.steps.split(",")]
    )
    if args.quick:
        steps = [1]
    elif len(steps) == 1:
        steps = steps * len(scales)
    elif len(steps) != len(scales):
        p.error(f"--steps gives {len(steps)} numbers for {len(scales)} scales")
    plot_cores = None if (args.quick or args.no_plot) else min(scales)
    t0 = time.perf_counter()
    jobs = plan(scales, steps, args.seed, args.per_core, plot_cores)
    done = run_all(jobs, args.jobs)
    result: dict[str, Any] = {
        "workload": {
            "seed": args.seed,
            "steps": dict(zip(map(str, scales), steps, strict=True)),
            "trajectories_per_core": args.per_core,
            "gpu_weight_in_resource_s": GPU_WEIGHT,
            **_workload_summary(),
        },
        "scales": {},
    }
    for c in scales:
        runs = {(j.policy, j.fraction): fig for j, fig in done.items() if j.cores == c}
        result["scales"][str(c)] = assemble(c, runs)
    default = str(512 if 512 in scales else scales[0])
    result["default_scale"] = int(default)
    result["policies"] = result["scales"][default]["policies"]
    result["tangram_vs"] = result["scales"][default]["tangram_vs"]
    result["floors"] = {c: _floors(s) for c, s in result["scales"].items()}
    if plot_cores is not None:
        png = OUT / "act_vs_pool.png"
        plot(result, plot_cores, png)
        PLOTS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, PLOTS / "act_vs_pool.png")
        result["plot"] = str(png)
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
        print_table(result)
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


def _workload_summary() -> dict[str, Any]:
    wl = WorkloadConfig()
    return {
        "envs": {
            e.env_id: {
                "share": e.share,
                "turns_mean": e.turns_mean,
                "gap_median_s": e.gap_median_s,
                "slot": asdict(e.slot),
            }
            for e in wl.envs
        },
        "kinds": {
            k.name: {
                "median_s": k.median_s,
                "sigma": k.sigma,
                "parallel": k.parallel,
                "max_par": k.max_par,
                "demand": asdict(k.demand),
            }
            for k in wl.kinds.values()
        },
        "update_s": wl.update_s,
        "sandbox_create_s": wl.sandbox_create_s,
        "model_load_s": wl.model_load_s,
    }


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return str(obj)


if __name__ == "__main__":
    raise SystemExit(main())
