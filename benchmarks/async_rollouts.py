"""The asyncio API against a thread per trajectory: the same scripted rollouts on the ``code`` env.

    python -m benchmarks.async_rollouts [--json] [--scales 64,256,1024] [--steps 2] [--think-ms 100,500]
                                        [--rounds 2]

Each trajectory resets the env and makes ``--steps`` submissions, each after a random "LLM" delay;
every submission is one ``code.run_tests`` action in a sandbox (a short action). The same workload
runs twice per scale against one orchestrator: through the sync API with one thread per trajectory
(``env.step`` blocking its thread, all envs sharing one client), and through the asyncio API in one
thread (``await env.astep``, all envs sharing one ``AsyncClient``). Reported per mode: actions per
second (actions / wall time of the whole batch) and client CPU per action (this process's CPU time,
every thread included, over the actions; the orchestrator and sandboxes run in other processes).
Each mode runs ``--rounds`` times per scale, in the order threads, asyncio, asyncio, threads (a drift
in a shared machine's load then favours neither), and its figures pool its runs (actions over total
wall time). ``speedup_at_N`` = asyncio actions/s ÷ threads actions/s at N trajectories.

On a small machine the ``code`` env's sandboxes, not the client, set the pace (each run of the tests
takes a core for tens of milliseconds). So the same two harnesses also run a client-bound workload
(``echo``: an env whose step is one built-in ``echo`` action, no sandbox), reported under ``echo``,
to show what the client itself costs in each mode.
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


class EchoEnv(tangram_env.TangramEnv[int, int]):
    """The client-bound workload: each step is one ``echo`` action (no sandbox, microseconds of work)."""

    def __init__(self, **kwargs: Any) -> None:
        import gymnasium

        super().__init__(**kwargs)
        self.observation_space = gymnasium.spaces.Discrete(2)
        self.action_space = gymnasium.spaces.Discrete(2)

    def _reset(
        self, *, seed: int | None, options: dict[str, Any] | None
    ) -> tangram_env.EnvGen[tuple[int, dict[str, Any]]]:
        return 0, {}
        yield []

    def _step(self, action: int) -> tangram_env.EnvGen[tuple[int, float, bool, bool, dict[str, Any]]]:
        (result,) = yield [tangram_env.Action(kind="echo", payload={"value": 1})]
        return 0, float(result.ok), False, False, {}


#: Workload name -> (make an env on a client, the action of every step, reset options).
WORKLOADS: dict[str, tuple[Any, Any, dict[str, Any] | None]] = {
    "code": (
        lambda client: tangram_env.make("code", client=client, max_turns=10**6),
        SOURCE,
        {"task_id": TASK},
    ),
    "echo": (lambda client: EchoEnv(client=client), 1, None),
}


#: One timed run: the ACTs of its actions, its wall time and this process's CPU time, in seconds.
Run = tuple[list[float], float, float]


def run_threads(client: tangram_env.Client, delays: list[list[float]], workload: str = "code") -> Run:
    """One thread per trajectory, each blocking in ``env.step``."""
    make, move, options = WORKLOADS[workload]
    envs = [make(client) for _ in delays]
    acts: list[float] = []
    lock = threading.Lock()
    start = threading.Barrier(len(delays) + 1)

    def trajectory(env: Any, waits: list[float]) -> None:
        start.wait()
        env.reset(options=options)
        for wait in waits:
            time.sleep(wait)
            _, _, _, _, info = env.step(move)
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
    return acts, wall, cpu


def run_asyncio(client: tangram_env.Client, delays: list[list[float]], workload: str = "code") -> Run:
    """One coroutine per trajectory on one event loop, awaiting ``env.astep``."""
    make, move, options = WORKLOADS[workload]
    aclient = tangram_env.AsyncClient.wrap(client)
    envs = [make(aclient) for _ in delays]
    acts: list[float] = []

    async def trajectory(env: Any, waits: list[float]) -> None:
        await env.areset(options=options)
        for wait in waits:
            await asyncio.sleep(wait)
            _, _, _, _, info = await env.astep(move)
            acts.extend(a["act_s"] for a in info["actions"])

    async def main() -> None:
        await asyncio.gather(*(trajectory(env, waits) for env, waits in zip(envs, delays, strict=True)))

    cpu0, t0 = time.process_time(), time.perf_counter()
    asyncio.run(main())
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    for env in envs:
        env.close()
    return acts, wall, cpu


def compare(
    client: tangram_env.Client, delays: list[list[float]], workload: str, rounds: int
) -> tuple[dict[str, Any], dict[str, Any], float]:
    """Both modes on the same workload, ``rounds`` times each in the order threads, asyncio, asyncio,
    threads, ... (so that a drift in the machine's load favours neither); their figures and the speedup.
    """
    runs: dict[str, list[Run]] = {"threads": [], "asyncio": []}
    for i in range(rounds):
        order = ("threads", "asyncio") if i % 2 == 0 else ("asyncio", "threads")
        for mode in order:
            runs[mode].append((run_threads if mode == "threads" else run_asyncio)(client, delays, workload))
    threads, asyncio_ = _figures(runs["threads"]), _figures(runs["asyncio"])
    return threads, asyncio_, asyncio_["actions_per_s"] / max(1e-9, threads["actions_per_s"])


def _figures(runs: list[Run]) -> dict[str, Any]:
    acts = [a for run_acts, _, _ in runs for a in run_acts]
    wall, cpu = sum(r[1] for r in runs), sum(r[2] for r in runs)
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
    p.add_argument(
        "--rounds", type=int, default=2, help="timed runs per mode and scale, alternating which goes first"
    )
    p.add_argument(
        "--echo-steps", type=int, default=20, help="steps per trajectory of the echo workload (0: skip it)"
    )
    args = p.parse_args(argv)
    scales = [int(s) for s in args.scales.split(",")]
    think = tuple(float(x) / 1000 for x in args.think_ms.split(","))
    figures: dict[str, Any] = {
        "env": "code",
        "steps": args.steps,
        "think_ms": args.think_ms,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "load_before": round(os.getloadavg()[0], 2),
        "scales": {},
        "echo": {"steps": args.echo_steps, "think_ms": "0,2", "scales": {}},
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
                threads, asyncio_, speedup = compare(client, delays, "code", args.rounds)
                figures["scales"][str(n)] = {
                    "threads": threads,
                    "asyncio": asyncio_,
                    "speedup": round(speedup, 2),
                }
                figures[f"speedup_at_{n}"] = round(speedup, 2)
                if args.echo_steps:
                    echo_delays = _delays(n, args.echo_steps, (0.0, 0.002), args.seed + n)
                    echo = compare(client, echo_delays, "echo", args.rounds)
                    echo_threads, echo_asyncio, echo_speedup = echo
                    figures["echo"]["scales"][str(n)] = {
                        "threads": echo_threads,
                        "asyncio": echo_asyncio,
                        "speedup": round(echo_speedup, 2),
                    }
                    figures["echo"][f"speedup_at_{n}"] = round(echo_speedup, 2)
                if not args.json:
                    print_table(
                        f"{n} trajectories x {args.steps} steps (think {args.think_ms} ms)",
                        [
                            ("threads: actions/s", threads["actions_per_s"]),
                            ("asyncio: actions/s", asyncio_["actions_per_s"]),
                            ("threads: client CPU ms/action", f"{threads['client_cpu_ms_per_action']:.3f}"),
                            ("asyncio: client CPU ms/action", f"{asyncio_['client_cpu_ms_per_action']:.3f}"),
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
                    if args.echo_steps:
                        echo = figures["echo"]["scales"][str(n)]
                        print_table(
                            f"client-bound: {n} trajectories x {args.echo_steps} echo steps",
                            [
                                ("threads: actions/s", echo["threads"]["actions_per_s"]),
                                ("asyncio: actions/s", echo["asyncio"]["actions_per_s"]),
                                (
                                    "threads: client CPU ms/action",
                                    echo["threads"]["client_cpu_ms_per_action"],
                                ),
                                (
                                    "asyncio: client CPU ms/action",
                                    echo["asyncio"]["client_cpu_ms_per_action"],
                                ),
                                ("speedup (asyncio / threads)", f"{echo['speedup']:.2f}x"),
                            ],
                        )
    finally:
        server.stop()
    figures["load_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
