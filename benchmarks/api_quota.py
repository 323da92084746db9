"""One API key shared by four trainers: client-side limiting against Tangram's cluster-wide quota.

``python -m benchmarks.api_quota`` starts the local search service (``tangram-search-server``) with
one key limited to ``--rate`` requests a second, a burst of ``--burst`` and ``--in-flight`` requests at
once, answering 429 with ``Retry-After`` beyond that, and an emulated remote latency. Four trainer
processes with uneven loads (8, 4, 2 and 2 parts of the work) each keep ``--concurrency`` searches
outstanding. Arms:

* ``naive``: no limiter; a 429 is retried with exponential backoff and jitter;
* ``per_trainer_full``: each trainer limits itself to the key's whole rate, burst and in-flight cap
  (as if it owned the key), retrying 429s with backoff;
* ``per_trainer_quarter``: each trainer limits itself to a quarter of the key (a static split);
* ``tangram``: the trainers submit search actions to one orchestrator whose quota (a little under
  the provider's, see docs/quotas.md) spaces every trainer's calls out; 429s would be requeued inside.

The service's own counters give each arm's 429s, accepted requests, throughput and quota utilisation
(accepted / (burst + rate x the time from the first to the last accepted request, while some trainer
still had work waiting)); the trainers give search completion-time percentiles and the makespan. The
JSON printed last has ``tangram_429s`` and ``tangram_quota_utilisation`` at its top level (floors:
zero 429s, at least 0.9).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import random
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, percentile, print_table

SECRET = "bench-secret"
LOADS = (8, 4, 2, 2)  # parts of the work per trainer: uneven, as trainers' steps are
ARMS = ("naive", "per_trainer_full", "per_trainer_quarter", "tangram")
QUERIES = ("river", "novel", "painter", "empire", "music", "war", "city", "science")


class _Limiter:
    """A trainer's own limiter: a token bucket and an in-flight cap (thread-safe)."""

    def __init__(self, rate: float, burst: float, in_flight: int) -> None:
        self.rate, self.burst, self.tokens, self.stamp = rate, burst, burst, time.monotonic()
        self.slots = threading.BoundedSemaphore(in_flight)
        self.lock = threading.Lock()

    def acquire(self) -> None:
        self.slots.acquire()
        while True:
            with self.lock:
                now = time.monotonic()
                self.tokens = min(self.burst, self.tokens + self.rate * (now - self.stamp))
                self.stamp = now
                if self.tokens >= 1.0:
                    self.tokens -= 1.0
                    return
                wait = (1.0 - self.tokens) / self.rate
            time.sleep(wait)

    def release(self) -> None:
        self.slots.release()


def _http_search(url: str, query: str, limiter: _Limiter | None, rng: random.Random) -> int:
    """One search with client-side retries: returns the 429s it met before it got through."""
    throttled, backoff = 0, 0.05
    while True:
        if limiter is not None:
            limiter.acquire()
        try:
            request = urllib.request.Request(
                f"{url}/search?{urllib.parse.urlencode({'q': query})}", headers={"X-Api-Key": SECRET}
            )
            with urllib.request.urlopen(request, timeout=60) as reply:
                reply.read()
            return throttled
        except urllib.error.HTTPError as exc:
            if exc.code != 429:
                raise
            throttled += 1
        finally:
            if limiter is not None:
                limiter.release()
        time.sleep(backoff * (0.5 + rng.random()))  # exponential backoff with jitter
        backoff = min(2.0, backoff * 2)


