"""Soak: steady load on one orchestrator for a while; its memory and open files must stay flat.

    python -m benchmarks.soak [--minutes 10] [--clients 4] [--json]

Clients submit a steady mix (inline no-ops and forked ``sleep 0`` actions) in windows; every
``--sample-s`` seconds the server's resident memory and open file descriptors are read from /proc.
The JSON reports the samples, the growth from the first sample after warm-up to the last, and
whether every result arrived.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from typing import Any

from benchmarks.common import print_table, start_server


def _proc_figures(pid: int) -> tuple[float, int]:
    """Resident memory (MiB) and open file descriptors of ``pid``."""
    with open(f"/proc/{pid}/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def _load(address: str, until: float, out: Any) -> None:
    from tangram_env import Action, Client

    done = failed = 0
    with Client(address) as client:
        while time.monotonic() < until:
            batch = [Action(kind="noop") for _ in range(200)] + [
                Action(kind="sleep", payload={"seconds": 0}) for _ in range(4)
            ]
            for fut in client.submit(batch):
                if fut.result(120).ok:
                    done += 1
                else:
                    failed += 1
    out.put((done, failed))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=30.0)
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    args = p.parse_args(argv)
    with start_server("--no-entry-points") as server:
        until = time.monotonic() + args.minutes * 60
        out: Any = mp.Queue()
        procs = [mp.Process(target=_load, args=(server.address, until, out)) for _ in range(args.clients)]
        for proc in procs:
            proc.start()
        t0 = time.monotonic()
        samples = []
        while time.monotonic() < until:
            rss, fds = _proc_figures(server.pid)
            samples.append({"t_s": round(time.monotonic() - t0, 1), "rss_mb": round(rss, 1), "fds": fds})
            if not args.json:
                print(f"t={samples[-1]['t_s']:>6}s rss={rss:7.1f} MiB fds={fds}", flush=True)
            time.sleep(min(args.sample_s, max(0.0, until - time.monotonic())))
        totals = [out.get(timeout=300) for _ in procs]
        for proc in procs:
            proc.join(30)
        rss, fds = _proc_figures(server.pid)
        samples.append({"t_s": round(time.monotonic() - t0, 1), "rss_mb": round(rss, 1), "fds": fds})
    steady = [s for s in samples if s["t_s"] >= args.warmup_s] or samples
    figures = {
        "minutes": args.minutes,
        "actions_ok": sum(d for d, _ in totals),
        "actions_failed": sum(f for _, f in totals),
        "rss_mb_growth": steady[-1]["rss_mb"] - steady[0]["rss_mb"],
        "fds_growth": steady[-1]["fds"] - steady[0]["fds"],
        "samples": samples,
    }
    if not args.json:
        print_table(
            "Soak",
            [
                ("actions ok", figures["actions_ok"]),
                ("actions failed", figures["actions_failed"]),
                ("RSS growth after warm-up (MiB)", float(figures["rss_mb_growth"])),
                ("fd growth after warm-up", figures["fds_growth"]),
            ],
        )
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
