"""The asyncio API against a thread per trajectory: the same scripted rollouts on the ``code`` env.

    python -m benchmarks.async_rollouts [--json] [--scales 64,256,1024] [--steps 2] [--think-ms 100,500]

Each trajectory resets the env and makes ``--steps`` submissions, each after a random "LLM" delay;
every submission is one ``code.run_tests`` action in a sandbox (a short action). The same workload
runs twice per scale against one orchestrator: through the sync API with one thread per trajectory
(``env.step`` blocking its thread, all envs sharing one client), and through the asyncio API in one
thread (``await env.astep``, all envs sharing one ``AsyncClient``). Reported per mode: actions per
second (actions / wall time of the whole batch) and client CPU per action (this process's CPU time,
every thread included, over the actions; the orchestrator and sandboxes run in other processes).
``speedup_at_N`` = asyncio actions/s ÷ threads actions/s at N trajectories.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import threading
import time
from typing import Any

import tangram_env
from benchmarks.common import percentile, print_table, start_server

TASK = "run-length-encode"
SOURCE = """
def run_length_encode(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        j = i
        while j < len(text) and text[j] == text[i]:
            j += 1
        out.append(f"{j - i}{text[i]}")
        i = j
    return "".join(out)
"""


def _delays(n: int, steps: int, think: tuple[float, float], seed: int) -> list[list[float]]:
    """The scripted "LLM" delays, the same for both modes."""
    rng = random.Random(seed)
    return [[rng.uniform(*think) for _ in range(steps)] for _ in range(n)]


def _make_envs(n: int, client: Any) -> list[Any]:
    return [tangram_env.make("code", client=client, max_turns=10**6) for _ in range(n)]


def run_threads(client: tangram_env.Client, delays: list[list[float]]) -> dict[str, Any]:
    """One thread per trajectory, each blocking in ``env.step``."""
    envs = _make_envs(len(delays), client)
    acts: list[float] = []
    lock = threading.Lock()
    start = threading.Barrier(len(delays) + 1)

    def trajectory(env: Any, waits: list[float]) -> None:
        start.wait()
        env.reset(options={"task_id": TASK})
        for wait in waits:
            time.sleep(wait)
            _, _, _, _, info = env.step(SOURCE)
            with lock:
                acts.extend(a["act_s"] for a in info["actions"])

    threads = [
        threading.Thread(target=trajectory, args=(env, waits), daemon=True)
        for env, waits in zip(envs, delays, strict=True)
    ]
    for t in threads:
        t.start()
    cpu0, t0 = time.process_time(), time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    for env in envs:
        env.close()
    return _figures(acts, wall, cpu)


def run_asyncio(client: tangram_env.Client, delays: list[list[float]]) -> dict[str, Any]:
    """One coroutine per trajectory on one event loop, awaiting ``env.astep``."""
    aclient = tangram_env.AsyncClient.wrap(client)
    envs = _make_envs(len(delays), aclient)
    acts: list[float] = []

    async def trajectory(env: Any, waits: list[float]) -> None:
        await env.areset(options={"task_id": TASK})
        for wait in waits:
            await asyncio.sleep(wait)
            _, _, _, _, info = await env.astep(SOURCE)
            acts.extend(a["act_s"] for a in info["actions"])

    async def main() -> None:
        await asyncio.gather(*(trajectory(env, waits) for env, waits in zip(envs, delays, strict=True)))

    cpu0, t0 = time.process_time(), time.perf_counter()
    asyncio.run(main())
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    for env in envs:
        env.close()
    return _figures(acts, wall, cpu)


def _figures(acts: list[float], wall: float, cpu: float) -> dict[str, Any]:
    n = max(1, len(acts))
    return {
        "actions": len(acts),
        "wall_s": round(wall, 2),
        "actions_per_s": round(len(acts) / wall, 1),
        "client_cpu_ms_per_action": round(cpu / n * 1000, 3),
        "act_p50_ms": round(percentile(acts, 0.5) * 1000, 1),
        "act_p99_ms": round(percentile(acts, 0.99) * 1000, 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.add_argument("--scales", default="64,256,1024", help="trajectories per run")
    p.add_argument("--steps", type=int, default=2, help="submissions per trajectory")
    p.add_argument("--think-ms", default="100,500", help="range of the random LLM delay before each step")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    scales = [int(s) for s in args.scales.split(",")]
    think = tuple(float(x) / 1000 for x in args.think_ms.split(","))
    figures: dict[str, Any] = {
        "env": "code",
        "steps": args.steps,
        "think_ms": args.think_ms,
        "cpus": os.cpu_count(),
        "load_before": round(os.getloadavg()[0], 2),
        "scales": {},
    }
    server = start_server()
    try:
        with tangram_env.Client(server.address) as client:
            # Warm the sandbox pool and both code paths before any clock starts.
            warm = _delays(min(16, max(scales)), 1, (0.0, 0.0), args.seed)
            run_threads(client, warm)
            run_asyncio(client, warm)
            for n in scales:
                delays = _delays(n, args.steps, think, args.seed + n)  # type: ignore[arg-type]
                threads = run_threads(client, delays)
                asyncio_ = run_asyncio(client, delays)
                speedup = asyncio_["actions_per_s"] / max(1e-9, threads["actions_per_s"])
                figures["scales"][str(n)] = {
                    "threads": threads,
                    "asyncio": asyncio_,
                    "speedup": round(speedup, 2),
                }
                figures[f"speedup_at_{n}"] = round(speedup, 2)
                if not args.json:
                    print_table(
                        f"{n} trajectories x {args.steps} steps (think {args.think_ms} ms)",
                        [
                            ("threads: actions/s", threads["actions_per_s"]),
                            ("asyncio: actions/s", asyncio_["actions_per_s"]),
                            ("threads: client CPU ms/action", threads["client_cpu_ms_per_action"]),
                            ("asyncio: client CPU ms/action", asyncio_["client_cpu_ms_per_action"]),
                            (
                                "threads: ACT p50 / p99 ms",
                                f"{threads['act_p50_ms']} / {threads['act_p99_ms']}",
                            ),
                            (
                                "asyncio: ACT p50 / p99 ms",
                                f"{asyncio_['act_p50_ms']} / {asyncio_['act_p99_ms']}",
                            ),
                            ("speedup (asyncio / threads)", f"{speedup:.2f}x"),
                        ],
                    )
    finally:
        server.stop()
    figures["load_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
