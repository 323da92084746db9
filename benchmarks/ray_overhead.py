"""What running Tangram's workers on Ray costs: Ray-backed Tangram against standalone Tangram and plain Ray.

    python -m benchmarks.ray_overhead [--json] [--rounds 600] [--clients 4] [--per-client 300]

Three set-ups on this machine, each with two cores for the work:

- **standalone**: ``tangram-server`` lending (almost) nothing itself, plus one ``tangram-worker
  --cpus 2``: every action crosses orchestrator -> worker over ZeroMQ, as on a cluster;
- **ray**: the same orchestrator with ``--ray`` on a local Ray cluster (one node of 2 CPUs), whose
  worker runs as a Ray actor;
- **plain Ray tasks**: ``ray.get(f.remote())`` doing the same work, for reference.

Two actions: ``sleep`` with 0 s (a worker-run no-op: it forks its child like every tool) and ``bash
true`` (a short command in a warm local sandbox). Round trips are sequential calls from one client,
measured in alternating blocks so that a change in machine load hits both set-ups alike; throughput is
``--clients`` processes each submitting ``--per-client`` no-ops in windows of 32.
``ray_vs_standalone_rtt_ratio`` is the larger of the two p50 ratios (ray over standalone).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import ROOT, percentile, print_table, start_server

WORKLOADS: dict[str, tuple[str, dict[str, Any]]] = {
    "noop": ("sleep", {"seconds": 0}),
    "bash": ("bash", {"command": "true"}),
}


def _rtt_us(call: Callable[[], Any], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        call()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def _tangram_call(client: Any, workload: str) -> Callable[[], Any]:
    kind, payload = WORKLOADS[workload]

    def call() -> None:
        result = client.run(kind, payload, timeout_s=60)
        assert result.ok and result.worker != "local", result

    return call


def _load_client(address: str, n: int, start: Any, out: Any) -> None:
    from tangram_env import Action, Client

    kind, payload = WORKLOADS["noop"]
    with Client(address) as client:
        start.wait()
        t0 = time.perf_counter()
        for first in range(0, n, 32):
            futures = client.submit([Action(kind=kind, payload=payload) for _ in range(min(32, n - first))])
            for fut in futures:
                assert fut.result(120).ok
        out.put((n, time.perf_counter() - t0))


def tangram_throughput(address: str, clients: int, per_client: int) -> float:
    """Worker-run no-ops per second, ``clients`` processes submitting at once."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_load_client, args=(address, per_client, start, out)) for _ in range(clients)]
    for p in procs:
        p.start()
    time.sleep(2.0)  # every client connected before the clock starts
    t0 = time.perf_counter()
    start.set()
    done = [out.get(timeout=600) for _ in procs]
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join(10)
    return sum(n for n, _ in done) / elapsed


