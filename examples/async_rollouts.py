"""Many concurrent ``swe-bench`` trajectories on one event loop, as an asyncio trainer drives them.

    python examples/async_rollouts.py [--trajectories 256] [--steps 3] [--think-ms 50,400] [--submit]

Each trajectory is one coroutine: reset, then a few tool calls, each after a random "LLM" delay (the
time a model would take to write it), through ``await env.astep(...)``. No thread per trajectory: the
one loop waits on all of them while the orchestrator schedules their actions. ``--submit`` ends each
episode with a submission, graded by the instance's tests (slower: a test run per trajectory). Prints
steps per second and the ACT (action completion time) percentiles of the tool calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import tangram_env

#: What the scripted policy does, in turn: look around, search, read.
SCRIPT = [
    {"name": "bash", "arguments": {"command": "git status --short && ls"}},
    {"name": "bash", "arguments": {"command": "grep -rn 'def ' --include=*.py . | head -n 20"}},
    {"name": "view", "arguments": {"path": "."}},
]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def trajectory(
    i: int, client: tangram_env.AsyncClient, args: argparse.Namespace, acts: list[float]
) -> float:
    """One episode; returns its last reward."""
    rng = random.Random(i)
    env = tangram_env.make("swe-bench", client=client, max_turns=args.steps + 1)
    try:
        await env.areset(seed=i)
        reward = 0.0
        moves = [SCRIPT[s % len(SCRIPT)] for s in range(args.steps)]
        if args.submit:
            moves.append({"name": "submit", "arguments": {}})
        for move in moves:
            await asyncio.sleep(rng.uniform(*args.think_s))  # the "LLM" writes its next call
            _obs, reward, terminated, truncated, info = await env.astep(json.dumps(move))
            if move["name"] != "submit":
                acts.extend(a["act_s"] for a in info["actions"])
            if terminated or truncated:
                break
        return reward
    finally:
        env.close()


async def main(args: argparse.Namespace) -> dict[str, Any]:
    acts: list[float] = []
    async with tangram_env.AsyncClient(args.address) as client:
        # The offline set is prepared once, before the clock starts (the first run builds it).
        tangram_env.make("swe-bench", client=client).close()
        t0 = time.perf_counter()
        rewards = await asyncio.gather(*(trajectory(i, client, args, acts) for i in range(args.trajectories)))
        wall = time.perf_counter() - t0
    steps = args.trajectories * (args.steps + int(args.submit))
    return {
        "trajectories": args.trajectories,
        "steps": steps,
        "wall_s": round(wall, 2),
        "steps_per_s": round(steps / wall, 1),
        "act_p50_ms": round(percentile(acts, 0.50) * 1000, 1),
        "act_p90_ms": round(percentile(acts, 0.90) * 1000, 1),
        "act_p99_ms": round(percentile(acts, 0.99) * 1000, 1),
        "tool_calls": len(acts),
        "mean_reward": round(sum(rewards) / len(rewards), 3),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trajectories", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="tool calls per trajectory")
    p.add_argument("--think-ms", default="50,400", help="range of the random LLM delay before each call")
    p.add_argument("--submit", action="store_true", help="end each episode with a graded submission")
    p.add_argument("--address", default=None, help="orchestrator (default: TANGRAM_ADDRESS, else embedded)")
    args = p.parse_args(argv)
    low, high = (float(x) / 1000 for x in args.think_ms.split(","))
    args.think_s = (low, high)
    return args


if __name__ == "__main__":
    figures = asyncio.run(main(parse_args()))
    print(
        f"{figures['trajectories']} trajectories, {figures['steps']} steps in {figures['wall_s']} s: "
        f"{figures['steps_per_s']} steps/s; ACT of {figures['tool_calls']} tool calls: "
        f"p50 {figures['act_p50_ms']} ms, p90 {figures['act_p90_ms']} ms, p99 {figures['act_p99_ms']} ms"
    )
    print(json.dumps(figures))
