"""``benchmarks.act --real``: the workload's shape, scaled to this machine, on the real orchestrator.

A ``tangram-server`` child with the chosen ``--scheduler`` serves the tools of
:mod:`benchmarks.act_tools`; one thread per trajectory plays the trainer (LLM gap, submit, wait for
the result) through the real ZeroMQ client. Times are the workload's times x ``TIME_SCALE``, there
is one worker (the server's local executor, ``CORES`` logical cores), no sandboxes (tools run as
forked processes) and no GPU (the reward model is a CPU tool). The same plan then runs in the
simulator with the same policy, and the report says how far the simulator's prediction was from
the real run. The real ACT includes what the simulator does not model: the client round trip, the
fork of each action's process and the server's own loop. Trajectory-bound runs for real too: each
trainer thread says when its trajectory ends (``Client.close_trajectories``), and the orchestrator
tells the scheduler (``TrajectoryClosed``), which frees the trajectory's slot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import replace
from typing import Any

from benchmarks.common import start_server
from benchmarks.sim.cluster import ClusterSpec
from benchmarks.sim.simulator import simulate
from benchmarks.sim.workload import Trajectory, WorkloadConfig, default_envs, default_kinds, generate
from tangram_env.launch import ServerProcess

TIME_SCALE = 0.05
CORES = 8
MEM_MB = 16 * 1024
TRAJECTORIES = 16


def real_workload(seed: int = 0, trajectories: int = TRAJECTORIES, steps: int = 1) -> WorkloadConfig:
    """The default workload with every time x ``TIME_SCALE``, no sessions, and a CPU reward model."""
    kinds = {}
    for name, k in default_kinds().items():
        k = replace(k, median_s=k.median_s * TIME_SCALE, cap_s=60.0)
        if name == "score":
            k = replace(k, demand=replace(k.demand, gpu=0.0, gpu_mem_mb=0.0, mem_mb=1024.0), setup="none")
        kinds[name] = k
    envs = tuple(replace(e, gap_median_s=e.gap_median_s * TIME_SCALE) for e in default_envs())
    return WorkloadConfig(
        seed=seed,
        steps=steps,
        trajectories=trajectories,
        update_s=30.0 * TIME_SCALE,
        kinds=kinds,
        envs=envs,
        sessions=False,
    )


def _cluster() -> ClusterSpec:
    return ClusterSpec(cpu_workers=1, cores_per_worker=CORES, mem_mb_per_worker=MEM_MB, gpu_workers=0)


def _scheduler_options(policy: str, cfg: WorkloadConfig) -> list[str]:
    """``--scheduler-option`` flags that configure ``policy`` for ``cfg`` as the simulator's copy is."""
    if policy != "trajectory_bound":
        return []
    slots = {env.env_id: {"cpu": env.slot.cpu, "mem_mb": env.slot.mem_mb} for env in cfg.envs}
    # Every trajectory says when it ends (Client.close_trajectories): no idle release needed.
    return ["--scheduler-option", f"slot={json.dumps(slots)}", "--scheduler-option", "idle_release_s=1e9"]


def _start_server(scheduler: str, cfg: WorkloadConfig) -> ServerProcess:
    """A ``tangram-server`` child running ``scheduler`` and serving the benchmark's tools."""
    return start_server(
        *_scheduler_options(scheduler, cfg),
        "--cpus",
        str(CORES),
        "--mem-mb",
        str(MEM_MB),
        "--scheduler",
        scheduler,
        "--plugin",
        "benchmarks.act_tools",
        "--sandbox",
        "none",
        "--no-gpu-worker",
        "--no-entry-points",
    )


def _play(client: Any, traj: Trajectory, cfg: WorkloadConfig, prefix: str, out: list[dict[str, Any]]) -> None:
    from benchmarks.act_tools import tool_name
    from tangram_env import Action

    for i, plan in enumerate(traj.actions):
        time.sleep(traj.gaps[i])
        kind = cfg.kinds[plan.kind]
        action = Action(
            id=f"{prefix}{plan.action_id}",
            kind=tool_name(plan.kind),
            payload={"t1": plan.t1, "parallel": kind.parallel},
            trajectory_id=traj.traj_id,
            env_id=traj.env.env_id,
        )
        t0 = time.monotonic()
        result = client.submit([action])[0].result(timeout=300)
        t1 = time.monotonic()
        out.append(
            {
                "kind": plan.kind,
                "act_s": t1 - t0,
                "server_act_s": result.timing.act_s,
                "ok": result.ok,
                "k": result.parallelism,
                "done": t1,
            }
        )
    client.close_trajectories([traj.traj_id])  # its slot, under trajectory-bound, goes to the next


