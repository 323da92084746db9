"""What the orchestrator costs: a no-op action's round trip against raw ZeroMQ, and no-op throughput.

    python -m benchmarks.overhead [--json] [--rounds 3000] [--clients 4]

The raw round trip is a DEALER talking to a ROUTER that echoes in another process (the floor for any
request over ZeroMQ on this machine); the no-op round trip is ``client.call("noop")`` through a real
``tangram-server`` (validation, ids, result storage and acknowledgement included). The two are measured
in alternating blocks, so a change in machine load between them cannot flatter or hurt the ratio.
Throughput is no-op actions per second with several client processes submitting batches at once.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from typing import Any

import zmq

from benchmarks.common import percentile, print_table, start_server


def _echo_server(port: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    while True:
        frames = sock.recv_multipart()
        if frames[1] == b"stop":
            break
        sock.send_multipart(frames)
    sock.close(linger=0)


class _RawPeer:
    """A DEALER talking to a ROUTER that echoes from another process: the floor for any request."""

    def __init__(self) -> None:
        port: Any = mp.Queue()
        self.proc = mp.Process(target=_echo_server, args=(port,), daemon=True)
        self.proc.start()
        self.sock: Any = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.connect(f"tcp://127.0.0.1:{port.get(timeout=10)}")

    def rtt_us(self, rounds: int, payload: bytes = b"x" * 64) -> list[float]:
        """Sequential round trips of one small message."""
        sock, out = self.sock, []
        for _ in range(rounds):
            t0 = time.perf_counter()
            sock.send(payload)
            sock.recv()
            out.append((time.perf_counter() - t0) * 1e6)
        return out

    def close(self) -> None:
        self.sock.send(b"stop")
        self.sock.close(linger=0)
        self.proc.join(5)


def noop_rtt_us(client: Any, rounds: int) -> list[float]:
    """Sequential ``noop`` actions through the orchestrator."""
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        client.call("noop")
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def round_trips(address: str, rounds: int, blocks: int = 6) -> tuple[list[float], list[float]]:
    """Raw and no-op round trips, measured in alternating blocks so both see the same machine load."""
    from tangram_env import Client

    raw_peer, raw, noop = _RawPeer(), [], []
    with Client(address) as client:
        raw_peer.rtt_us(300)  # warm-up
        noop_rtt_us(client, 300)
        for _ in range(blocks):
            raw += raw_peer.rtt_us(rounds // blocks)
            noop += noop_rtt_us(client, rounds // blocks)
    raw_peer.close()
    return raw, noop


def _load_client(address: str, n: int, batch: int, start: Any, out: Any) -> None:
    from tangram_env import Action, Client

    with Client(address) as client:
        start.wait()
        t0 = time.perf_counter()
        for first in range(0, n, batch):
            futures = client.submit([Action(kind="noop") for _ in range(min(batch, n - first))])
            for fut in futures:
                assert fut.result(120).ok
        out.put((n, time.perf_counter() - t0))


def noop_throughput(address: str, clients: int, per_client: int, batch: int = 500) -> float:
    """No-op actions per second, ``clients`` processes each submitting ``batch`` at a time."""
    start = mp.Event()
    out: Any = mp.Queue()
    procs = [
        mp.Process(target=_load_client, args=(address, per_client, batch, start, out)) for _ in range(clients)
    ]
    for p in procs:
        p.start()
    time.sleep(1.0)  # let every client connect before the clock starts
    t0 = time.perf_counter()
    start.set()
    done = [out.get(timeout=300) for _ in procs]
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join(10)
    return sum(n for n, _ in done) / elapsed


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.add_argument("--rounds", type=int, default=3000)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--per-client", type=int, default=20_000)
    args = p.parse_args(argv)
    with start_server("--no-entry-points") as server:
        raw, noop = round_trips(server.address, args.rounds)
        throughput = noop_throughput(server.address, args.clients, args.per_client)
    figures = {
        "raw_rtt_us_p50": percentile(raw, 0.5),
        "raw_rtt_us_p99": percentile(raw, 0.99),
        "noop_rtt_us_p50": percentile(noop, 0.5),
        "noop_rtt_us_p99": percentile(noop, 0.99),
        "noop_over_raw_p50": percentile(noop, 0.5) / percentile(raw, 0.5),
        "noop_actions_per_s": throughput,
        "clients": args.clients,
        "floors": {"noop_over_raw_p50_max": 3.0, "noop_actions_per_s_min": 10_000},
    }
    if not args.json:
        print_table(
            "Orchestrator overhead",
            [
                ("raw ZeroMQ round trip p50 (us)", figures["raw_rtt_us_p50"]),
                ("raw ZeroMQ round trip p99 (us)", figures["raw_rtt_us_p99"]),
                ("no-op action round trip p50 (us)", figures["noop_rtt_us_p50"]),
                ("no-op action round trip p99 (us)", figures["noop_rtt_us_p99"]),
                ("no-op / raw (p50)", figures["noop_over_raw_p50"]),
                (f"no-op actions/s ({args.clients} clients)", figures["noop_actions_per_s"]),
            ],
        )
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
