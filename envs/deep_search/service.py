"""``tangram-search-server``: a local web-search API over the prepared index, with a per-key quota.

It behaves as a commercial search API does: ``GET /search?q=...&k=5`` and ``GET /open?id=...`` answer
JSON; each key (``X-Api-Key`` header) has a token bucket (``--rate``, ``--burst``) and a cap on
requests in flight (``--max-in-flight``), and a request beyond them gets **429** with ``Retry-After``
(whole seconds, as HTTP says) and the exact wait in the body (``retry_after_s``). ``--latency-ms``
emulates a remote service's round trip. ``GET /stats`` reports the service's own counters (accepted,
429s, in flight at most, per key), which the quota benchmark reads. Loopback only.

    tangram-search-server --port 8765 --key SECRET --rate 20 --burst 5 --max-in-flight 4
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from tangram_env.envs.deep_search.index import SearchIndex

log = logging.getLogger(__name__)
ANONYMOUS = ""  # the one quota of a service started without keys


class KeyQuota:
    """One key's token bucket, in-flight count and counters (thread-safe under the service's lock)."""

    def __init__(self, rate: float, burst: float, max_in_flight: int | None, now: float) -> None:
        self.rate, self.burst, self.max_in_flight = rate, burst, max_in_flight
        self.tokens, self.stamp = burst, now
        self.in_flight = self.peak_in_flight = 0
        self.accepted = self.throttled = 0
        self.first_at: float | None = None
        self.last_at: float | None = None

    def admit(self, now: float) -> float | None:
        """Take a token and a slot; or return the seconds to wait (a 429's Retry-After)."""
        if self.rate > 0 and now > self.stamp:
            self.tokens = min(self.burst, self.tokens + self.rate * (now - self.stamp))
            self.stamp = now
        if self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
            self.throttled += 1
            return 0.05  # a slot frees when a request ends: the provider cannot know when
        if self.rate > 0 and self.tokens < 1.0:
            self.throttled += 1
            return (1.0 - self.tokens) / self.rate
        self.tokens -= 1.0
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        self.accepted += 1
        self.first_at = now if self.first_at is None else self.first_at
        self.last_at = now
        return None

    def figures(self) -> dict[str, Any]:
        """The key's counters as plain data."""
        return {
            "accepted": self.accepted,
            "throttled": self.throttled,
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "first_at": self.first_at,
            "last_at": self.last_at,
        }


class SearchService:
    """The service's state: the index, the quotas per key secret, the emulated latency."""

    def __init__(
        self,
        index: SearchIndex,
        *,
        keys: Sequence[str] = (),
        rate: float = 0.0,
        burst: float | None = None,
        max_in_flight: int | None = None,
        latency_s: float = 0.0,
    ) -> None:
        self.index = index
        self.latency_s = latency_s
        self.lock = threading.Lock()
        now = time.monotonic()
        bucket = burst if burst is not None else max(1.0, rate)
        names = list(keys) or [ANONYMOUS]
        self.quotas = {k: KeyQuota(rate, bucket, max_in_flight, now) for k in names}
        self.open_access = not keys
        self.config = {"rate": rate, "burst": bucket, "max_in_flight": max_in_flight, "latency_s": latency_s}

    def stats(self) -> dict[str, Any]:
        """The service's own counters, overall and per key (keys shown by position, never by secret)."""
        with self.lock:
            per_key = {f"key{i}": q.figures() for i, q in enumerate(self.quotas.values())}
        return {
            "config": self.config,
            "accepted": sum(k["accepted"] for k in per_key.values()),
            "throttled": sum(k["throttled"] for k in per_key.values()),
            "peak_in_flight": max((k["peak_in_flight"] for k in per_key.values()), default=0),
            "keys": per_key,
            "now": time.monotonic(),
        }


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _reply(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        service = self.server.service
        url = urlparse(self.path)
        params = {k: v[0] for k, v in parse_qs(url.query).items()}
        if url.path == "/stats":
            self._reply(200, service.stats())
            return
        if url.path not in ("/search", "/open"):
            self._reply(404, {"error": f"unknown endpoint {url.path}; use /search, /open or /stats"})
            return
        key = ANONYMOUS if service.open_access else self.headers.get("X-Api-Key", "")
        quota = service.quotas.get(key)
        if quota is None:
            self._reply(401, {"error": "missing or unknown X-Api-Key"})
            return
        with service.lock:
            wait = quota.admit(time.monotonic())
        if wait is not None:
            self._reply(
                429,
                {"error": "rate limit exceeded", "retry_after_s": round(wait, 4)},
                {"Retry-After": str(max(1, math.ceil(wait)))},
            )
            return
        try:
            if service.latency_s > 0:
                time.sleep(service.latency_s)  # the emulated round trip, holding the request's slot
            status, body = self._answer(url.path, params)
        finally:
            with service.lock:
                quota.in_flight -= 1
        self._reply(status, body)

    def _answer(self, path: str, params: dict[str, str]) -> tuple[int, dict[str, Any]]:
        index = self.server.service.index
        if path == "/search":
            query = params.get("q", "")
            if not query.strip():
                return 400, {"error": "give a query: /search?q=WORDS"}
            try:
                k = max(1, min(20, int(params.get("k", "5"))))
            except ValueError:
                return 400, {"error": "k must be an integer"}
            return 200, {"query": query, "results": index.search(query, k)}
        doc = index.open(params.get("id", ""))
        if doc is None:
            return 404, {"error": f"no document with id {params.get('id', '')!r}"}
        return 200, {"id": doc.id, "title": doc.title, "text": doc.body()}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, address: tuple[str, int], service: SearchService) -> None:
        super().__init__(address, _Handler)
        self.service = service


def start(service: SearchService, port: int = 0, host: str = "127.0.0.1") -> tuple[_Server, str]:
    """Serve ``service`` on a thread (port 0 picks one); returns the server and its base URL."""
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"the search service binds loopback only, not {host!r}")
    server = _Server((host, port), service)
    threading.Thread(target=server.serve_forever, name="search-service", daemon=True).start()
    return server, f"http://{host}:{server.server_address[1]}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tangram-search-server``."""
    from tangram_env.envs.deep_search.prepare import default_index_path

    p = argparse.ArgumentParser(prog="tangram-search-server", description=__doc__.split("\n")[0])
    p.add_argument("--index", help="index file (default: the one `tangram-env prepare deep-search` built)")
    p.add_argument("--port", type=int, default=8765, help="loopback port (0: any free one; default 8765)")
    p.add_argument(
        "--key", action="append", default=[], help="an accepted X-Api-Key secret (repeatable; none: open)"
    )
    p.add_argument("--rate", type=float, default=0.0, help="requests per second per key (0: unlimited)")
    p.add_argument("--burst", type=float, help="requests a key may make at once (default max(1, rate))")
    p.add_argument("--max-in-flight", type=int, help="requests in flight per key (default: no cap)")
    p.add_argument("--latency-ms", type=float, default=0.0, help="emulated round trip per request")
    p.add_argument("--ready-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keys = list(args.key) + [k for k in os.environ.get("TANGRAM_SEARCH_KEYS", "").split(",") if k]
    try:
        index = SearchIndex(args.index or default_index_path())
    except FileNotFoundError as exc:
        print(f"tangram-search-server: {exc}", file=sys.stderr)
        return 2
    service = SearchService(
        index,
        keys=keys,
        rate=args.rate,
        burst=args.burst,
        max_in_flight=args.max_in_flight,
        latency_s=args.latency_ms / 1000,
    )
    server, url = start(service, args.port)
    log.info("search service on %s over %d documents (%s)", url, index.count(), index.path)
    if args.ready_file:
        Path(args.ready_file).write_text(url + "\n")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0


class ServiceProcess:
    """A ``tangram-search-server`` child on a free loopback port (for envs, tests and benchmarks)."""

    def __init__(self, index: str | Path, *args: str, timeout_s: float = 30.0) -> None:
        import subprocess
        import tempfile

        fd, ready = tempfile.mkstemp(prefix="tangram-search-", suffix=".url")
        os.close(fd)
        os.unlink(ready)
        cmd = [sys.executable, "-m", "tangram_env.envs.deep_search.service", "--index", str(index)]
        self.proc = subprocess.Popen([*cmd, "--port", "0", "--ready-file", ready, *args])
        deadline = time.monotonic() + timeout_s
        while not (os.path.exists(ready) and Path(ready).read_text().endswith("\n")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"tangram-search-server did not start (exit {self.proc.poll()})")
            time.sleep(0.02)
        self.url = Path(ready).read_text().strip()
        os.unlink(ready)

    def stats(self) -> dict[str, Any]:
        """The service's counters (``GET /stats``)."""
        import urllib.request

        with urllib.request.urlopen(self.url + "/stats", timeout=10) as reply:
            data: dict[str, Any] = json.load(reply)
        return data

    def stop(self) -> None:
        """Stop the child (SIGTERM, then SIGKILL after 5 s)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except Exception:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    sys.exit(main())