def run_policy(policy: str, cfg: WorkloadConfig) -> dict[str, Any]:
    """Play ``cfg`` against a real server running ``policy``; the same figures as the simulator's."""
    from tangram_env import Client

    server = _start_server(policy, cfg)
    try:
        client = Client(server.address)
        records: list[dict[str, Any]] = []
        steps: list[float] = []
        t_start = time.monotonic()
        for step_plan in generate(cfg):
            t0 = time.monotonic()
            threads = [
                threading.Thread(target=_play, args=(client, t, cfg, f"{policy}-", records))
                for t in step_plan
            ]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            steps.append(time.monotonic() - t0)
            time.sleep(cfg.update_s)
        wall = time.monotonic() - t_start
        client.close()
    finally:
        server.stop(grace_s=10)
    acts = sorted(r["act_s"] for r in records)
    n = len(acts)
    return {
        "actions": n,
        "failed": sum(1 for r in records if not r["ok"]),
        "mean_act_s": sum(acts) / n,
        "p50_act_s": acts[n // 2],
        "p99_act_s": acts[min(n - 1, int(0.99 * n))],
        "mean_step_s": statistics.mean(steps),
        "server_mean_act_s": statistics.mean(r["server_act_s"] for r in records),
        "mean_parallelism": {
            k: statistics.mean(r["k"] for r in records if r["kind"] == k)
            for k in sorted({r["kind"] for r in records})
        },
        "wall_s": wall,
    }


def run_real(
    seed: int = 0, policies: tuple[str, ...] = ("elastic", "fcfs", "trajectory_bound")
) -> dict[str, Any]:
    """Each policy on the real server and in the simulator; the prediction errors."""
    from benchmarks.act import make_policy

    cfg = real_workload(seed)
    cluster = _cluster()
    out: dict[str, Any] = {
        "time_scale": TIME_SCALE,
        "cores": CORES,
        "trajectories": cfg.trajectories,
        "steps": cfg.steps,
        "policies": {},
    }
    for policy in policies:
        real = run_policy(policy, cfg)
        sim = simulate(make_policy(policy, cfg, cluster), cluster, cfg).figures()
        err = {
            key: (real[key] - sim[key]) / sim[key]
            for key in ("mean_act_s", "p50_act_s", "p99_act_s", "mean_step_s")
            if sim[key]
        }
        out["policies"][policy] = {
            "real": real,
            "simulated": {k: sim[k] for k in real if k in sim},
            "error": err,
        }
    if "elastic" in out["policies"] and "fcfs" in out["policies"]:
        r = out["policies"]
        out["act_ratio_fcfs_real"] = r["fcfs"]["real"]["mean_act_s"] / r["elastic"]["real"]["mean_act_s"]
        out["act_ratio_fcfs_simulated"] = (
            r["fcfs"]["simulated"]["mean_act_s"] / r["elastic"]["simulated"]["mean_act_s"]
        )
    return out


def print_real(res: dict[str, Any], file: Any = sys.stdout) -> None:
    """The real run against the simulator's prediction, as a table."""
    print(
        f"real orchestrator: {res['trajectories']} trajectories x {res['steps']} step(s) on "
        f"{res['cores']} logical cores, times x {res['time_scale']}",
        file=file,
    )
    print(f"{'policy':<18}{'':<6}{'mean ACT':>10}{'p50':>8}{'p99':>8}{'step s':>9}", file=file)
    for name, r in res["policies"].items():
        for label in ("real", "simulated"):
            f = r[label]
            print(
                f"{name:<18}{label[:5]:<6}{f['mean_act_s']:>10.3f}{f['p50_act_s']:>8.3f}{f['p99_act_s']:>8.3f}"
                f"{f['mean_step_s']:>9.2f}",
                file=file,
            )
        e = r["error"]
        print(
            f"{name:<18}{'error':<6}"
            + "".join(
                f"{100 * e.get(k, 0):>+9.0f}%"
                for k in ("mean_act_s", "p50_act_s", "p99_act_s", "mean_step_s")
            ),
            file=file,
        )
    if "act_ratio_fcfs_real" in res:
        print(
            f"FCFS / elastic mean ACT: real x{res['act_ratio_fcfs_real']:.2f}, "
            f"simulated x{res['act_ratio_fcfs_simulated']:.2f}",
            file=file,
        )


def main(argv: list[str] | None = None) -> int:
    """Run only the real-mode comparison (``python -m benchmarks.act_real``)."""
    p = argparse.ArgumentParser(
        description="The default workload scaled down to this machine, on the real orchestrator, "
        "against the simulator's prediction."
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed (default 0)")
    p.add_argument(
        "--policies",
        default="elastic,fcfs,trajectory_bound",
        help="comma-separated, of elastic, fcfs, trajectory_bound (default all three)",
    )
    args = p.parse_args(argv)
    policies = tuple(x for x in args.policies.split(",") if x)
    # Only these are configured on the real server as the simulator's copy is (see _scheduler_options).
    allowed = ["elastic", "fcfs", "trajectory_bound"]
    bad = [x for x in policies if x not in allowed]
    if bad or not policies:
        p.error(f"unknown policies {bad}; choose from {allowed}")
    res = run_real(seed=args.seed, policies=policies)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_real(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