def _wait_for_worker(client: Any, prefix: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(w.startswith(prefix) for w in client.stats()["workers"]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no worker named {prefix}* joined within {timeout_s:g}s")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.add_argument("--rounds", type=int, default=600, help="sequential round trips per set-up and action")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--per-client", type=int, default=300)
    p.add_argument("--blocks", type=int, default=6)
    args = p.parse_args(argv)

    import ray
    from ray.cluster_utils import Cluster

    from tangram_env.launch import ServerProcess

    env = {**os.environ, "PYTHONPATH": str(ROOT), "TANGRAM_RAY_AUTOSCALE": "0"}
    # Workers import the built-in tools as a plugin, so that `sleep` runs on them, not on the server.
    builtins = ("--plugin", "tangram_env.server.builtin_tools")
    server_args = ("--cpus", "0.01", "--no-gpu-worker", *builtins)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        with contextlib.ExitStack() as stack:
            standalone = stack.enter_context(start_server(*server_args))
            on_ray = stack.enter_context(
                ServerProcess(*server_args, "--ray", cluster.address, env=env, cwd=ROOT)
            )
            worker = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tangram_env.server.worker",
                    "--connect",
                    standalone.address,
                    *builtins,
                    "--cpus",
                    "2",
                    "--mem-mb",
                    "4GiB",
                    "--worker-id",
                    "standalone",
                    "--log-level",
                    "WARNING",
                ],
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                cwd=ROOT,
            )
            stack.callback(worker.wait, 10)
            stack.callback(worker.terminate)
            rtt = _round_trips(standalone.address, on_ray.address, args.rounds, args.blocks)
            throughput = {
                "standalone": tangram_throughput(standalone.address, args.clients, args.per_client),
                "ray": tangram_throughput(on_ray.address, args.clients, args.per_client),
            }
        ray_task = _plain_ray(cluster.address, args.rounds, args.clients * args.per_client)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()

    figures: dict[str, Any] = {}
    for name, values in rtt.items():
        figures[f"{name}_rtt_us_p50"] = percentile(values, 0.5)
        figures[f"{name}_rtt_us_p99"] = percentile(values, 0.99)
    for w in WORKLOADS:
        figures[f"{w}_ray_over_standalone_p50"] = (
            figures[f"ray_{w}_rtt_us_p50"] / figures[f"standalone_{w}_rtt_us_p50"]
        )
    figures["ray_vs_standalone_rtt_ratio"] = max(figures[f"{w}_ray_over_standalone_p50"] for w in WORKLOADS)
    figures["standalone_noop_actions_per_s"] = throughput["standalone"]
    figures["ray_noop_actions_per_s"] = throughput["ray"]
    figures.update(ray_task)
    figures["clients"] = args.clients
    figures["floors"] = {"ray_vs_standalone_rtt_ratio_max": 1.2}
    if not args.json:
        print_table(
            "Tangram on Ray: overhead",
            [
                *((f"{k.replace('_', ' ')}", v) for k, v in figures.items() if k.endswith(("p50", "p99"))),
                ("worker no-ops/s, standalone", figures["standalone_noop_actions_per_s"]),
                ("worker no-ops/s, on Ray", figures["ray_noop_actions_per_s"]),
                ("plain Ray tasks/s", figures["ray_task_noop_per_s"]),
                ("ray / standalone round trip (p50, worst action)", figures["ray_vs_standalone_rtt_ratio"]),
            ],
        )
    print(json.dumps(figures))
    return figures


def _round_trips(standalone: str, on_ray: str, rounds: int, blocks: int) -> dict[str, list[float]]:
    """Sequential round trips of each action on each set-up, in alternating blocks."""
    from tangram_env import Client

    rtt: dict[str, list[float]] = {}
    with Client(standalone) as c_std, Client(on_ray) as c_ray:
        _wait_for_worker(c_std, "standalone")
        _wait_for_worker(c_ray, "ray-")
        calls = {
            (setup, w): _tangram_call(client, w)
            for setup, client in (("standalone", c_std), ("ray", c_ray))
            for w in WORKLOADS
        }
        for call in calls.values():
            _rtt_us(call, 30)  # warm-up: sandboxes, forks, connections
        for _ in range(blocks):
            for (setup, w), call in calls.items():
                rtt.setdefault(f"{setup}_{w}", []).extend(_rtt_us(call, rounds // blocks))
    return rtt


def _plain_ray(address: str, rounds: int, n: int) -> dict[str, float]:
    """Plain Ray tasks doing the same work: an empty task, and one running ``bash -c true`` (no sandbox)."""
    import ray

    ray.init(address=address, log_to_driver=False)

    @ray.remote(num_cpus=1)  # one task per core: Ray reuses its two warm worker processes
    def noop() -> None:
        return None

    @ray.remote(num_cpus=1)
    def bash_true() -> int:
        return subprocess.run(["bash", "-c", "true"], check=False).returncode

    ray.get([noop.remote() for _ in range(50)] + [bash_true.remote() for _ in range(5)])  # warm-up
    noop_rtt = _rtt_us(lambda: ray.get(noop.remote()), rounds)
    bash_rtt = _rtt_us(lambda: ray.get(bash_true.remote()), rounds)
    t0 = time.perf_counter()
    ray.get([noop.remote() for _ in range(n)])
    per_s = n / (time.perf_counter() - t0)
    return {
        "ray_task_noop_rtt_us_p50": percentile(noop_rtt, 0.5),
        "ray_task_noop_rtt_us_p99": percentile(noop_rtt, 0.99),
        "ray_task_bash_rtt_us_p50": percentile(bash_rtt, 0.5),
        "ray_task_bash_rtt_us_p99": percentile(bash_rtt, 0.99),
        "ray_task_noop_per_s": per_s,
    }


if __name__ == "__main__":
    main()
