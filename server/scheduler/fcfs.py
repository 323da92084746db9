"""Action-level FCFS: one shared pool, arrival order, no elasticity (the simplest correct policy)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tangram_env.server.scheduler.events import (
    ActionArrived,
    ActionCancelled,
    ActionFinished,
    Decision,
    Event,
    Reject,
    Requeue,
    Start,
    Tick,
    WorkerAdded,
    WorkerRemoved,
    WorkerState,
)


class FCFSScheduler:
    """Starts queued actions in arrival order on the first worker they fit; the head blocks the rest."""

    name = "fcfs"

    def __init__(self) -> None:
        self._queue: OrderedDict[str, ActionArrived] = OrderedDict()
        self._workers: dict[str, WorkerState] = {}
        self._running: dict[str, tuple[ActionArrived, str, int]] = {}

    def pending(self) -> int:
        """Actions waiting to start."""
        return len(self._queue)

    def running(self) -> int:
        """Actions started and not finished."""
        return len(self._running)

    def handle(self, events: Sequence[Event], now: float) -> list[Decision]:
        """Apply events, then start what fits, oldest first."""
        out: list[Decision] = []
        for event in events:
            if isinstance(event, ActionArrived):
                self._queue[event.action_id] = event
            elif isinstance(event, ActionFinished):
                self._release(event.action_id)
            elif isinstance(event, ActionCancelled):
                self._queue.pop(event.action_id, None)
            elif isinstance(event, WorkerAdded):
                self._workers[event.worker_id] = WorkerState(event.worker_id, event.capacity, kinds=event.kinds)
            elif isinstance(event, WorkerRemoved):
                self._workers.pop(event.worker_id, None)
                for action_id, (arrived, worker_id, _) in list(self._running.items()):
                    if worker_id == event.worker_id:
                        del self._running[action_id]
                        self._queue[action_id] = arrived
                        self._queue.move_to_end(action_id, last=False)
                        out.append(Requeue(action_id))
            else:
                assert isinstance(event, Tick)
        out.extend(self._dispatch())
        return out

    def _release(self, action_id: str) -> None:
        entry = self._running.pop(action_id, None)
        if entry is None:
            return
        arrived, worker_id, k = entry
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.used = worker.used - arrived.demand.scaled(k)

    def _dispatch(self) -> list[Decision]:
        out: list[Decision] = []
        while self._queue:
            action_id, arrived = next(iter(self._queue.items()))
            eligible = [w for w in self._workers.values() if w.kinds is None or arrived.kind in w.kinds]
            if self._workers and not any(arrived.demand.fits_in(w.capacity) for w in eligible):
                del self._queue[action_id]
                out.append(Reject(action_id, f"no worker can ever fit its demand {arrived.demand}"))
                continue
            worker = next((w for w in eligible if arrived.demand.fits_in(w.free)), None)
            if worker is None:
                break  # strict arrival order: the head waits, so does everyone behind it
            del self._queue[action_id]
            worker.used = worker.used + arrived.demand
            self._running[action_id] = (arrived, worker.worker_id, 1)
            out.append(Start(action_id, worker.worker_id, 1))
        return out
