"""The action-level scheduler: one shared pool, indexed queues, placement, elastic sizing, caps.

Pending actions wait in heaps keyed by a number fixed at arrival, ``key = estimated run time (at
most order_cap_s) + age_rate x arrival time`` (or the arrival time alone for FCFS). Ordering by that
key equals ordering by ``estimate - age_rate x waited`` at any instant, so ageing never needs a
re-sort. Actions with the
same demand, elasticity, kind and image share a *class* heap: if a class's head does not fit, nothing
in the class does, so one query per class answers for all of it. Actions bound to a sandbox session
wait in the heap of the worker that holds the session.

One call of :meth:`ActionLevelScheduler.handle` applies the events in order, then dispatches (see
:mod:`~.placement`). Running actions are never shrunk, never preempted.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

from tangram_env.server.scheduler.caps import SandboxCaps
from tangram_env.server.scheduler.devices import Devices
from tangram_env.server.scheduler.estimator import DurationEstimator
from tangram_env.server.scheduler.events import (
    ActionArrived,
    ActionCancelled,
    ActionFinished,
    ActionThrottled,
    Decision,
    Event,
    Reject,
    Requeue,
    Resources,
    SessionClosed,
    Tick,
    TrajectoryClosed,
    WorkerAdded,
    WorkerRemoved,
)
from tangram_env.server.scheduler.ledger import Ledger, Vec, Worker, fits, vec_of
from tangram_env.server.scheduler.placement import Placement
from tangram_env.server.scheduler.policy import PolicyConfig
from tangram_env.server.scheduler.quotas import ApiQuotas
from tangram_env.server.scheduler.records import Act, DecayedMean, Klass
from tangram_env.server.scheduler.story import ActionState, Detail, StoryLog

P, R = ActionState.PENDING, ActionState.RUNNING


class ActionLevelScheduler(Placement):
    """Shared machinery of the action-level policies (see the module docstring).

    Configure it with :class:`PolicyConfig`; subclasses may partition the pool through the quota hooks.
    """

    name = "action_level"

    def __init__(self, config: PolicyConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = PolicyConfig(**overrides)
        elif overrides:
            config = config.model_copy(update=overrides)
        self.config = config
        self.ledger = Ledger(config.nbuckets)
        self.estimator = DurationEstimator(config.estimator)
        self.caps = SandboxCaps(config.caps)
        self.api_quotas = ApiQuotas(config.api_quotas)
        self._forget = config.estimator.forget
        self._warm_min_setup_s = config.warm_min_setup_s
        self._story = StoryLog(config.story_per_action, config.story_actions)
        self._acts: dict[str, Act] = {}
        self._classes: dict[tuple[Any, ...], Klass] = {}
        self._sessions: dict[str, Worker] = {}
        self._session_mem: dict[str, float] = {}  # live session -> memory it holds on its worker
        self._session_image: dict[str, str] = {}
        self._warm: dict[str, dict[str, Worker]] = {}  # kind -> workers warm for it, most recent last
        self._reservations: dict[str, Worker] = {}
        self._holds: dict[str, list[float]] = {}
        self._dirty: dict[str, Worker] = {}  # workers to look at: capacity freed or a session action came
        self._freed: dict[str, Worker] = {}  # workers whose free capacity grew since the last dispatch
        self._recheck: dict[str, Worker] = {}  # workers whose queue waits on a quota or a cap
        self._seq = itertools.count()
        self._npending = 0
        self._nrunning = 0
        self._now = 0.0
        self._arrived_work = [0.0, 0.0, 0.0, 0.0]  # decayed unit-seconds demanded by arrivals, per resource
        self._arrived_at = 0.0
        # Recent waits and (capped) run-time estimates of CPU actions: how far shortest-first still pays
        # (kept only where the order reads them).
        self._wait_aware = self.config.ordering != "arrival" and self.config.wait_aware_order
        self._cpu_waits = DecayedMean(self.config.load_window_s)
        self._cpu_runs = DecayedMean(self.config.load_window_s)
        self._wake: float | None = None
        self._caps_touched = False
        self._overdue_scan_at = 0.0
        self._capacity_wake: float | None = None
        self._class_touched = True  # some class heap gained a member since the last dispatch
        self._seen_version = -1  # the ledger's pool version at the last class dispatch
        self._out: list[Decision] = []
        self._handlers: dict[type, Callable[[Any], None]] = {
            ActionArrived: self._on_arrived,
            ActionFinished: self._on_finished,
            ActionCancelled: self._on_cancelled,
            WorkerAdded: self._on_worker_added,
            WorkerRemoved: self._on_worker_removed,
            SessionClosed: self._on_session_closed,
            TrajectoryClosed: self._on_trajectory_closed,
            Tick: self._on_tick,
            ActionThrottled: self._on_throttled,
        }

    # --- the Scheduler protocol -----------------------------------------------------------------------
    def pending(self) -> int:
        """Actions waiting to start."""
        return self._npending

    def running(self) -> int:
        """Actions started and not finished."""
        return self._nrunning

    def handle(self, events: Sequence[Event], now: float) -> list[Decision]:
        """Apply ``events`` in order at time ``now``; return the decisions they lead to."""
        self._now = now
        out: list[Decision] = []
        self._out = out
        handlers = self._handlers
        for ev in events:
            try:
                handler = handlers[type(ev)]
            except KeyError:
                raise TypeError(f"{type(ev).__name__} is not a scheduler event") from None
            handler(ev)
        if self.api_quotas.new_round():
            self._caps_touched = True  # an API starved last round: tokens may have come since, look again
        self._dispatch(now)
        return out

    # --- introspection ----------------------------------------------------------------------------------
    def held(self) -> Resources:
        """Resources lent out right now."""
        u = self.ledger.used_total
        return Resources(max(0.0, u[0]), max(0.0, u[1]), max(0.0, u[2]), max(0.0, u[3]))

    def story(self, action_id: str) -> list[tuple[float, str, str, str]]:
        """Return what happened to ``action_id`` (bounded; see :class:`~.story.StoryLog`)."""
        return self._story.story(action_id)

    def next_wakeup(self, now: float) -> float | None:
        """Return when a :class:`Tick` could start something with no other event.

        That is a reservation falling due, a deferred cold start giving up on warmth, an action giving up
        on capacity that fits it joining, a creation token, or the next token (or the end of a 429
        pause) of an API key that actions wait for.
        """
        times = [
            t
            for t in (self._wake, self._capacity_wake, self.caps.next_wakeup(), self.api_quotas.next_wakeup())
            if t is not None
        ]
        return max(now, min(times)) if times else None

    def snapshot(self) -> dict[str, Any]:
        """Figures for the orchestrator's stats."""
        return {
            "pending": self._npending,
            "running": self._nrunning,
            "classes": sum(1 for c in self._classes.values() if c.live),
            "reservations": len(self._reservations),
            "sessions": len(self._sessions),
            "estimates": self.estimator.snapshot(),
            "sandboxes": self.caps.snapshot(),
            "api_quotas": self.quota_snapshot(),
        }

    def quota_snapshot(self) -> dict[str, Any]:
        """Per API: tokens, in flight, granted, 429s per key, and actions waiting for a key."""
        waiting: dict[str, int] = {}
        for act in self._acts.values():
            api = act.ev.api
            if act.state is P and api is not None:
                waiting[api] = waiting.get(api, 0) + 1
        return self.api_quotas.snapshot(self._now, waiting)

    def quota_starved(self) -> set[str]:
        """Pending actions that their API's quota holds back (beyond what its keys could start now), not
        capacity: more cores would not start them sooner.
        """
        waiting: dict[str, list[Act]] = {}
        for act in self._acts.values():
            api = act.ev.api
            if act.state is P and api is not None and self.api_quotas.limited(api):
                waiting.setdefault(api, []).append(act)
        starved: set[str] = set()
        for api, acts in waiting.items():
            acts.sort(key=lambda a: a.key)
            starved.update(a.id for a in acts[self.api_quotas.grants_now(api, self._now) :])
        return starved

    # --- event handlers -------------------------------------------------------------------------------
    def _on_arrived(self, ev: ActionArrived) -> None:
        if ev.action_id in self._acts:
            return  # a resubmitted id never runs twice
        if ev.min_par < 1 or ev.max_par < ev.min_par:
            self._out.append(Reject(ev.action_id, f"bad elasticity {ev.min_par}..{ev.max_par}"))
            return
        act = Act(ev, self._now)
        v = act.vec
        if v[0] < 0 or v[1] < 0 or v[2] < 0 or v[3] < 0:
            self._out.append(Reject(ev.action_id, f"negative demand {ev.demand}"))
            return
        if not ev.sandbox_mem_mb >= 0:
            self._out.append(Reject(ev.action_id, f"sandbox_mem_mb must be >= 0, got {ev.sandbox_mem_mb}"))
            return
        est = self.estimator.estimate(act.ev.kind, ev.min_par)
        self._note_arrival(v, ev.min_par * est)
        if self.config.ordering == "arrival":
            act.key = self._now
        else:
            cfg = self.config
            run = min(est, cfg.order_cap_s)
            weight = 1.0
            if self._wait_aware and v[2] <= 0.0:
                self._cpu_runs.add(run, self._now)
                weight = self._cpu_head_start()
            act.key = weight * run + cfg.age_rate * self._now - cfg.priority_s * ev.priority
        refusal = self._refusal(act)
        if refusal is not None:
            self._out.append(Reject(ev.action_id, refusal))
            return
        self._acts[act.id] = act
        self._transition(act, P, "arrived")
        self._enqueue(act)

    def _cpu_head_start(self) -> float:
        """How much a CPU action's estimated run time counts in its key: 1 while recent CPU actions
        waited less than they ran, run / wait once they wait longer.

        In a saturated pool every trajectory waits on some action until the step's work is done, so
        the sum of completion times is set by the work and the pool: putting short commands first no
        longer lowers the mean, it only moves waiting onto the long ones (the tail), so the order
        tends to arrival order (FCFS) as waits grow. GPU actions keep the full weight: there the order
        also decides the work (requests of one model started together share a batch and a load).
        """
        run, wait = self._cpu_runs.mean(), self._cpu_waits.mean()
        return 1.0 if wait <= run else run / wait

    def _note_arrival(self, vec: Vec, unit_s: float) -> None:
        """Add an arrival's expected work (``unit_s`` seconds of each unit of ``vec``) to the decayed sums."""
        work = self._arrived_work
        dt = self._now - self._arrived_at
        if dt > 0:
            decay = math.exp(-dt / self.config.load_window_s)
            for i in range(4):
                work[i] *= decay
            self._arrived_at = self._now
        for i in range(4):
            work[i] += vec[i] * unit_s

    def _expected_load(self) -> list[float]:
        """Return the units of each resource that arrivals keep busy on average (Little's law, decayed)."""
        decay = math.exp(-max(0.0, self._now - self._arrived_at) / self.config.load_window_s)
        return [w * decay / self.config.load_window_s for w in self._arrived_work]

    def _on_finished(self, ev: ActionFinished) -> None:
        act = self._acts.get(ev.action_id)
        if act is None or act.state is not R:
            return  # late news of an action requeued elsewhere, or unknown
        w = act.worker
        assert w is not None
        del w.running[act.id]
        rider = act.leader is not None
        if not (w.running or w.pinned_mb or w.reserved_for is not None):
            self.ledger.settle(w)  # nothing else runs or lives there: exactly its capacity is free
        elif not rider:  # a rider of a batch holds nothing: its leader's units are the batch's
            self.ledger.release(w, act.vec, act.k)
        if act.devices:
            self._free_devices(act)
        self._released(act)
        self._return_sandbox(act)
        kind = act.ev.kind
        model = self.estimator.model(kind)
        if ev.ok and not rider:
            d = ev.duration_s
            model.observe(act.k, d if d > 0.0 else 0.0, self._forget, act.id, self._now)
        elif not rider:  # failures (including "never started") say nothing about the work's length
            model.abandon(act.id)
        if act.cold and ev.setup_s > 0 and not rider:
            self.estimator.observe_setup(kind, ev.setup_s)
            image = act.opens  # the session's sandbox it created
            if image is not None and (pays_s := self._warm_pays_s(act, image, ev.setup_s)) is not None:
                self.caps.observe_creation(image, pays_s, self._now)
        if model.setup_s >= self._warm_min_setup_s and (w.devices is None or act.vec[2] <= 0):
            self._mark_warm(w, kind)  # only kinds whose cold start costs something have warm state
        self._transition(act, ActionState.DONE, ("ok" if ev.ok else "failed", "after", ev.duration_s, "s"))
        del self._acts[act.id]
        self._nrunning -= 1
        self._dirty[w.id] = w
        self._freed[w.id] = w

    def _warm_pays_s(self, act: Act, image: str, setup_s: float) -> float | None:
        """How long a warm sandbox like the one ``act`` created holds less than creating it did (None:
        keeping one costs nothing measured here).

        Creating it held ``act``'s grant for ``setup_s``; kept warm, it holds its idle footprint. Each
        resource counts at the pool's own ratio to its cores (a GPU as the cores per GPU, memory as
        the cores per MiB), the figure a warm pool spends and saves in. A sandbox its provider bills
        while it lives costs as much warm as busy, and was billed from its creation: keeping one pays
        for the creation time.
        """
        if self.caps.billed_alive(image):
            return setup_s
        if act.open_mb <= 0:
            return None
        cap = self.ledger.cap_total
        if cap[0] <= 0 or cap[1] <= 0:
            return float("inf")
        held = sum(act.vec[i] * act.k * cap[0] / cap[i] for i in range(3) if cap[i] > 0)
        return setup_s * held / (act.open_mb * cap[0] / cap[1])

    def _on_cancelled(self, ev: ActionCancelled) -> None:
        act = self._acts.get(ev.action_id)
        if act is None or act.state is not P:
            return  # running actions are never preempted
        self._dequeued(act)
        self._transition(act, ActionState.CANCELLED, "cancelled")
        del self._acts[act.id]

    def _on_worker_added(self, ev: WorkerAdded) -> None:
        cap = vec_of(ev.capacity)
        old = self.ledger.workers.get(ev.worker_id)
        if old is not None:
            if old.cap == cap and old.kinds == ev.kinds:
                self._add_sessions(old, ev.sessions)
                return  # the same worker announcing itself again
            self._on_worker_removed(WorkerRemoved(ev.worker_id))
        w = self.ledger.add_worker(ev.worker_id, cap, ev.kinds)
        if cap[2] >= 1:  # whole GPUs: models are loaded per device
            w.devices = Devices(int(cap[2] + 1e-9), cap[3] / cap[2])
        self._add_sessions(w, ev.sessions)
        self._dirty[w.id] = w
        self._freed[w.id] = w

    def _add_sessions(self, w: Worker, sessions: frozenset[str]) -> None:
        for s in sessions:  # a session it holds, or a model it has loaded (warm for that kind)
            self._sessions[s] = w
            w.sessions.add(s)
            self._mark_warm(w, s)
            if w.devices is not None:
                w.devices.announce(s, 0.0)

    def _on_worker_removed(self, ev: WorkerRemoved) -> None:
        w = self.ledger.remove_worker(ev.worker_id)
        if w is None:
            return
        self._dirty.pop(w.id, None)
        for s in w.sessions:
            if self._sessions.get(s) is w:
                del self._sessions[s]
                self._session_mem.pop(s, None)  # lent on a worker the ledger no longer has
                image = self._session_image.pop(s, None)
                if image is not None:
                    self.caps.drop_session(image)  # its sandbox died with the worker
        for peers in self._warm.values():
            peers.pop(w.id, None)
        if w.reserved_for is not None:
            self._unreserve(w.reserved_for)
        for act in list(w.running.values()):
            self._released(act)
            self._return_sandbox(act, lost=True)  # it died with the worker
            self.estimator.abandon(act.ev.kind, act.id)
            act.worker, act.leader, act.devices = None, None, ()
            self._nrunning -= 1
            self._transition(act, P, ("requeued: worker", w.id, "left"))
            self._out.append(Requeue(act.id))
            self._enqueue(act)
        w.running.clear()
        stranded = [a for (_, seq, a) in w.aff_heap if a.seq == seq and a.state is P]
        w.aff_heap.clear()
        for act in stranded:  # their sandbox is gone: they start over in a fresh session
            self._npending -= 1
            self._enqueue(act)

    def _on_session_closed(self, ev: SessionClosed) -> None:
        w = self._sessions.pop(ev.session_id, None)
        image = self._session_image.pop(ev.session_id, None)
        if image is not None:
            self.caps.close_session(image, self._now)
            self._caps_touched = True
        if w is None:
            return
        w.sessions.discard(ev.session_id)
        if not w.sessions:
            w.command_mb = 0.0
        mem = self._session_mem.pop(ev.session_id, 0.0)
        if mem:
            w.pinned_mb -= mem
            if w.running or w.pinned_mb > 1e-6 or w.reserved_for is not None:
                self.ledger.release(w, (0.0, mem, 0.0, 0.0), 1)
            else:
                w.pinned_mb = 0.0
                self.ledger.settle(w)
            self._dirty[w.id] = w
            self._freed[w.id] = w
        # Actions still bound to the closed session would need a new sandbox: they queue again as new
        # sessions, so that they pass the sandbox caps like any other (their old heap entries go stale).
        bound = [
            a for (_, seq, a) in w.aff_heap if a.seq == seq and a.state is P and a.session == ev.session_id
        ]
        for act in bound:
            if w.reserved_for == act.id:
                self._unreserve(act.id)
            self._npending -= 1
            self._enqueue(act)

    def _on_throttled(self, ev: ActionThrottled) -> None:
        """The API refused a started action (429): pause its key, free what it held, queue it again.

        It never reached the API's work, so it runs again under the same id; the agent never sees it.
        """
        act = self._acts.get(ev.action_id)
        if act is None or act.state is not R:
            return
        w = act.worker
        assert w is not None
        del w.running[act.id]
        if w.running or w.pinned_mb or w.reserved_for is not None:
            self.ledger.release(w, act.vec, act.k)
        else:
            self.ledger.settle(w)
        api, key = act.ev.api, act.api_key
        self._released(act)
        self._return_sandbox(act)
        self.estimator.abandon(act.ev.kind, act.id)
        if api is not None and key is not None:
            self.api_quotas.throttled(api, key, self._now + max(0.0, ev.retry_after_s), self._now)
        act.worker = None
        self._nrunning -= 1
        self._transition(act, P, ("throttled: key", key, "paused", ev.retry_after_s, "s"))
        self._out.append(Requeue(act.id))
        self._enqueue(act)
        self._dirty[w.id] = w
        self._freed[w.id] = w

    def _on_trajectory_closed(self, ev: TrajectoryClosed) -> None:
        """Nothing is bound to a trajectory here (its sandbox is a session, closed separately)."""

    def _on_tick(self, ev: Tick) -> None:
        self._caps_touched = True

    # --- queues -----------------------------------------------------------------------------------------
    def _partition(self, act: Act) -> str:
        """Name the share of the pool ``act`` draws on ("" for one shared pool)."""
        return ""

    def _refusal(self, act: Act) -> str | None:
        """Why ``act`` can never run under this policy (None: it can)."""
        return None

    def _admissible(self, act: Act, k: int) -> bool:
        """Whether ``act`` may take ``k`` more units: here, whether its API (if any) has a ready key.

        Subclasses that partition the pool add their own check (and call this one first).
        """
        api = act.ev.api
        if api is None or act.state is not P or not self.api_quotas.limited(api):
            return True  # growing a running action calls the API no more often
        return self.api_quotas.pick(api, self._now) is not None

    def _granted(self, act: Act, k: int) -> None:
        """``act`` was lent ``k`` more units: at its start, take its API key's token and slot."""
        api = act.ev.api
        if api is not None and act.api_key is None and self.api_quotas.limited(api):
            key = self.api_quotas.pick(api, self._now)
            assert key is not None, "granted without a ready key (_admissible said yes)"
            self.api_quotas.take(api, key, self._now)
            act.api_key = key

    def _run_begins(self, act: Act) -> None:
        """``act`` starts at its final width: until it ends, the estimator counts it as running."""
        model = self.estimator.model(act.ev.kind)
        run_from = self._now + (model.setup_s if act.cold else 0.0)
        model.start(act.id, act.k, run_from, self._now, self._forget)

    def _released(self, act: Act) -> None:
        """``act`` gave its units back: its API key's slot is free (the token stays spent)."""
        if act.api_key is not None:
            assert act.ev.api is not None
            self.api_quotas.release(act.ev.api, act.api_key)
            act.api_key = None

    def _class_of(self, act: Act) -> Klass:
        ev = act.ev
        key = (
            ev.kinds_needed or ev.kind,
            act.vec,
            ev.min_par,
            ev.max_par,
            ev.image,
            ev.provider,
            act.session is not None,
            act.open_mb,
            self._partition(act),
        )
        k = self._classes.get(key)
        if k is None:
            k = self._classes[key] = Klass(key, act)
        return k

    def _enqueue(self, act: Act) -> None:
        """Queue a pending ``act``: in its session's worker heap, or its class heap (or reject it)."""
        act.seq = seq = next(self._seq)
        home = self._sessions.get(act.session) if act.session is not None else None
        # Its own sandbox's memory stays lent while the session lives: what is left is all it can get.
        pin = self._session_mem.get(act.session, 0.0) if act.session is not None else 0.0
        if home is not None and not fits(
            [home.cap[0], home.cap[1] - pin, *home.cap[2:]], act.vec, act.ev.min_par
        ):
            self._transition(act, ActionState.REJECTED, ("its session's worker", home.id, "can never fit it"))
            del self._acts[act.id]
            self._out.append(
                Reject(
                    act.id,
                    f"its session {act.session} lives on {home.id}, which can never fit "
                    f"{act.ev.demand} x {act.ev.min_par} beside the {pin:g} MiB its sandbox holds between "
                    f"commands (of {home.cap[1]:g} MiB): lend that worker more memory, or lower the "
                    "tool's mem_mb or the image's reserve_mb",
                )
            )
            return
        if home is not None:
            act.home, act.cls = home, None
            heapq.heappush(home.aff_heap, (act.key, seq, act))
            self._dirty[home.id] = home
        else:
            cls = self._class_of(act)
            act.home, act.cls = None, cls
            cls.live += 1
            self._class_touched = True
            heapq.heappush(cls.heap, (act.key, seq, act))
        self._npending += 1

    def _dequeued(self, act: Act) -> None:
        """``act`` leaves the pending queue (its heap entry goes stale and is dropped when reached)."""
        act.seq = -1
        if act.cls is not None:
            act.cls.live -= 1
        self._npending -= 1
        if act.id in self._reservations:
            self._unreserve(act.id)

    def _transition(self, act: Act, new: ActionState, detail: Detail) -> None:
        self._story.record(act.id, self._now, act.state, new, detail)
        act.state = new

    # --- invariants -------------------------------------------------------------------------------------
    def validate_state(self) -> None:
        """Assert every invariant of the books (the tests and the simulator call it)."""
        lent: dict[str, list[float]] = {}
        running = 0
        pinned: dict[str, float] = {}
        for s, mem in self._session_mem.items():
            home = self._sessions[s]
            pinned[home.id] = pinned.get(home.id, 0.0) + mem
        for w in self.ledger.workers.values():
            assert abs(w.pinned_mb - pinned.get(w.id, 0.0)) <= 1e-6 * max(1.0, w.cap[1]), (
                f"{w.id} pins {w.pinned_mb} MiB for sessions holding {pinned.get(w.id, 0.0)}"
            )
            acc = [0.0, w.pinned_mb, 0.0, 0.0]  # live sessions pin their sandboxes' memory
            for i, held in enumerate(self._holds.get(w.id, ())):
                acc[i] += held  # units held for a reservation
            for act in w.running.values():
                assert act.state is R and act.worker is w, f"{act.id} booked on {w.id} but {act.state}"
                assert act.ev.min_par <= act.k <= act.ev.max_par, f"{act.id} has k={act.k}"
                if act.leader is not None:
                    continue  # a batch's rider holds nothing of its own
                for i in range(4):
                    acc[i] += act.vec[i] * act.k
            lent[w.id] = acc
            running += len(w.running)
            assert (w.id in self._holds) == (w.reserved_for is not None), (
                f"{w.id} holds without a reservation"
            )
            for s in w.sessions:
                assert self._sessions.get(s) is w, f"session {s} of {w.id} not mapped to it"
        self.ledger.validate(lent)
        assert running == self._nrunning, f"{running} running booked, counter says {self._nrunning}"
        pending = [a for a in self._acts.values() if a.state is P]
        assert len(pending) == self._npending, f"{len(pending)} pending, counter says {self._npending}"
        assert len(pending) + running == len(self._acts), (
            "an action in the books is neither pending nor running"
        )
        live: dict[tuple[Any, ...], int] = {}
        for act in pending:
            if act.cls is not None:
                live[act.cls.key] = live.get(act.cls.key, 0) + 1
                assert any(e[1] == act.seq for e in act.cls.heap), f"{act.id} lost from its class heap"
            else:
                assert act.home is not None and any(e[1] == act.seq for e in act.home.aff_heap), (
                    f"{act.id} lost"
                )
        for key, cls in self._classes.items():
            assert cls.live == live.get(key, 0), f"class {key} counts {cls.live}, has {live.get(key, 0)}"
        for s, w in self._sessions.items():
            assert self.ledger.workers.get(w.id) is w and s in w.sessions, f"session {s} on a stale worker"
        for action_id, w in self._reservations.items():
            assert w.reserved_for == action_id and self._acts[action_id].state is P, (
                f"stale reservation {action_id}"
            )
        self.caps.validate()
        self.api_quotas.validate()
        in_flight: dict[tuple[str, str], int] = {}
        for act in self._acts.values():
            if act.api_key is not None:
                assert act.state is R and act.ev.api is not None, f"{act.id} holds a key but is {act.state}"
                slot = (act.ev.api, act.api_key)
                in_flight[slot] = in_flight.get(slot, 0) + 1
        for api in self.api_quotas.config.apis:
            for name, n in self.api_quotas.in_flight(api).items():
                assert n == in_flight.get((api, name), 0), f"{api}/{name}: {n} in flight booked"
