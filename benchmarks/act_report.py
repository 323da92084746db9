"""The figures of ``benchmarks.act``: per scale, Tangram against each baseline; the floors; tables; plot.

Pools are compared by *size*: cores + 16 x GPUs + memory / 4 GiB (every resource, weighed by the
default pool's own ratios). ``resource_saving`` against a baseline shrinks Tangram's pool until its
mean ACT equals the baseline's (log-ACT interpolated between the two pools around the crossing) and
compares the resource-seconds held there with the baseline's.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "out"
PLOTS = Path(__file__).resolve().parent / "plots"
TANGRAM = "elastic"
TB_OVER = "trajectory_bound_over"

Runs = dict[tuple[str, float, bool], dict[str, Any]]
#: How a floor entry's ``pools`` names the over-provisioned pool (the rest are fractions of the base pool).
OVER_POOL = "over-provisioned"


def crossing(points: list[tuple[float, float, float]], target: float) -> dict[str, Any]:
    """The smallest pool whose mean ACT reaches ``target``, interpolated on log ACT.

    ``points`` are ``(pool size, mean ACT, resource-seconds)``.
    """
    points = sorted(points, reverse=True)
    ok = [p for p in points if p[1] <= target]
    if not ok:
        return {"size": None, "resource_s": None, "bound": "not reached even at the largest pool"}
    last_ok = min(ok)
    smaller = [p for p in points if p[0] < last_ok[0]]
    if not smaller:
        return {"size": last_ok[0], "resource_s": last_ok[2], "bound": "at most (smallest pool tried)"}
    nxt = max(smaller)  # the next pool down, which misses the target
    a, b = math.log(max(last_ok[1], 1e-9)), math.log(max(nxt[1], 1e-9))
    w = (math.log(target) - a) / (b - a) if b != a else 0.0
    return {
        "size": last_ok[0] + w * (nxt[0] - last_ok[0]),
        "resource_s": last_ok[2] + w * (nxt[2] - last_ok[2]),
        "bound": "interpolated",
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def assemble(runs: Runs, least_resource_s: float) -> dict[str, Any]:
    """The figures of one workload at one scale (``runs``: (policy, pool fraction, over) -> figures).

    ``least_resource_s``: the fewest resource-seconds any action-level policy can hold for the plan.
    """
    policies = {p: fig for (p, f, over), fig in runs.items() if f == 1.0 and not over and p != TB_OVER}
    policies[TB_OVER] = runs[(TB_OVER, 1.0, True)]
    tangram = policies[TANGRAM]
    on_over = runs[(TANGRAM, 1.0, True)]
    sweep = [
        (fig["pool"]["size"], fig["mean_act_s"], fig["resource_s"])
        for (p, _, _), fig in runs.items()
        if p == TANGRAM
    ]
    # The pools Tangram ran on, which the equal-ACT crossings search (recorded on the floors).
    sweep_pools: list[float | str] = [
        OVER_POOL if over else f
        for (p, f, over) in sorted(runs, key=lambda k: (not k[2], -k[1]))
        if p == TANGRAM
    ]
    vs: dict[str, Any] = {}
    for base, b in policies.items():
        if base == TANGRAM:
            continue
        same = on_over if base == TB_OVER else tangram  # Tangram on the baseline's own pool
        cross = crossing(sweep, b["mean_act_s"])
        vs[base] = {
            "act_ratio": _ratio(b["mean_act_s"], same["mean_act_s"]),
            "act_ratio_after_first": _ratio(b["mean_act_after_first_s"], same["mean_act_after_first_s"]),
            "step_ratio": _ratio(b["mean_step_s"], same["mean_step_s"]),
            "p99_ratio": _ratio(b["p99_act_s"], same["p99_act_s"]),
            "resource_saving": None
            if cross["resource_s"] is None
            else 1 - cross["resource_s"] / b["resource_s"],
            "pool_saving": None if cross["size"] is None else 1 - cross["size"] / b["pool"]["size"],
            "resource_saving_equal_pool": 1 - same["resource_s"] / b["resource_s"],
            "equal_act_pool_size": cross["size"],
            "equal_act_how": cross["bound"],
            "equal_act_pools": sweep_pools,
        }
    by_pool = []
    for (p, f, over), fig in sorted(runs.items(), key=lambda x: -x[0][1]):
        other = runs.get((TANGRAM, f, over))
        if p == "fcfs" and other is not None:
            by_pool.append(
                {
                    "fraction": f,
                    "act_ratio": _ratio(fig["mean_act_s"], other["mean_act_s"]),
                    "p99_ratio": _ratio(fig["p99_act_s"], other["p99_act_s"]),
                    "step_ratio": _ratio(fig["mean_step_s"], other["mean_step_s"]),
                }
            )
    # The most any policy could save against the over-provisioned baseline (see least_resource_s).
    vs[TB_OVER]["resource_saving_most"] = 1 - least_resource_s / policies[TB_OVER]["resource_s"]
    vs["fcfs"]["by_pool"] = by_pool
    vs["fcfs"]["min_act_ratio"] = min(r["act_ratio"] for r in by_pool)
    vs["fcfs"]["min_p99_ratio"] = min(r["p99_ratio"] for r in by_pool)
    fcfs_cross = crossing(sweep, policies["fcfs"]["mean_act_s"])
    vs["fcfs"]["resource_s_ratio_equal_act"] = (
        None
        if fcfs_cross["resource_s"] is None
        else fcfs_cross["resource_s"] / policies["fcfs"]["resource_s"]
    )
    curves: dict[str, list[list[float]]] = {}
    for (p, _f, over), fig in sorted(runs.items(), key=lambda x: (x[0][0], x[0][1])):
        name = f"{p} (over-provisioned pool)" if over and p == TANGRAM else p
        curves.setdefault(name, []).append(
            [
                fig["pool"]["cores"],
                fig["pool"]["size"],
                fig["mean_act_s"],
                fig["p99_act_s"],
                fig["resource_s"],
            ]
        )
    return {
        "pool": tangram["pool"],
        "over_pool": policies[TB_OVER]["pool"],
        "least_resource_s": least_resource_s,
        "policies": policies,
        "tangram_on_over_pool": on_over,
        "tangram_vs": vs,
        "act_vs_pool": curves,
    }


def floors(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's floors, one entry per floor, workload and scale."""
    out: list[dict[str, Any]] = []

    def add(
        name: str,
        workload: str,
        cores: str,
        value: float | None,
        op: str,
        floor: float,
        pools: list[float | str],
        best_possible: float | None = None,
    ) -> None:
        met = value is not None and (value >= floor if op == ">=" else value <= floor)
        entry = {
            "name": name,
            "workload": workload,
            "cores": int(cores),
            "value": value,
            "op": op,
            "floor": floor,
            "met": met,
            "pools": pools,  # the pools the value was computed on (fractions of the base pool)
        }
        if best_possible is not None:  # what no policy can do better than, on this plan
            entry["best_possible"] = best_possible
        out.append(entry)

    for wl, entry in result["workloads"].items():
        for cores, scale in entry["scales"].items():
            vs = scale["tangram_vs"]
            over, tb, fcfs = vs[TB_OVER], vs["trajectory_bound"], vs["fcfs"]
            most = over["resource_saving_most"]
            swept, every = over["equal_act_pools"], [r["fraction"] for r in fcfs["by_pool"]]
            add("vs_tb_over_resource_saving", wl, cores, over["resource_saving"], ">=", 0.71, swept, most)
            add("vs_tb_over_act_ratio_equal_pool", wl, cores, over["act_ratio"], ">=", 1.0, [OVER_POOL])
            add("vs_tb_over_step_ratio_equal_pool", wl, cores, over["step_ratio"], ">=", 1.0, [OVER_POOL])
            if wl == "default":
                add("vs_tb_queued_act_ratio", wl, cores, tb["act_ratio"], ">=", 4.3, [1.0])
                add("vs_tb_queued_step_ratio", wl, cores, tb["step_ratio"], ">=", 1.5, [1.0])
            add("vs_fcfs_act_ratio_every_pool", wl, cores, fcfs["min_act_ratio"], ">=", 1.0, every)
            add("vs_fcfs_p99_ratio_every_pool", wl, cores, fcfs["min_p99_ratio"], ">=", 1.0, every)
            add(
                "vs_fcfs_resource_s_ratio_equal_act",
                wl,
                cores,
                fcfs["resource_s_ratio_equal_act"],
                "<=",
                1.0,
                swept,
            )
    return out


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def print_tables(result: dict[str, Any], file: Any = sys.stdout) -> None:
    """One table per workload and scale, then the floors."""
    for wl, entry in result["workloads"].items():
        print(
            f"\n##### workload {wl}: {entry['summary']} ({entry['per_core']:g} trajectories per core)",
            file=file,
        )
        for scale in entry["scales"].values():
            pool, over = scale["pool"], scale["over_pool"]
            print(
                f"\n== {pool['cores']:.0f} cores, {pool['gpus']} GPUs (over-provisioned trajectory-bound: "
                f"{over['cores']:.0f} cores, {over['gpus']} GPUs) ==",
                file=file,
            )
            print(
                f"{'policy':<24}{'mean ACT':>9}{'p50':>7}{'p99':>8}{'no 1st':>8}{'step s':>8}{'res-s':>10}"
                f"{'GiB-s':>10}{'util':>6}{'rej':>5}",
                file=file,
            )
            rows = [*scale["policies"].items(), ("elastic on over pool", scale["tangram_on_over_pool"])]
            for name, f in rows:
                print(
                    f"{name:<24}{f['mean_act_s']:>9.2f}{f['p50_act_s']:>7.2f}{f['p99_act_s']:>8.1f}"
                    f"{f['mean_act_after_first_s']:>8.2f}{f['mean_step_s']:>8.0f}{f['resource_s']:>10.3g}"
                    f"{f['mem_gib_s']:>10.3g}{f['utilisation']:>6.2f}{f['rejected']:>5}",
                    file=file,
                )
            print(
                f"{'tangram vs':<24}{'ACT x':>7}{'step x':>8}{'p99 x':>7}{'res saved':>11}{'pool saved':>11}"
                f"{'saved, same pool':>18}",
                file=file,
            )
            for base, v in scale["tangram_vs"].items():
                print(
                    f"{base:<24}{v['act_ratio']:>7.2f}{v['step_ratio']:>8.2f}{v['p99_ratio']:>7.2f}"
                    f"{_pct(v['resource_saving']):>11}{_pct(v['pool_saving']):>11}"
                    f"{_pct(v['resource_saving_equal_pool']):>18}",
                    file=file,
                )
            fc = scale["tangram_vs"]["fcfs"]
            pools = ", ".join(
                f"{r['fraction']:g}: {r['act_ratio']:.2f}/{r['p99_ratio']:.2f}" for r in fc["by_pool"]
            )
            print(f"vs fcfs by pool fraction (mean/p99 ACT x): {pools}", file=file)
            most = scale["tangram_vs"][TB_OVER]["resource_saving_most"]
            print(
                f"least any policy holds: {scale['least_resource_s']:.3g} res-s (saves at most "
                f"{_pct(most)} against over-provisioned trajectory-bound)",
                file=file,
            )
    missed = [f for f in result["floors"] if not f["met"]]
    print(f"\nfloors: {len(result['floors']) - len(missed)} of {len(result['floors'])} met", file=file)
    for f in missed:
        v = "n/a" if f["value"] is None else f"{f['value']:.3f}"
        best = f.get("best_possible")
        reach = "" if best is None else f" (no policy can reach more than {best:.3f})"
        print(
            f"  MISSED {f['name']} ({f['workload']}, {f['cores']} cores): {v} {f['op']} {f['floor']}{reach}",
            file=file,
        )