def _trainer(arm: str, url: str, address: str, name: str, n: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One trainer process: ``n`` searches, ``concurrency`` outstanding; completion times in seconds."""
    rng = random.Random(name)
    queries = [f"{rng.choice(QUERIES)} {i}" for i in range(n)]
    t0 = time.monotonic()
    times: list[float] = []
    runs: list[float] = []  # Tangram: each action's time on its worker (process start + HTTP round trip)
    if arm == "tangram":
        from tangram_env import Action, Client

        def search(i: int, q: str) -> Action:
            return Action(id=f"{name}-{i}", kind="deep_search.search", payload={"query": q, "endpoint": url})

        with Client(address) as client:
            pending: dict[cf.Future[Any], float] = {}
            todo = iter(queries)
            for i, q in zip(range(cfg["concurrency"]), todo, strict=False):
                pending[client.submit([search(i, q)])[0]] = time.monotonic()
            sent = len(pending)
            while pending:
                done, _ = cf.wait(list(pending), return_when=cf.FIRST_COMPLETED)
                for fut in done:
                    result = fut.result()
                    if not result.ok:
                        raise RuntimeError(f"search failed: {result.error_type}: {result.message}")
                    times.append(time.monotonic() - pending.pop(fut))
                    runs.append(result.timing.setup_s + result.timing.run_s)
                    q = next(todo, None)
                    if q is not None:
                        pending[client.submit([search(sent, q)])[0]] = time.monotonic()
                        sent += 1
        return {"times": times, "runs": runs, "client_429s": 0, "start": t0, "end": time.monotonic()}
    share = 0.25 if arm == "per_trainer_quarter" else 1.0
    limiter = None
    if arm != "naive":
        slots = max(1, round(cfg["in_flight"] * share))
        limiter = _Limiter(cfg["rate"] * share, max(1.0, cfg["burst"] * share), slots)
    throttled = 0
    lock = threading.Lock()

    def one(q: str) -> None:
        nonlocal throttled
        start = time.monotonic()
        seen = _http_search(url, q, limiter, random.Random(q))
        with lock:
            throttled += seen
            times.append(time.monotonic() - start)

    with cf.ThreadPoolExecutor(cfg["concurrency"]) as pool:
        list(pool.map(one, queries))
    return {"times": times, "client_429s": throttled, "start": t0, "end": time.monotonic()}


def _index(workdir: Path) -> Path:
    """An index over the vital articles if that package is installed, else over a synthetic corpus."""
    from tangram_env.envs.deep_search.index import Doc, build_index

    try:
        from tangram_env.envs.deep_search.corpus import load_vital_articles

        docs = list(load_vital_articles())
    except FileNotFoundError:
        docs = [
            Doc(f"d{i}", f"Article {i}", "", " ".join(QUERIES[: 1 + i % 8]) + f" {i}") for i in range(2000)
        ]
    return build_index(docs, workdir / "index.sqlite")


def run_arm(arm: str, index: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one arm on a fresh search service (and orchestrator, for ``tangram``); its figures."""
    from tangram_env.envs.deep_search.service import ServiceProcess
    from tangram_env.launch import ServerProcess

    svc = ServiceProcess(
        index,
        "--key", SECRET,
        "--rate", str(cfg["rate"]),
        "--burst", str(cfg["burst"]),
        "--max-in-flight", str(cfg["in_flight"]),
        "--latency-ms", str(cfg["latency_ms"]),
    )  # fmt: skip
    server = None
    address = ""
    try:
        if arm == "tangram":
            margin = cfg["margin"]
            quota = (
                f"web-search:rate={cfg['rate'] * (1 - margin):g},burst={max(1, cfg['burst'] - 1):g},"
                f"in_flight={cfg['in_flight']},keys=bench"
            )
            env = {**os.environ, "PYTHONPATH": str(ROOT), "TANGRAM_API_KEY_BENCH": SECRET}
            plugins = (
                "--no-entry-points",
                "--plugin",
                "tangram_env.envs.deep_search.tools",
                "--no-gpu-worker",
            )
            server = ServerProcess("--quota", quota, *plugins, env=env, cwd=ROOT)
            address = server.address
        total = cfg["requests"]
        counts = [total * part // sum(LOADS) for part in LOADS]
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(len(LOADS), mp_context=ctx) as pool:
            futures = [
                pool.submit(_trainer, arm, svc.url, address, f"t{i}", n, cfg) for i, n in enumerate(counts)
            ]
            outs = [f.result() for f in futures]
        # CLOCK_MONOTONIC is one clock for every process: first trainer's start to last trainer's end.
        makespan = max(o["end"] for o in outs) - min(o["start"] for o in outs)
        stats = svc.stats()
    finally:
        svc.stop()
        if server is not None:
            server.stop()
    key = stats["keys"]["key0"]
    window = (key["last_at"] - key["first_at"]) if key["first_at"] is not None else 0.0
    allowance = cfg["burst"] + cfg["rate"] * window
    times = [t for o in outs for t in o["times"]]
    return {
        "arm": arm,
        "429s": stats["throttled"],
        "accepted": stats["accepted"],
        "throughput_per_s": stats["accepted"] / makespan if makespan else 0.0,
        "quota_utilisation": min(1.0, stats["accepted"] / allowance) if allowance else 0.0,
        "peak_in_flight": stats["peak_in_flight"],
        "search_p50_s": percentile(times, 0.5),
        "search_p99_s": percentile(times, 0.99),
        "makespan_s": makespan,
        "trainer_walls_s": [round(o["end"] - o["start"], 3) for o in outs],
        "client_429s": sum(o["client_429s"] for o in outs),
        **(
            {"action_run_p50_s": percentile([r for o in outs for r in o["runs"]], 0.5)}
            if arm == "tangram"
            else {}
        ),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=20.0, help="the key's requests per second")
    p.add_argument("--burst", type=float, default=5.0)
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--latency-ms", type=float, default=100.0, help="emulated remote latency")
    p.add_argument("--requests", type=int, default=160, help="searches over all trainers")
    p.add_argument("--concurrency", type=int, default=8, help="searches each trainer keeps outstanding")
    p.add_argument("--margin", type=float, default=0.05, help="Tangram's quota: this fraction under the rate")
    p.add_argument("--arms", default=",".join(ARMS))
    args = p.parse_args(argv)
    cfg = {
        "rate": args.rate,
        "burst": args.burst,
        "in_flight": args.in_flight,
        "latency_ms": args.latency_ms,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "margin": args.margin,
    }
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        p.error(f"unknown arms {unknown}; choose from {ARMS}")
    with tempfile.TemporaryDirectory(prefix="tangram-api-quota-") as tmp:
        index = _index(Path(tmp))
        results = {arm: run_arm(arm, index, cfg) for arm in arms}
    for arm, r in results.items():
        print_table(arm, [(k, v) for k, v in r.items() if k != "arm"])
    report: dict[str, Any] = {"config": cfg, "load": os.getloadavg()[0], "arms": results}
    if "tangram" in results:
        report["tangram_429s"] = results["tangram"]["429s"]
        report["tangram_quota_utilisation"] = round(results["tangram"]["quota_utilisation"], 4)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
