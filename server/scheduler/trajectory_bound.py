"""Trajectory-bound allocation (a baseline): each trajectory holds a sandbox slot from reset to close.

A trajectory's first action binds a *slot* (fixed cores and memory on one worker, the sandbox's
container) that the trajectory keeps, idle or not, until it closes; its actions run in the slot one
at a time, on all of the slot's cores (``k = slot cores / cores per unit``, within the action's
elasticity). Trajectories that find no room wait for a slot in arrival order. Actions that need a
GPU go to reward-model replicas fixed per kind, created when capacity allows and held for good; each
runs on one replica, on all of its units, oldest first, in a batch with the requests queued behind it
(up to ``batch_max``), as a deployed reward model serves concurrent requests. A GPU kind that has no
replica and can never get one (the GPUs that could host it are held by other kinds' replicas, which
are never released) is rejected with that reason rather than left waiting forever.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

from tangram_env.server.scheduler.events import (
    ActionArrived,
    ActionCancelled,
    ActionFinished,
    Decision,
    Event,
    Reject,
    Requeue,
    Resources,
    SessionClosed,
    Start,
    Tick,
    TrajectoryClosed,
    WorkerAdded,
    WorkerRemoved,
)
from tangram_env.server.scheduler.ledger import GPU, Ledger, Vec, Worker, fits, vec_of
from tangram_env.server.scheduler.story import ActionState, StoryLog

P, R = ActionState.PENDING, ActionState.RUNNING
DEFAULT_SLOT = Resources(cpu=2, mem_mb=4096)


def _is_resources(value: object) -> bool:
    """Whether a mapping from configuration (JSON) is one :class:`Resources` rather than env -> Resources."""
    return isinstance(value, Mapping) and bool(value) and set(value) <= {"cpu", "mem_mb", "gpu", "gpu_mem_mb"}


def _resources(value: Resources | Mapping[str, float]) -> Resources:
    """A :class:`Resources` from itself or from its fields (``--scheduler-option`` values are JSON)."""
    return Resources(**value) if isinstance(value, Mapping) else value


def _units(ev: ActionArrived, holder: Vec, dim: int) -> int:
    """Units ``ev`` runs on in a slot or replica of ``holder``: all it holds of ``dim``, within elasticity."""
    per_unit = vec_of(ev.demand)[dim]
    k = int(holder[dim] / per_unit + 1e-9) if per_unit > 0 else ev.min_par
    return max(ev.min_par, min(ev.max_par, k))


class _Act:
    __slots__ = ("ev", "holder", "state")

    def __init__(self, ev: ActionArrived) -> None:
        self.ev = ev
        self.state = ActionState.NEW
        self.holder: _Slot | _Replica | None = None


class _Slot:
    """A trajectory's sandbox slot: where it runs, its queue, what runs in it now."""

    __slots__ = ("closing", "idle_since", "queue", "running", "traj", "vec", "worker")

    def __init__(self, traj: str, vec: Vec) -> None:
        self.traj, self.vec = traj, vec
        self.worker: Worker | None = None
        self.queue: collections.deque[_Act] = collections.deque()
        self.running: _Act | None = None
        self.closing = False
        self.idle_since = 0.0


class _Replica:
    __slots__ = ("kind", "riders", "running", "vec", "worker")

    def __init__(self, kind: str, vec: Vec, worker: Worker) -> None:
        self.kind, self.vec, self.worker = kind, vec, worker
        self.running: _Act | None = None  # the batch's first action
        self.riders: list[_Act] = []  # the rest of its batch (the replica is busy until all end)