STYLES = {
    "elastic": ("Tangram (elastic)", "o-"),
    "fcfs": ("action-level FCFS", "d--"),
    "task_isolated": ("task-isolated", "^--"),
    "trajectory_bound": ("trajectory-bound (queued)", "s--"),
    "trajectory_bound_over": ("trajectory-bound (over-provisioned)", "P"),
    "elastic (over-provisioned pool)": ("Tangram on that pool", "x"),
}


def plot(result: dict[str, Any], cores: int, path: Path) -> None:
    """Mean and p99 ACT against pool size, every policy, one column per workload (matplotlib PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    fig, axes = plt.subplots(2, len(names), figsize=(4.2 * len(names), 7.0), dpi=110, squeeze=False)
    for col, wl in enumerate(names):
        curves = result["workloads"][wl]["scales"][str(cores)]["act_vs_pool"]
        for row, (idx, what) in enumerate(((2, "mean ACT (s)"), (3, "p99 ACT (s)"))):
            ax = axes[row][col]
            for name, pts in curves.items():
                label, style = STYLES[name]
                pts = sorted(pts)
                ax.plot([p[1] for p in pts], [p[idx] for p in pts], style, label=label, markersize=5)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_ylabel(what)
            if row == 0:
                ax.set_title(f"{wl} ({cores}-core pool at 1.0)", fontsize=9)
            else:
                ax.set_xlabel("pool size (cores + 16 x GPUs + GiB / 4)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
