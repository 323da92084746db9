"""``tangram-env``: check envs and prepare their data from the command line.

tangram-env smoke code --episodes 3     # a random agent; prints rewards and ACT per action
tangram-env list                        # registered envs, tools and reward models
tangram-env prepare swe-bench           # build and cache the offline swe-bench instances
tangram-env prepare deep-search         # build the deep-search index and questions
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any


def smoke(env_id: str, episodes: int, max_steps: int, seed: int, address: str | None) -> int:
    """Run a random agent on ``env_id``; print each step's reward and each action's ACT. An unknown env
    or an orchestrator that cannot serve it is one line on stderr, not a traceback.
    """
    from tangram_env.errors import TangramError, UnknownNameError

    try:
        return _smoke(env_id, episodes, max_steps, seed, address)
    except UnknownNameError as exc:
        print(f"tangram-env smoke: {exc.args[0]}; see tangram-env list", file=sys.stderr)
        return 2
    except (TangramError, FileNotFoundError) as exc:
        # No orchestrator there, one without the env's tools, or the env's data not prepared yet.
        print(f"tangram-env smoke {env_id}: {exc}", file=sys.stderr)
        return 1


def _smoke(env_id: str, episodes: int, max_steps: int, seed: int, address: str | None) -> int:
    import tangram_env

    env = tangram_env.make(env_id, address=address)
    acts: list[float] = []
    returns: list[float] = []
    try:
        env.action_space.seed(seed)
        for episode in range(episodes):
            env.reset(seed=seed + episode)
            total, steps, done = 0.0, 0, False
            while not done and steps < max_steps:
                _obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
                steps += 1
                total += reward
                done = terminated or truncated
                step_acts = [a["act_s"] for a in info.get("actions", [])]
                acts += step_acts
                ok = all(a["ok"] for a in info.get("actions", []))
                print(
                    f"episode {episode} step {steps}: reward {reward:.3f} "
                    f"actions {len(step_acts)} ok={ok} "
                    f"ACT {', '.join(f'{a * 1000:.1f} ms' for a in step_acts) or '-'}"
                )
            returns.append(total)
            print(f"episode {episode}: return {total:.3f} in {steps} steps")
    finally:
        env.close()
    summary: dict[str, Any] = {
        "env": env_id,
        "episodes": episodes,
        "mean_return": statistics.fmean(returns) if returns else 0.0,
        "actions": len(acts),
        "mean_act_ms": statistics.fmean(acts) * 1000 if acts else 0.0,
        "max_act_ms": max(acts) * 1000 if acts else 0.0,
    }
    print(json.dumps(summary))
    if not acts:
        print(
            f"note: no action ran: {env_id}'s moves are text in its own protocol, which a random string "
            "is not (each step answered that it was malformed); examples/ has scripted agents that use it",
            file=sys.stderr,
        )
    return 0


def list_all() -> int:
    """Print registered envs, then tools and reward models."""
    import tangram_env
    from tangram_env.plugins import load_plugins

    load_plugins([])
    print("envs:")
    for env_id, env_spec in sorted(tangram_env.registry.items()):
        print(f"  {env_id:<20} {env_spec.entry_point}")
    print("tools and reward models:")
    for kind in tangram_env.tools():
        print(
            f"  {kind['name']:<24} {kind['role']:<13} cpu={kind['demand']['cpu']:g} "
            f"gpu={kind['demand']['gpu']:g} "
            f"{kind['description'].splitlines()[0] if kind['description'] else ''}"
        )
    return 0


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, not {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tangram-env``."""
    p = argparse.ArgumentParser(prog="tangram-env", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("smoke", help="run a random agent on an env")
    s.add_argument("env_id")
    s.add_argument("--episodes", type=_at_least_one, default=2)
    s.add_argument("--max-steps", type=_at_least_one, default=10)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--address", help="orchestrator address (default TANGRAM_ADDRESS, else embedded)")
    sub.add_parser("list", help="registered envs, tools and reward models")
    pr = sub.add_parser(
        "prepare",
        help="build an env's data (swe-bench, deep-search)",
        description="Build an env's data: swe-bench (its offline task set) or deep-search (its index "
        "and questions). `tangram-env prepare ENV --help` lists that env's options.",
    )
    pr.add_argument("env_id", metavar="ENV", help="swe-bench or deep-search")
    pr.add_argument("rest", nargs=argparse.REMAINDER, metavar="...", help="that env's own options")
    args = p.parse_args(argv)
    if args.command == "smoke":
        return smoke(args.env_id, args.episodes, args.max_steps, args.seed, args.address)
    if args.command == "list":
        return list_all()
    if args.env_id == "deep-search":
        from tangram_env.envs.deep_search.corpus import CorpusError
        from tangram_env.envs.deep_search.prepare import prepare_main as prepare_deep_search

        try:
            return prepare_deep_search(args.rest)
        except CorpusError as exc:  # a --corpus file of the wrong shape: said, with the shape
            print(f"tangram-env prepare deep-search: {exc}", file=sys.stderr)
            return 1
    if args.env_id != "swe-bench":
        print(
            f"tangram-env: nothing to prepare for {args.env_id!r} (swe-bench or deep-search)", file=sys.stderr
        )
        return 2
    from tangram_env.envs.swe_bench.prepare import prepare_main

    return prepare_main(args.rest)


if __name__ == "__main__":
    sys.exit(main())