class TrajectoryBoundScheduler:
    """Trajectories hold sandbox slots from their first action to their close; GPU kinds use fixed replicas.

    ``slot``: the slot of every trajectory (a :class:`Resources`, or env id -> Resources, with
    ``"*"`` for the rest; a Resources may be given as a mapping of its fields, as JSON options are);
    ``rm_replicas``: GPU kind -> ``(replicas, demand of one)`` created up front
    (GPU kinds not listed get one replica of ``min_par`` units, sized by their first action);
    ``idle_release_s``: a slot idle this long is released even without a :class:`TrajectoryClosed`
    (servers that never send one); ``batch_max``: requests a replica runs as one batch (1: one by one).
    """

    name = "trajectory_bound"

    def __init__(
        self,
        slot: Resources | Mapping[str, Any] | None = None,
        rm_replicas: Mapping[str, tuple[int, Resources | Mapping[str, float]]] | None = None,
        idle_release_s: float = 600.0,
        batch_max: int = 8,
        story_per_action: int = 32,
        story_actions: int = 10_000,
    ) -> None:
        slots = slot if isinstance(slot, Mapping) and not _is_resources(slot) else {"*": slot or DEFAULT_SLOT}
        self._slot_vec = {env: vec_of(_resources(r)) for env, r in slots.items()}
        self._slot_vec.setdefault("*", vec_of(DEFAULT_SLOT))
        self._want_replicas = {
            kind: (n, vec_of(_resources(r))) for kind, (n, r) in (rm_replicas or {}).items()
        }
        self.idle_release_s = idle_release_s
        self.batch_max = batch_max
        self.ledger = Ledger()
        self._story = StoryLog(story_per_action, story_actions)
        self._acts: dict[str, _Act] = {}
        self._slots: dict[str, _Slot] = {}  # trajectory -> its slot (bound or waiting)
        self._waiting: collections.OrderedDict[str, _Slot] = collections.OrderedDict()
        self._replicas: dict[str, list[_Replica]] = {}
        self._dirty: dict[str, _Slot] = {}  # slots that may start their next action
        self._rm_queue: dict[str, collections.deque[_Act]] = {}
        self._npending = self._nrunning = 0
        self._now = 0.0
        self._out: list[Decision] = []
        self._handlers: dict[type, Any] = {
            ActionArrived: self._on_arrived,
            ActionFinished: self._on_finished,
            ActionCancelled: self._on_cancelled,
            WorkerAdded: self._on_worker_added,
            WorkerRemoved: self._on_worker_removed,
            TrajectoryClosed: self._on_trajectory_closed,
            SessionClosed: lambda ev: None,
            Tick: self._on_tick,
        }

    # --- protocol -------------------------------------------------------------------------------------
    def pending(self) -> int:
        """Actions waiting to start."""
        return self._npending

    def running(self) -> int:
        """Actions started and not finished."""
        return self._nrunning

    def handle(self, events: Sequence[Event], now: float) -> list[Decision]:
        """Apply ``events``, then bind slots and start what may start."""
        self._now = now
        out: list[Decision] = []
        self._out = out
        for ev in events:
            handler = self._handlers.get(type(ev))
            if handler is None:
                raise TypeError(f"{type(ev).__name__} is not a scheduler event")
            handler(ev)
        self._ensure_replicas()
        self._bind_slots()
        dirty, self._dirty = self._dirty, {}
        for slot in dirty.values():
            self._run_slot(slot)
        for kind in self._rm_queue:
            self._run_replicas(kind)
        return out

    def held(self) -> Resources:
        """Slots and replicas held right now (busy or not)."""
        u = self.ledger.used_total
        return Resources(max(0.0, u[0]), max(0.0, u[1]), max(0.0, u[2]), max(0.0, u[3]))

    def story(self, action_id: str) -> list[tuple[float, str, str, str]]:
        """Return what happened to ``action_id``."""
        return self._story.story(action_id)

    def next_wakeup(self, now: float) -> float | None:
        """When an idle slot falls due for release."""
        if self.idle_release_s == float("inf"):
            return None
        idle = [
            s.idle_since
            for s in self._slots.values()
            if s.worker is not None and s.running is None and not s.queue
        ]
        return max(now, min(idle) + self.idle_release_s) if idle else None

    # --- events ---------------------------------------------------------------------------------------
    def _move(self, act: _Act, new: ActionState, detail: str = "") -> None:
        self._story.record(act.ev.action_id, self._now, act.state, new, detail)
        act.state = new

    def _on_arrived(self, ev: ActionArrived) -> None:
        if ev.action_id in self._acts:
            return
        act = self._acts[ev.action_id] = _Act(ev)
        self._move(act, P, "arrived")
        self._npending += 1
        if ev.demand.gpu > 0:
            self._rm_queue.setdefault(ev.kind, collections.deque()).append(act)
            return
        traj = ev.trajectory_id or f"action:{ev.action_id}"  # no trajectory: a slot for this action alone
        slot = self._slots.get(traj)
        if slot is None:
            vec = self._slot_vec.get(ev.env_id, self._slot_vec["*"])
            slot = self._slots[traj] = _Slot(traj, vec)
            self._waiting[traj] = slot
        slot.queue.append(act)
        self._dirty[traj] = slot

    def _on_tick(self, ev: Tick) -> None:
        self._release_idle()

    def _on_finished(self, ev: ActionFinished) -> None:
        act = self._acts.get(ev.action_id)
        if act is None or act.state is not R:
            return
        holder = act.holder
        assert holder is not None
        if holder.running is act:
            holder.running = None
        else:
            assert isinstance(holder, _Replica)
            holder.riders.remove(act)
        self._move(act, ActionState.DONE, f"ok={ev.ok}")
        del self._acts[ev.action_id]
        self._nrunning -= 1
        if isinstance(holder, _Slot):
            holder.idle_since = self._now
            if (holder.closing or holder.traj.startswith("action:")) and not holder.queue:
                self._free_slot(holder)
            else:
                self._dirty[holder.traj] = holder

    def _on_cancelled(self, ev: ActionCancelled) -> None:
        act = self._acts.get(ev.action_id)
        if act is None or act.state is not P:
            return
        for queue in [*(s.queue for s in self._slots.values()), *self._rm_queue.values()]:
            if act in queue:
                queue.remove(act)
                break
        self._move(act, ActionState.CANCELLED)
        del self._acts[ev.action_id]
        self._npending -= 1

    def _on_worker_added(self, ev: WorkerAdded) -> None:
        old = self.ledger.workers.get(ev.worker_id)
        if old is not None:
            if old.cap == vec_of(ev.capacity) and old.kinds == ev.kinds:
                return
            self._on_worker_removed(WorkerRemoved(ev.worker_id))
        self.ledger.add_worker(ev.worker_id, vec_of(ev.capacity), ev.kinds)

    def _on_worker_removed(self, ev: WorkerRemoved) -> None:
        w = self.ledger.remove_worker(ev.worker_id)
        if w is None:
            return
        for slot in list(self._slots.values()):
            if slot.worker is w:  # the sandbox is gone: the trajectory waits for a new slot, first in line
                slot.worker = None
                self._requeue(slot, slot)
                self._waiting[slot.traj] = slot
                self._waiting.move_to_end(slot.traj, last=False)
        for kind, replicas in self._replicas.items():
            for rep in [r for r in replicas if r.worker is w]:
                replicas.remove(rep)
                self._requeue(rep, None, kind)

    def _requeue(self, holder: _Slot | _Replica, slot: _Slot | None, kind: str = "") -> None:
        lost = [holder.running] if holder.running is not None else []
        if isinstance(holder, _Replica):
            lost += holder.riders
            holder.riders = []
        holder.running = None
        for act in reversed(lost):  # back to the front of the queue, in their order
            self._move(act, P, "requeued: worker left")
            self._out.append(Requeue(act.ev.action_id))
            self._nrunning -= 1
            self._npending += 1
            if slot is not None:
                slot.queue.appendleft(act)
            else:
                self._rm_queue[kind].appendleft(act)

    def _on_trajectory_closed(self, ev: TrajectoryClosed) -> None:
        slot = self._slots.get(ev.trajectory_id)
        if slot is None:
            return
        if slot.running is None and not slot.queue:
            self._free_slot(slot)
        else:
            slot.closing = True

    # --- slots and replicas -----------------------------------------------------------------------------
    def _free_slot(self, slot: _Slot) -> None:
        if slot.worker is not None:
            w = slot.worker
            self.ledger.release(w, slot.vec, 1)
            if all(abs(w.cap[i] - w.free[i]) <= 1e-6 * max(1.0, w.cap[i]) for i in range(4)):
                self.ledger.settle(w)  # nothing else held there: drop float drift
        self._waiting.pop(slot.traj, None)
        self._dirty.pop(slot.traj, None)
        self._slots.pop(slot.traj, None)

    def _release_idle(self) -> None:
        if self.idle_release_s == float("inf"):
            return
        due = self._now - self.idle_release_s
        for slot in [
            s
            for s in self._slots.values()
            if s.worker is not None and s.running is None and not s.queue and s.idle_since <= due
        ]:
            self._free_slot(slot)

    def _bind_slots(self) -> None:
        while self._waiting:
            traj, slot = next(iter(self._waiting.items()))
            if not slot.queue:
                break
            kind = slot.queue[0].ev.kinds_needed or slot.queue[0].ev.kind
            pools = self.ledger.eligible_pools(kind, slot.vec, 1)
            if not pools:
                if self.ledger.workers:
                    for act in list(slot.queue):
                        self._move(act, ActionState.REJECTED)
                        del self._acts[act.ev.action_id]
                        self._npending -= 1
                        self._out.append(Reject(act.ev.action_id, f"no worker can hold a slot of {slot.vec}"))
                    slot.queue.clear()
                    del self._waiting[traj]
                    del self._slots[traj]
                    continue
                break
            w = self.ledger.find(pools, slot.vec, 1, worst=False, probe=1 << 30)
            if w is None:
                break  # trajectories take slots in arrival order
            self.ledger.allocate(w, slot.vec, 1)
            slot.worker = w
            del self._waiting[traj]
            self._dirty[traj] = slot

    def _run_slot(self, slot: _Slot) -> None:
        if slot.worker is None or slot.running is not None or not slot.queue:
            return
        act = slot.queue.popleft()
        self._launch(act, slot, slot.worker, _units(act.ev, slot.vec, 0))

    def _launch(self, act: _Act, holder: _Slot | _Replica, w: Worker, k: int) -> None:
        holder.running = act
        act.holder = holder
        self._move(act, R, f"on {w.id} x{k}")
        self._npending -= 1
        self._nrunning += 1
        self._out.append(Start(act.ev.action_id, w.id, k))

    def _ensure_replicas(self) -> None:
        for kind, queue in self._rm_queue.items():
            if kind not in self._want_replicas and queue:
                ev = queue[0].ev
                self._want_replicas[kind] = (1, vec_of(ev.demand.scaled(ev.min_par)))
        for kind, (n, vec) in self._want_replicas.items():
            have = self._replicas.setdefault(kind, [])
            self._rm_queue.setdefault(kind, collections.deque())
            while len(have) < n:
                pools = self.ledger.eligible_pools(kind, vec, 1)
                w = self.ledger.find(pools, vec, 1, worst=False, probe=1 << 30) if pools else None
                if w is None:
                    break
                self.ledger.allocate(w, vec, 1)
                have.append(_Replica(kind, vec, w))
            if not have and self._rm_queue[kind]:
                reason = self._never_replicated(kind, vec)
                if reason is not None:
                    self._reject_all(self._rm_queue[kind], reason)

    def _never_replicated(self, kind: str, vec: Vec) -> str | None:
        """Why ``kind`` can never get a replica here (None: it may, once capacity joins or frees)."""
        serving = [w for w in self.ledger.workers.values() if w.kinds is None or kind in w.kinds]
        if not serving:
            return None  # no worker serves it yet: wait for one to join
        fixed: dict[str, list[float]] = {}  # what replicas hold on each worker (never released)
        for reps in self._replicas.values():
            for r in reps:
                acc = fixed.setdefault(r.worker.id, [0.0, 0.0, 0.0, 0.0])
                for i in range(4):
                    acc[i] += r.vec[i]
        for w in serving:
            held = fixed.get(w.id, [0.0, 0.0, 0.0, 0.0])
            if fits([w.cap[i] - held[i] for i in range(4)], vec, 1):
                return None  # room there once the slots on it close
        others = sorted(k for k, reps in self._replicas.items() if reps and k != kind)
        return (
            f"trajectory-bound fixes reward-model replicas up front and no worker serving {kind!r} has room "
            f"for one of {vec} (held for good by the replicas of {', '.join(others) or 'nothing'}); "
            f"give {kind!r} replicas in rm_replicas"
        )

    def _reject_all(self, queue: collections.deque[_Act], reason: str) -> None:
        while queue:
            act = queue.popleft()
            self._move(act, ActionState.REJECTED, reason)
            del self._acts[act.ev.action_id]
            self._npending -= 1
            self._out.append(Reject(act.ev.action_id, reason))

    def _run_replicas(self, kind: str) -> None:
        queue = self._rm_queue[kind]
        started: list[tuple[_Replica, _Act, int]] = []
        for rep in self._replicas.get(kind, ()):
            if not queue:
                break
            if rep.running is None and not rep.riders:
                act = queue.popleft()
                k = _units(act.ev, rep.vec, 2)
                self._launch(act, rep, rep.worker, k)
                started.append((rep, act, k))
        # What no idle replica took rides in the batches just started, the smallest first.
        while queue and started:
            rep, act, k = min(started, key=lambda s: len(s[0].riders))
            if len(rep.riders) >= self.batch_max - 1:
                return
            rider = queue.popleft()
            rep.riders.append(rider)
            rider.holder = rep
            self._move(rider, R, f"in the batch of {act.ev.action_id} on {rep.worker.id} x{k}")
            self._npending -= 1
            self._nrunning += 1
            self._out.append(Start(rider.ev.action_id, rep.worker.id, k, batch_of=act.ev.action_id))

    # --- invariants -------------------------------------------------------------------------------------
    def validate_state(self) -> None:
        """Assert the books: the ledger lends exactly the bound slots and replicas; counts agree."""
        lent: dict[str, list[float]] = {}
        holders: list[tuple[Worker, Vec]] = [(s.worker, s.vec) for s in self._slots.values() if s.worker]
        holders += [(r.worker, r.vec) for reps in self._replicas.values() for r in reps]
        for w, vec in holders:
            acc = lent.setdefault(w.id, [0.0, 0.0, 0.0, 0.0])
            for i in range(4):
                acc[i] += vec[i]
        self.ledger.validate(lent)
        running = [a for a in self._acts.values() if a.state is R]
        pending = [a for a in self._acts.values() if a.state is P]
        assert len(running) == self._nrunning and len(pending) == self._npending, "counters drifted"
        assert len(running) + len(pending) == len(self._acts)
        for act in running:
            holder = act.holder
            assert holder is not None and (
                holder.running is act or (isinstance(holder, _Replica) and act in holder.riders)
            ), f"{act.ev.action_id} not in its holder"
        queued = sum(len(s.queue) for s in self._slots.values()) + sum(
            len(q) for q in self._rm_queue.values()
        )
        assert queued == len(pending), f"{queued} queued but {len(pending)} pending"
        for slot in self._waiting.values():
            assert slot.worker is None, "a waiting trajectory holds a slot"
        for reps in self._replicas.values():
            for r in reps:
                assert fits(list(r.worker.cap), r.vec, 1) and r.vec[GPU] >= 0
