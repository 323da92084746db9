"""What Tangram's advantage over trajectory-bound depends on: ``python -m benchmarks.act_sensitivity``.

Each row changes one workload parameter of the default workload (64 cores, two RL steps) and prints
Tangram's mean-ACT and step-duration ratios against trajectory-bound at equal resources, and the
resource-seconds it saves at equal resources. ``--json`` prints the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from benchmarks.act import make_policy
from benchmarks.sim.cluster import ClusterSpec
from benchmarks.sim.simulator import simulate
from benchmarks.sim.workload import WorkloadConfig
from tangram_env.server.scheduler.events import Resources

CORES = 64


def _per_core(x: float) -> Callable[[WorkloadConfig], WorkloadConfig]:
    return lambda wl: wl.with_(trajectories=round(x * CORES))


def _gaps(x: float) -> Callable[[WorkloadConfig], WorkloadConfig]:
    return lambda wl: wl.with_(envs=tuple(replace(e, gap_median_s=e.gap_median_s * x) for e in wl.envs))


def _slot(cpu: float) -> Callable[[WorkloadConfig], WorkloadConfig]:
    def change(wl: WorkloadConfig) -> WorkloadConfig:
        envs = tuple(
            replace(e, slot=Resources(cpu, e.slot.mem_mb)) if e.env_id == "swe" else e for e in wl.envs
        )
        return wl.with_(envs=envs)

    return change


def _tests(x: float) -> Callable[[WorkloadConfig], WorkloadConfig]:
    def change(wl: WorkloadConfig) -> WorkloadConfig:
        kinds = dict(wl.kinds)
        kinds["run_tests"] = replace(kinds["run_tests"], median_s=kinds["run_tests"].median_s * x)
        return wl.with_(kinds=kinds)

    return change


def _parallel(p: float) -> Callable[[WorkloadConfig], WorkloadConfig]:
    def change(wl: WorkloadConfig) -> WorkloadConfig:
        kinds = dict(wl.kinds)
        kinds["run_tests"] = replace(kinds["run_tests"], parallel=p)
        return wl.with_(kinds=kinds)

    return change


def _tail(sigma: float) -> Callable[[WorkloadConfig], WorkloadConfig]:
    def change(wl: WorkloadConfig) -> WorkloadConfig:
        return wl.with_(kinds={n: replace(k, sigma=sigma) for n, k in wl.kinds.items()})

    return change


#: (parameter, value shown, change to the default workload)
ROWS: list[tuple[str, str, Callable[[WorkloadConfig], WorkloadConfig]]] = [
    ("default", "-", lambda wl: wl),
    *[("trajectories per core", f"{x:g}", _per_core(x)) for x in (0.5, 1.0, 1.5, 3.0)],
    *[("LLM gap x", f"{x:g}", _gaps(x)) for x in (0.5, 2.0)],
    *[("swe slot cores", f"{c:g}", _slot(c)) for c in (1.0, 4.0)],
    *[("test run length x", f"{x:g}", _tests(x)) for x in (0.5, 2.0)],
    *[("test parallel fraction", f"{p:g}", _parallel(p)) for p in (0.5, 0.99)],
    *[("duration sigma (all kinds)", f"{s:g}", _tail(s)) for s in (0.5, 1.5)],
]


def _row(i: int) -> dict[str, Any]:
    name, value, change = ROWS[i]
    wl = change(WorkloadConfig(trajectories=2 * CORES, steps=2))
    cl = ClusterSpec.for_cores(CORES)
    t = simulate(make_policy("elastic", wl, cl), cl, wl).figures()
    b = simulate(make_policy("trajectory_bound", wl, cl), cl, wl).figures()
    return {
        "parameter": name,
        "value": value,
        "act_ratio": b["mean_act_s"] / t["mean_act_s"],
        "act_ratio_after_first": b["mean_act_after_first_s"] / t["mean_act_after_first_s"],
        "step_ratio": b["mean_step_s"] / t["mean_step_s"],
        "resource_saving_equal_pool": 1 - t["resource_s"] / b["resource_s"],
        "tangram_mean_act_s": t["mean_act_s"],
        "trajectory_bound_mean_act_s": b["mean_act_s"],
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(_row, range(len(ROWS))))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"{'parameter':<28}{'value':>7}{'ACT x':>8}{'no 1st':>8}{'step x':>8}{'res saved':>11}"
        f"{'Tangram s':>11}{'TB s':>8}"
    )
    for r in rows:
        print(
            f"{r['parameter']:<28}{r['value']:>7}{r['act_ratio']:>8.2f}{r['act_ratio_after_first']:>8.2f}"
            f"{r['step_ratio']:>8.2f}"
            f"{100 * r['resource_saving_equal_pool']:>10.1f}%{r['tangram_mean_act_s']:>11.2f}"
            f"{r['trajectory_bound_mean_act_s']:>8.2f}",
            file=sys.stdout,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
