"""``tangram-server stats``: a live table of an orchestrator's figures.

    tangram-server stats --address tcp://HOST:5555              # refreshes every second until Ctrl-C
    tangram-server stats --address tcp://HOST:5555 --once       # one table, then exit

The figures are those of the ``Stats`` message (the same the Prometheus endpoint serves): queue length,
running actions, throughput, ACT per kind, errors by reason, and each worker's capacity and use.
Throughput is measured between two samples, so ``--once`` samples twice, ``--interval`` apart.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tangram_env.units import parse_duration

#: Resource types shown per worker: figure key, column title, and whether it is memory (MiB).
_RESOURCES = (
    ("cpu", "cpu", ""),
    ("mem_mb", "mem", "MiB"),
    ("gpu", "gpu", ""),
    ("gpu_mem_mb", "gpu mem", "MiB"),
)


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _map(value: Any) -> Mapping[str, Any]:
    """``value`` if it is a dict, else an empty one (figures from any server version are shown)."""
    return value if isinstance(value, Mapping) else {}


def _total(values: Any, key: str | None = None) -> float:
    """The sum of the numbers among ``values`` (or of their ``key`` entries)."""
    total = 0.0
    for v in values:
        n = _num(_map(v).get(key) if key is not None else v)
        total += n or 0.0
    return total


def _fmt_s(value: Any) -> str:
    """A duration with a unit that suits it (``-`` when unknown)."""
    s = _num(value)
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 120:
        return f"{s:.2f} s"
    return f"{s / 60:.1f} min"


def _fmt_n(value: Any) -> str:
    n = _num(value)
    if n is None:
        return "-"
    return f"{n:g}" if n != int(n) else f"{int(n)}"


class Rates:
    """Throughput between consecutive samples of the ``finished`` and ``submitted`` counts."""

    def __init__(self) -> None:
        self._last: tuple[float, float, float] | None = None
        self._server_id: Any = None
        self.finished_per_s: float | None = None
        self.submitted_per_s: float | None = None

    def add(self, figures: Mapping[str, Any], now: float) -> None:
        """Take one sample (``now`` from a monotonic clock)."""
        finished = _num(figures.get("finished")) or 0.0
        submitted = _num(figures.get("submitted")) or 0.0
        if self._last is not None and now > self._last[0]:
            t0, f0, s0 = self._last
            if figures.get("server_id") == self._server_id:
                self.finished_per_s = max(0.0, (finished - f0) / (now - t0))
                self.submitted_per_s = max(0.0, (submitted - s0) / (now - t0))
            else:  # another orchestrator answered (it restarted): its counts started again
                self.finished_per_s = self.submitted_per_s = None
        self._server_id = figures.get("server_id")
        self._last = (now, finished, submitted)


def _summary(figures: Mapping[str, Any], rates: Rates) -> Table:
    table = Table(title="orchestrator", show_header=False, title_justify="left", box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column(style="bold")
    table.add_column(justify="right")
    errors = _map(figures.get("errors"))
    proto = _map(figures.get("protocol_errors"))
    thr = "-" if rates.finished_per_s is None else f"{rates.finished_per_s:.1f}/s"
    arr = "-" if rates.submitted_per_s is None else f"{rates.submitted_per_s:.1f}/s"
    table.add_row(
        "server", str(figures.get("server_id", "?"))[:12], "scheduler", str(figures.get("scheduler", "?"))
    )
    table.add_row("queued", _fmt_n(figures.get("pending")), "running", _fmt_n(figures.get("running")))
    table.add_row("submitted", _fmt_n(figures.get("submitted")), "finished", _fmt_n(figures.get("finished")))
    table.add_row("arrivals", arr, "throughput", thr)
    table.add_row(
        "errors",
        _fmt_n(_total(errors.values())),
        "protocol errors",
        _fmt_n(_total(proto.values())),
    )
    return table


def _kinds(figures: Mapping[str, Any]) -> Table:
    table = Table(title="ACT per kind", title_justify="left")
    table.add_column("kind", overflow="fold")
    for name in ("count", "mean", "p50", "p99", "queued p50", "queued p99"):
        table.add_column(name, justify="right")
    act = _map(figures.get("act"))
    queued = _map(figures.get("queued"))
    for kind in sorted(act):
        a = _map(act[kind])
        q = _map(queued.get(kind))
        table.add_row(
            str(kind),
            _fmt_n(a.get("count")),
            _fmt_s(a.get("mean_s")),
            _fmt_s(a.get("p50_s")),
            _fmt_s(a.get("p99_s")),
            _fmt_s(q.get("p50_s")),
            _fmt_s(q.get("p99_s")),
        )
    if not act:
        table.add_row("(none yet)", *["-"] * 6)
    return table


def _errors(figures: Mapping[str, Any]) -> Table | None:
    rows: list[tuple[str, str, Any]] = []
    for key, where in (("errors", "action"), ("protocol_errors", "protocol")):
        counts = figures.get(key)
        if isinstance(counts, Mapping):
            rows += [(where, str(reason), n) for reason, n in sorted(counts.items())]
    if not rows:
        return None
    table = Table(title="errors", title_justify="left")
    table.add_column("where")
    table.add_column("reason")
    table.add_column("count", justify="right")
    for where, reason, n in rows:
        table.add_row(where, reason, _fmt_n(n))
    return table


def _usage(capacity: Mapping[str, Any], used: Mapping[str, Any] | None, key: str, memory: bool) -> str:
    """``used/capacity unit pct`` for one resource (``-`` where the worker has none of it)."""
    cap = _num(capacity.get(key))
    if not cap:
        return "-"
    scale, unit = (1024.0, " GiB") if memory and cap >= 1024 else (1.0, " MiB" if memory else "")

    def fmt(x: float) -> str:
        return _fmt_n(round(x / scale, 1 if scale > 1 else 2))

    u = _num(used.get(key)) if used is not None else None
    if u is None:  # an orchestrator that does not report use
        return f"{fmt(cap)}{unit}"
    return f"{fmt(u)}/{fmt(cap)}{unit} {100 * u / cap:.0f}%"


def _worker_notes(figures: Any) -> str:
    """A few words about what a worker hosts (sandbox pools, loaded models)."""
    if not isinstance(figures, Mapping):
        return ""
    notes: list[str] = []
    models = figures.get("models")
    if isinstance(models, Mapping) and models:
        loaded = sorted(
            str(m) for m, f in models.items() if isinstance(f, Mapping) and _num(f.get("replicas"))
        )
        loads = _total(models.values(), "loads")
        evictions = _total(models.values(), "evictions")
        notes.append(
            f"models loaded: {', '.join(loaded) or 'none'}; loads {_fmt_n(loads)}, "
            f"evictions {_fmt_n(evictions)}"
        )
    sandboxes = figures.get("sandboxes")
    if isinstance(sandboxes, Mapping):
        images = _map(sandboxes.get("images"))
        warm = _total(images.values(), "warm")
        in_use = _total(images.values(), "in_use")
        parts = [f"{_fmt_n(warm)} warm", f"{_fmt_n(in_use)} in use"]
        if _num(sandboxes.get("sessions")) is not None:
            parts.append(f"{_fmt_n(sandboxes['sessions'])} sessions")
        notes.append(f"sandboxes ({len(images)} images): {', '.join(parts)}")
    return "; ".join(notes)


def _workers(figures: Mapping[str, Any]) -> list[Table]:
    """Capacity and use per worker, then what each one serves and hosts."""
    workers = _map(figures.get("workers"))
    usage = Table(title=f"workers ({len(workers)})", title_justify="left")
    usage.add_column("worker", overflow="fold")
    usage.add_column("running", justify="right")
    for _, title, _ in _RESOURCES:
        usage.add_column(title, justify="right", no_wrap=True)
    details = Table(title="what the workers serve and host", title_justify="left")
    details.add_column("worker", overflow="fold")
    details.add_column("kinds", overflow="fold")
    details.add_column("hosts", overflow="fold")
    for worker_id in sorted(workers):
        info = _map(workers[worker_id])
        capacity = _map(info.get("capacity"))
        used = info.get("used") if isinstance(info.get("used"), Mapping) else None  # older servers: absent
        usage.add_row(
            str(worker_id),
            _fmt_n(info.get("running")),
            *[_usage(capacity, used, key, unit != "") for key, _, unit in _RESOURCES],
        )
        kinds = info.get("kinds")
        kinds_text = (
            "all" if kinds is None else (", ".join(map(str, kinds[:6])) + (" …" if len(kinds) > 6 else ""))
        )
        details.add_row(str(worker_id), kinds_text, _worker_notes(info.get("figures")))
    return [usage, details] if workers else [usage]


def _quotas(figures: Mapping[str, Any]) -> Table | None:
    """API quotas: per key its tokens, requests in flight, grants and 429s; per API the waiting."""
    quotas = _map(figures.get("api_quotas"))
    if not quotas:
        return None
    table = Table(title="API quotas", title_justify="left")
    table.add_column("api")
    table.add_column("key")
    for name in ("tokens", "in flight", "granted", "429s", "paused", "waiting"):
        table.add_column(name, justify="right")
    for api, q in sorted(quotas.items()):
        q = _map(q)
        for i, (key, k) in enumerate(sorted(_map(q.get("keys")).items())):
            k = _map(k)
            table.add_row(
                str(api) if i == 0 else "",
                str(key),
                f"{_num(k.get('tokens')) or 0.0:.1f}",
                _fmt_n(k.get("in_flight")),
                _fmt_n(k.get("granted")),
                _fmt_n(k.get("throttled")),
                _fmt_s(k.get("paused_s")) if _num(k.get("paused_s")) else "",
                _fmt_n(q.get("waiting")) if i == 0 else "",
            )
    return table


def render(figures: Mapping[str, Any], rates: Rates | None = None) -> Group:
    """The tables for one snapshot of ``figures`` (the dict ``Client.stats()`` returns)."""
    parts: list[Any] = [_summary(figures, rates or Rates()), Text(""), _kinds(figures), *_workers(figures)]
    quotas = _quotas(figures)  # issue 21
    if quotas is not None:
        parts.append(quotas)
    errors = _errors(figures)
    if errors is not None:
        parts.append(errors)
    return Group(*parts)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tangram-server stats", description="Show a live table of an orchestrator's figures."
    )
    p.add_argument("--address", required=True, help="the orchestrator's address, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--interval", default="1s", help="time between refreshes (default 1s; e.g. 500ms, 2s)")
    p.add_argument("--once", action="store_true", help="print one table and exit")
    p.add_argument("--timeout", default="10s", help="how long to wait for each answer (default 10s)")
    return p


def address_problem(address: str) -> str | None:
    """Why ``address`` is not a ZeroMQ endpoint a client can connect to (None when it is)."""
    if address.startswith(("ipc://", "inproc://")) and len(address.split("://", 1)[1]) > 0:
        return None
    if address.startswith("tcp://"):
        try:
            parts = urlsplit(address)
            port = parts.port
        except ValueError as exc:
            return f"bad address {address!r}: {exc}"
        if parts.hostname and port is not None:
            return None
    return f"bad address {address!r}: expected tcp://HOST:PORT (or ipc://PATH)"


def stats_main(argv: list[str]) -> int:
    """Entry point of ``tangram-server stats``; returns the exit code (1 when the server does not answer)."""
    args = _parser().parse_args(argv)
    try:
        interval = parse_duration(args.interval)
        timeout = parse_duration(args.timeout)
    except ValueError as exc:
        print(f"tangram-server stats: {exc}", file=sys.stderr)
        return 2
    if interval <= 0:
        print("tangram-server stats: --interval must be positive", file=sys.stderr)
        return 2
    if timeout <= 0:
        print("tangram-server stats: --timeout must be positive", file=sys.stderr)
        return 2
    problem = address_problem(args.address)
    if problem is not None:
        print(f"tangram-server stats: {problem}", file=sys.stderr)
        return 2
    from tangram_env.client import Client
    from tangram_env.errors import ServerUnavailable

    # A terminal sets the width; piped into a file or a log, rows stay whole instead of 80 columns wide.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    try:
        client = Client(args.address, connect_timeout_s=timeout)
    except ServerUnavailable as exc:
        print(f"tangram-server stats: {exc}", file=sys.stderr)
        return 1
    rates = Rates()
    try:
        figures = client.stats(timeout)
        rates.add(figures, time.monotonic())
        if args.once:
            time.sleep(interval)
            figures = client.stats(timeout)
            rates.add(figures, time.monotonic())
            console.print(render(figures, rates))
            return 0
        with Live(render(figures, rates), console=console, refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(interval)
                figures = client.stats(timeout)
                rates.add(figures, time.monotonic())
                live.update(render(figures, rates))
    except KeyboardInterrupt:
        return 0
    except TimeoutError:
        print(f"tangram-server stats: no answer from {args.address} within {timeout:g}s", file=sys.stderr)
        return 1
    finally:
        client.close()
