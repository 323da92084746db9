"""Does a slow sandbox set-up stall everyone else? A no-op's round trip while sandboxes start cold.

    python -m benchmarks.setup_stall [--trajectories 32] [--delay-s 0.5] [--rounds 1000]
                                     [--sandbox docker] [--json-out FILE]

One client sends no-op actions (inline: they measure the orchestrator's loop), 2 ms apart,
first alone (idle), then while ``--trajectories`` other trajectories each run a ``bash true`` in a
sandbox of their own, all at once, on a provider whose every create takes ``--delay-s`` longer
(:class:`SlowProvider`, the unisolated provider plus a sleep, selected by its ``module:Class``
name), or on a real provider with ``--sandbox`` (``docker``: a container start each, its engine's
CPU on the host's cores beside the server's). Prints a table and one JSON object with
``idle_rtt_us_p99`` and ``stall_rtt_us_p99`` at the top level. The floor: the no-op p99 while
sandboxes start stays within 2x of its idle p99, which holds only when sandbox set-up runs off the
orchestrator's loop. Idle and stalled probes are paced
alike; the idle figures of back-to-back round trips (cheaper) are reported beside them.

Then the same burst again, in the sessions that now hold their sandboxes (no set-up at all):
``warm_burst_rtt_us_p99`` is what the actions alone cost the loop (handing each to a thread of the
server, their processes on the same cores), so that ``stall_rtt_us_p99`` above it is set-up's share.
On Docker, last, as many containers start from this process, not the server
(``host_burst_rtt_us_p99``): what the engine's own work costs the host's cores, with no server part.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import percentile, print_table, start_server
from tangram_env import Client
from tangram_env.sandbox import Sandbox, SandboxSpec
from tangram_env.server.sandbox.unisolated import UnisolatedProvider

#: The floor the issue names: stall p99 at most this many times the idle p99.
FLOOR_RATIO = 2.0


class SlowProvider(UnisolatedProvider):
    """The unisolated provider, with ``$TANGRAM_SLOW_CREATE_S`` seconds (default 0.5) added to every
    create: a stand-in for a Docker container start or an e2b HTTP create.
    """

    name = "slow"

    def __init__(self, **opts: Any) -> None:
        super().__init__(**opts)
        self.delay_s = float(os.environ.get("TANGRAM_SLOW_CREATE_S", "0.5"))

    def create(self, spec: SandboxSpec) -> Sandbox:
        """Sleep, then a real (unisolated) sandbox."""
        time.sleep(self.delay_s)
        return super().create(spec)


#: Pause between two probes: a steady probe, not a flood, the same while idle and during the burst
#: (a round trip after a pause costs more than one right after another: caches, a core waking up).
PACE_S = 0.002


def _noop_rtts(
    client: Client, until: threading.Event | None, rounds: int, pace_s: float = PACE_S
) -> list[float]:
    """No-op round trips (us), ``pace_s`` apart: ``rounds`` of them, or as many as fit until ``until``
    is set.
    """
    out: list[float] = []
    while (until is None and len(out) < rounds) or (until is not None and not until.is_set()):
        t0 = time.perf_counter()
        client.call("noop", timeout=120)
        out.append((time.perf_counter() - t0) * 1e6)
        if pace_s:
            time.sleep(pace_s)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure, print the table and the JSON, and return the JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--delay-s", type=float, default=0.5, help="extra seconds per sandbox create")
    parser.add_argument("--rounds", type=int, default=1000, help="idle no-op round trips")
    parser.add_argument(
        "--sandbox",
        default="benchmarks.setup_stall:SlowProvider",
        help="the sandbox provider (default: the slow stand-in; e.g. docker)",
    )
    parser.add_argument("--json-out", help="also write the JSON here")
    args = parser.parse_args(argv)
    os.environ["TANGRAM_SLOW_CREATE_S"] = str(args.delay_s)  # the server child inherits it
    server = start_server("--sandbox", args.sandbox, "--cpus", str(max(2, args.trajectories)))
    try:
        with Client(server.address) as probe, Client(server.address) as starter:
            _noop_rtts(probe, None, 50, 0)  # warm-up
            back_to_back = _noop_rtts(probe, None, args.rounds, 0)
            idle = _noop_rtts(probe, None, args.rounds)
            # Each trajectory's first command: a cold sandbox each.
            stalled, setup_s = _probe_during(probe, starter, args.trajectories, "cold")
            # The same commands again, in the sessions that now hold their sandboxes.
            warm, _ = _probe_during(probe, starter, args.trajectories, "warm")
            starter.close_sessions([f"stall-{i}" for i in range(args.trajectories)])
            if args.sandbox == "docker":
                host_burst = _probe_host_burst(probe, args.trajectories)
    finally:
        server.stop()
    idle_p99, stall_p99 = percentile(idle, 0.99), percentile(stalled, 0.99)
    if args.sandbox == "docker":
        figures_host = {
            "host_burst_rtt_us_p99": percentile(host_burst, 0.99),
            "host_burst_rtt_us_max": max(host_burst),
        }
    else:
        figures_host = {}
    figures: dict[str, Any] = {
        "idle_rtt_us_p99": idle_p99,
        "stall_rtt_us_p99": stall_p99,
        "ratio": stall_p99 / idle_p99,
        "floor_ratio": FLOOR_RATIO,
        "meets_floor": stall_p99 <= FLOOR_RATIO * idle_p99,
        "idle_rtt_us_p50": percentile(idle, 0.5),
        "idle_back_to_back_rtt_us_p50": percentile(back_to_back, 0.5),
        "idle_back_to_back_rtt_us_p99": percentile(back_to_back, 0.99),
        "stall_rtt_us_p50": percentile(stalled, 0.5),
        "stall_rtt_us_max": max(stalled),
        "warm_burst_rtt_us_p99": percentile(warm, 0.99),
        "warm_burst_samples": len(warm),
        "stall_samples": len(stalled),
        "trajectories": args.trajectories,
        "sandbox": args.sandbox,
        "create_delay_s": args.delay_s if args.sandbox.endswith(":SlowProvider") else 0.0,
        "all_sandboxes_ready_s": setup_s,
        **figures_host,
        "host": {"cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]},
    }
    print_table(
        f"no-op round trip while {args.trajectories} sandboxes start ({os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.2f})",
        [
            (
                "idle, back to back p50 / p99 us",
                f"{percentile(back_to_back, 0.5):.0f} / {percentile(back_to_back, 0.99):.0f}",
            ),
            ("idle p50 / p99 us", f"{figures['idle_rtt_us_p50']:.0f} / {idle_p99:.0f}"),
            (
                "during set-up p50 / p99 / max us",
                f"{figures['stall_rtt_us_p50']:.0f} / {stall_p99:.0f} / {figures['stall_rtt_us_max']:.0f}",
            ),
            ("p99 ratio (floor <= 2)", f"{figures['ratio']:.1f}"),
            ("same burst, sandboxes warm: p99 us", f"{figures['warm_burst_rtt_us_p99']:.0f}"),
            *(
                [
                    (
                        "as many containers started outside the server: p99 us",
                        f"{figures_host['host_burst_rtt_us_p99']:.0f}",
                    )
                ]
                if figures_host
                else []
            ),
            (f"{args.trajectories} cold sandboxes ready in s", f"{setup_s:.1f}"),
        ],
    )
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return figures


def _probe_during(probe: Client, starter: Client, trajectories: int, tag: str) -> tuple[list[float], float]:
    """No-op round trips while each trajectory runs one ``bash true``; and how long those took (s)."""
    done = threading.Event()
    rtts: list[float] = []
    prober = threading.Thread(target=lambda: rtts.extend(_noop_rtts(probe, done, 0)))
    t0 = time.perf_counter()
    prober.start()
    futures = starter.submit([starter_action(i, tag) for i in range(trajectories)])
    results = [f.result(timeout=600) for f in futures]
    elapsed = time.perf_counter() - t0
    done.set()
    prober.join()
    failed = [r for r in results if not r.ok]
    if failed:
        raise SystemExit(f"{len(failed)} sandbox actions failed, e.g. {failed[0].error}")
    return rtts, elapsed


def _probe_host_burst(probe: Client, n: int) -> list[float]:
    """No-op round trips while another process (this one, not the server) starts ``n`` containers of
    the base image at once and runs ``true`` in each: what the engine's own work costs the host.
    """
    import docker

    engine = docker.from_env()
    done = threading.Event()
    rtts: list[float] = []
    prober = threading.Thread(target=lambda: rtts.extend(_noop_rtts(probe, done, 0)))
    label = {"tangram.benchmark": f"setup-stall-{os.getpid()}"}

    def start_one() -> None:
        box = engine.containers.run(
            "tangram/default", ["sleep", "infinity"], detach=True, init=True, labels=label
        )
        box.exec_run(["true"])

    starters = [threading.Thread(target=start_one) for _ in range(n)]
    prober.start()
    try:
        for t in starters:
            t.start()
        for t in starters:
            t.join()
    finally:
        done.set()
        prober.join()
        for box in engine.containers.list(all=True, filters={"label": "tangram.benchmark"}):
            if box.labels.get("tangram.benchmark") == label["tangram.benchmark"]:
                box.remove(force=True)
    return rtts


def starter_action(i: int, tag: str = "cold") -> Any:
    """Trajectory ``i``'s command, in its own sandbox session (the first one: a cold create each)."""
    from tangram_env.protocol import Action

    return Action(
        id=f"stall-{i}-{tag}-{os.getpid()}", kind="bash", payload={"command": "true"}, affinity=f"stall-{i}"
    )


if __name__ == "__main__":
    main()
