"""Two scripted agents on ``swe-bench``, through the orchestrator, with the ACT of every action.

The first agent applies the instance's gold patch (written with ``create``, applied with ``bash``)
and submits: reward 1.0. The second submits without changing anything: reward 0.0. The offline set
is prepared on first use (``tangram-env prepare swe-bench`` does it ahead of time).

    python examples/swe_bench_scripted.py [--address tcp://127.0.0.1:5555] [--instance-id ID] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import tangram_env


def call(name: str, **arguments: Any) -> str:
    """A tool call in the function-calling JSON format the env reads."""
    return json.dumps({"name": name, "arguments": arguments})


def run_episode(env: Any, label: str, moves: list[str], *, seed: int, instance_id: str | None) -> float:
    """Reset, make ``moves`` (``"PATCH"`` stands for the gold patch's moves), print each action's ACT."""
    options = {"instance_id": instance_id} if instance_id else None
    obs, info = env.reset(seed=seed, options=options)
    inst = env.unwrapped.instance
    print(f"\n== {label} agent on {info['instance_id']} ({inst.repo} {inst.version})")
    print("   " + obs.splitlines()[1][:100])
    script: list[str] = []
    for move in moves:
        if move == "PATCH":
            script += [
                call("create", path="/tmp/fix.patch", file_text=inst.patch),
                call("bash", command="git apply /tmp/fix.patch && git status --short"),
            ]
        else:
            script.append(move)
    reward = 0.0
    for action in script:
        obs, reward, terminated, truncated, info = env.step(action)
        tool = json.loads(action)["name"]
        # A tool call is one action; submit is two: the diff in the episode's sandbox, then grading.
        kinds = ["swe_bench.diff", "swe_bench.grade"] if tool == "submit" else [tool]
        for kind, a in zip(kinds, info.get("actions", []), strict=False):
            print(
                f"   {kind:<16} ACT {a['act_s'] * 1000:8.1f} ms  (queued {a['queued_s'] * 1000:6.1f}, "
                f"setup {a['setup_s'] * 1000:6.1f}, run {a['run_s'] * 1000:7.1f}; "
                f"parallelism {a['parallelism']})"
                + ("" if a["ok"] else f"  FAILED: {a.get('error_type')}: {a.get('message')}")
            )
        if terminated or truncated:
            break
    print(f"   {obs.splitlines()[0]}")
    print(f"   reward {reward}")
    return float(reward)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=None, help="orchestrator address (default: an embedded one)")
    parser.add_argument("--instance-id", default=None, help="instance to use (default: picked by the seed)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    env = tangram_env.make("swe-bench", max_turns=10, address=args.address)
    try:
        gold = run_episode(
            env, "gold-patch", ["PATCH", call("submit")], seed=args.seed, instance_id=args.instance_id
        )
        empty = run_episode(env, "do-nothing", [call("submit")], seed=args.seed, instance_id=args.instance_id)
    finally:
        env.close()
    ok = gold == 1.0 and empty == 0.0
    print(f"\ngold-patch agent: {gold}, do-nothing agent: {empty} -> {'as expected' if ok else 'UNEXPECTED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
