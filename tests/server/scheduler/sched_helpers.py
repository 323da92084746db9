"""Drivers for scheduler tests: feed events, apply decisions, check the books after every call."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tangram_env.server.scheduler.events import (
    ActionArrived,
    ActionFinished,
    Decision,
    Event,
    Reject,
    Requeue,
    Resources,
    ScalePool,
    Start,
    Tick,
    WorkerAdded,
    WorkerRemoved,
)


@dataclass
class Book:
    """What the tests believe runs where, built only from the decisions (an outside view)."""

    capacity: dict[str, Resources] = field(default_factory=dict)
    running: dict[str, tuple[str, int, Resources]] = field(default_factory=dict)
    starts: list[Start] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    requeues: list[Requeue] = field(default_factory=list)
    pools: dict[str, int] = field(default_factory=dict)

    def usage(self, worker_id: str) -> list[float]:
        use = [0.0, 0.0, 0.0, 0.0]
        for w, k, d in self.running.values():
            if w == worker_id:
                for i, x in enumerate((d.cpu, d.mem_mb, d.gpu, d.gpu_mem_mb)):
                    use[i] += x * k
        return use

    def check(self) -> None:
        for worker_id, cap in self.capacity.items():
            use = self.usage(worker_id)
            for used, limit in zip(use, (cap.cpu, cap.mem_mb, cap.gpu, cap.gpu_mem_mb), strict=True):
                assert used <= limit + 1e-6, f"{worker_id} over-committed: {use} > {cap}"


class Driver:
    """Feeds a scheduler, applies its decisions to a :class:`Book`, validates after every call."""

    def __init__(self, sched: Any) -> None:
        self.sched = sched
        # Under trajectory-bound an action runs inside its trajectory's slot: what is lent is the slot
        # (checked by the scheduler's own ledger), not the action's demand.
        self.per_action = getattr(sched, "name", "") != "trajectory_bound"
        self.book = Book()
        self.demand: dict[str, Resources] = {}
        self.now = 0.0

    def __call__(self, events: Iterable[Event], now: float | None = None) -> list[Decision]:
        if now is not None:
            self.now = now
        events = list(events)
        for ev in events:
            if isinstance(ev, ActionArrived):
                self.demand[ev.action_id] = ev.demand
            elif isinstance(ev, WorkerAdded):
                self.book.capacity[ev.worker_id] = ev.capacity
            elif isinstance(ev, WorkerRemoved):
                self.book.capacity.pop(ev.worker_id, None)
            elif isinstance(ev, ActionFinished):
                self.book.running.pop(ev.action_id, None)
        out = self.sched.handle(events, self.now)
        for d in out:
            if isinstance(d, Start):
                assert d.action_id not in self.book.running, f"{d.action_id} started twice"
                assert d.worker_id in self.book.capacity, f"{d.action_id} started on unknown {d.worker_id}"
                # A rider of a batch runs on its leader's units and holds nothing of its own.
                k = 0 if d.batch_of is not None else d.parallelism
                self.book.running[d.action_id] = (d.worker_id, k, self.demand[d.action_id])
                self.book.starts.append(d)
            elif isinstance(d, Requeue):
                self.book.running.pop(d.action_id, None)
                self.book.requeues.append(d)
            elif isinstance(d, Reject):
                self.book.rejects.append(d)
            elif isinstance(d, ScalePool):
                self.book.pools[d.image] = d.size
        if self.per_action:
            self.book.check()
        held, total = self.sched.held(), self.book.capacity.values()
        assert held.cpu <= sum(c.cpu for c in total) + 1e-6 and held.gpu <= sum(c.gpu for c in total) + 1e-6
        self.sched.validate_state()
        return out

    def starts(self, out: list[Decision]) -> dict[str, Start]:
        return {d.action_id: d for d in out if isinstance(d, Start)}


def arrive(
    action_id: str,
    kind: str = "bash",
    cpu: float = 1,
    mem: float = 100,
    gpu: float = 0,
    gmem: float = 0,
    lo: int = 1,
    hi: int = 1,
    **kw: Any,
) -> ActionArrived:
    """A shorthand for an arrival."""
    return ActionArrived(action_id, kind, Resources(cpu, mem, gpu, gmem), lo, hi, **kw)


def worker(
    worker_id: str,
    cpu: float = 4,
    mem: float = 16_000,
    gpu: float = 0,
    gmem: float = 0,
    kinds: frozenset[str] | None = None,
) -> WorkerAdded:
    """A shorthand for a worker joining."""
    return WorkerAdded(worker_id, Resources(cpu, mem, gpu, gmem), kinds=kinds)


@dataclass
class Timeline:
    """Start and end times of every action of a :func:`run_timeline`."""

    start: dict[str, float] = field(default_factory=dict)
    end: dict[str, float] = field(default_factory=dict)
    k: dict[str, int] = field(default_factory=dict)


def run_timeline(
    sched: Any,
    workers: list[WorkerAdded],
    arrivals: list[tuple[float, ActionArrived]],
    duration: Callable[[str, int], float],
    until: float = float("inf"),
) -> Timeline:
    """Run ``arrivals`` to completion (or ``until``): each started action ends ``duration(id, k)`` later."""
    drive = Driver(sched)
    tl = Timeline()
    seq = itertools.count()
    queue: list[tuple[float, int, Event]] = [(t, next(seq), ev) for t, ev in arrivals]
    heapq.heapify(queue)
    drive(workers, 0.0)
    tick_queued = False
    while queue:
        now = queue[0][0]
        if now > until:
            break
        batch: list[Event] = []
        while queue and queue[0][0] <= now + 1e-12:
            batch.append(heapq.heappop(queue)[2])
        if any(isinstance(ev, Tick) for ev in batch):
            tick_queued = False
        for d in drive(batch, now):
            if isinstance(d, Start):
                tl.start[d.action_id] = now
                tl.k[d.action_id] = d.parallelism
                dt = duration(d.action_id, d.parallelism)
                heapq.heappush(queue, (now + dt, next(seq), ActionFinished(d.action_id, dt)))
        for ev in batch:
            if isinstance(ev, ActionFinished):
                tl.end[ev.action_id] = now
        if sched.pending() and not tick_queued:  # a server ticks about once a second
            heapq.heappush(queue, (now + 1.0, next(seq), Tick()))
            tick_queued = True
    return tl
