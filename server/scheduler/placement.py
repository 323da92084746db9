"""Placement and dispatch: the policy half of :class:`~.core.ActionLevelScheduler`.

Dispatch runs after each batch of events: (1) on every worker whose capacity changed (or whose
session heap gained an action), the action it is reserved for starts if it fits, then its session
heap drains in key order; (2) class heads start in key order while any fits (a class whose head
fitted nowhere is skipped until capacity it could use frees); (3) units that no pending action could
take go to the actions just started (:mod:`~.sizing`).
"""

from __future__ import annotations

import heapq
import itertools

from tangram_env.server.scheduler.caps import SandboxCaps
from tangram_env.server.scheduler.estimator import DurationEstimator
from tangram_env.server.scheduler.events import Decision, Reject, Start
from tangram_env.server.scheduler.ledger import EPS, Ledger, Pool, Vec, Worker, fits
from tangram_env.server.scheduler.policy import PolicyConfig
from tangram_env.server.scheduler.records import Act, DecayedMean, Klass, opening_vec
from tangram_env.server.scheduler.sizing import Sizing
from tangram_env.server.scheduler.story import ActionState, Detail, StoryLog

P, R = ActionState.PENDING, ActionState.RUNNING
_DEFER = object()  # placement answer: wait for a warm worker rather than start cold


class Placement(Sizing):
    """Where and how wide pending actions start; mixed into the scheduler, which owns the state."""

    config: PolicyConfig
    ledger: Ledger
    estimator: DurationEstimator
    caps: SandboxCaps
    _story: StoryLog
    _acts: dict[str, Act]
    _classes: dict[tuple[object, ...], Klass]
    _sessions: dict[str, Worker]
    _session_mem: dict[str, float]
    _session_image: dict[str, str]
    _warm: dict[str, dict[str, Worker]]
    _reservations: dict[str, Worker]
    _dirty: dict[str, Worker]
    _freed: dict[str, Worker]
    _recheck: dict[str, Worker]
    _nrunning: int
    _now: float
    _wake: float | None
    _caps_touched: bool
    _overdue_scan_at: float
    _capacity_wake: float | None  # when the first action waiting for capacity to join gives up
    _class_touched: bool
    _seen_version: int
    _out: list[Decision]
    _wait_aware: bool
    _cpu_waits: DecayedMean
    _holds: dict[str, list[float]]  # reserved worker -> what it holds for its reservation so far
    _batches: dict[tuple[object, ...], dict[str, int]]  # class -> its batches started this call: riders

    # Hooks and queue operations the scheduler defines.
    def _admissible(self, act: Act, k: int) -> bool:
        raise NotImplementedError

    def _refusal(self, act: Act) -> str | None:
        raise NotImplementedError

    def _granted(self, act: Act, k: int) -> None:
        raise NotImplementedError

    def _run_begins(self, act: Act) -> None:
        raise NotImplementedError

    def _dequeued(self, act: Act) -> None:
        raise NotImplementedError

    def _enqueue(self, act: Act) -> None:
        raise NotImplementedError

    def _transition(self, act: Act, new: ActionState, detail: Detail) -> None:
        raise NotImplementedError

    # --- placement --------------------------------------------------------------------------------------
    def _start(self, act: Act, w: Worker, k: int) -> None:
        self.ledger.allocate(w, act.vec, k)
        if self._wait_aware and act.vec[2] <= 0.0:
            self._cpu_waits.add(self._now - act.arrived, self._now)
        self._granted(act, k)
        self._dequeued(act)
        w.running[act.id] = act
        act.worker, act.k = w, k
        self._nrunning += 1
        ev = act.ev
        act.cold = not self._warm_at(w, ev.kind, act.vec, k)
        if act.session is not None:
            w.command_mb = max(w.command_mb, act.vec[1] * k)
        if act.session is not None and act.session not in self._sessions:
            self._sessions[act.session] = w
            w.sessions.add(act.session)
            if act.open_mb:  # its sandbox's memory stays lent until the session closes
                self.ledger.allocate(w, (0.0, act.open_mb, 0.0, 0.0), 1)
                w.pinned_mb += act.open_mb
                self._session_mem[act.session] = act.open_mb
            if ev.image is not None:
                self._session_image[act.session] = ev.image
                act.cold = not self.caps.start_session(ev.image, self._now)
                act.opens = ev.image
                self._caps_touched = True
        elif act.session is None and ev.image is not None:  # a sandbox of its own while it runs
            act.sandbox = ev.image
            if not self.caps.start_action(ev.image, self._now):
                act.cold = True  # it waits for a new sandbox, however warm its worker is
            self._caps_touched = True
        m = self.estimator.model(ev.kind)
        act.expect_end = self._now + (m.setup_s if act.cold else 0.0) + m.a + m.b / k
        self._story.record(act.id, self._now, act.state, R, ("on", w.id, "x", k))
        act.state = R

    def _return_sandbox(self, act: Act, *, lost: bool = False) -> None:
        """``act`` stopped running: the sandbox it borrowed without a session goes back (or was lost)."""
        if act.sandbox is not None:
            self.caps.end_action(act.sandbox, self._now, lost=lost)
            act.sandbox = None
            self._caps_touched = True

    def _warm_at(self, w: Worker, kind: str, vec: Vec, k: int) -> bool:
        """Whether ``kind`` started on ``w`` with ``k`` units would find its warm state there.

        A GPU kind is warm only if every device the worker would lend it holds its model already.
        """
        if w.devices is not None and vec[2] > 0:
            return bool(w.devices.warm(kind, vec[2] * k))
        return kind in w.warm

    def _lend_devices(self, act: Act) -> None:
        """Take devices for a GPU action at its final width (after growth): cold if any lacks its model."""
        w = act.worker
        assert w is not None and w.devices is not None
        kind, need = act.ev.kind, act.vec[2] * act.k
        per_gpu = act.vec[3] / act.vec[2]
        act.devices, cold, evicted = w.devices.take(kind, need, per_gpu)
        self._warm.setdefault(kind, {}).setdefault(w.id, w)  # moved to the end when it frees
        for old in evicted:
            self._warm.get(old, {}).pop(w.id, None)
        if cold != act.cold:
            m = self.estimator.model(kind)
            act.expect_end += m.setup_s if cold else -m.setup_s
            act.cold = cold

    def _free_devices(self, act: Act) -> None:
        """``act`` gave its devices back: its worker becomes the first place to look for a warm one."""
        w = act.worker
        assert w is not None and w.devices is not None
        kind = act.ev.kind
        w.devices.give(kind, act.devices, act.vec[2] * act.k)
        act.devices = ()
        peers = self._warm.get(kind)
        if peers is not None and w.devices.holds(kind):
            peers.pop(w.id, None)
            peers[w.id] = w  # most recently freed last: the peers looked at first

    def _mark_warm(self, w: Worker, kind: str) -> None:
        limit = self.config.warm_kinds_per_worker
        if limit <= 0:
            return
        w.warm.pop(kind, None)
        w.warm[kind] = None
        peers = self._warm.setdefault(kind, {})
        peers.pop(w.id, None)
        peers[w.id] = w
        while len(w.warm) > limit:
            old = next(iter(w.warm))
            del w.warm[old]
            self._warm.get(old, {}).pop(w.id, None)

    def _pools(self, cls: Klass) -> list[Pool]:
        if cls.pools_version != self.ledger.version:
            cls.pools = self.ledger.eligible_pools(cls.kind, cls.vec, cls.min_par)
            cls.pools_version = self.ledger.version
        return cls.pools

    def _place(self, cls: Klass, act: Act) -> Worker | object | None:
        """Where ``act`` (its class's head) starts now: a worker, None (nowhere fits) or ``_DEFER``."""
        cfg = self.config
        vec, k = cls.vec, cls.min_par
        session = (act.open_mb, act.vec[1] * k) if cls.new_session else None
        w = self.ledger.find(self._pools(cls), vec, k, cls.worst, cfg.probe, session)
        kind = act.ev.kind
        # A new session's warm state is its image's pool (anywhere), not a worker: nothing to prefer.
        if not cfg.warm_aware or cls.new_session or self.estimator.setup(kind) < cfg.warm_min_setup_s:
            return w
        warm = self._warm.get(kind)
        if not warm or (w is not None and self._warm_at(w, kind, vec, k)):
            return w
        soonest = float("inf")
        for peer in itertools.islice(reversed(warm.values()), 4):
            if peer.hidden or not fits(list(peer.cap), vec, k):
                continue
            if fits(peer.free, vec, k) and self._warm_at(peer, kind, vec, k):
                return peer
            if len(peer.running) <= 2 * cfg.probe:  # bounded work: busy hosts are skipped
                for a in peer.running.values():
                    if a.expect_end < soonest:
                        soonest = a.expect_end
        cold_s = self.estimator.setup(kind)
        give_up_at = act.arrived + cold_s  # never wait for warmth longer than a cold start costs
        # Waiting pays only while the warm workers can absorb the queue; a longer queue warms up more.
        if soonest - self._now < cold_s and self._now < give_up_at and cls.live <= len(warm):
            self._note_wake(give_up_at)
            return _DEFER
        return w

    def _note_wake(self, t: float) -> None:
        if self._wake is None or t < self._wake:
            self._wake = t

    def _reserve(self, act: Act, w: Worker) -> None:
        """Hold units on ``w`` for ``act`` as they free, until it fits; the rest of ``w`` stays usable."""
        w.reserved_for = act.id
        self._reservations[act.id] = w
        self._holds[w.id] = [0.0, 0.0, 0.0, 0.0]
        if act.cls is not None:
            act.cls.reserved = act.id
        self._dirty[w.id] = w  # take what is free there now

    def _unreserve(self, action_id: str) -> None:
        w = self._reservations.pop(action_id, None)
        if w is None:
            return
        w.reserved_for = None
        self._class_touched = True
        act = self._acts.get(action_id)
        if act is not None and act.cls is not None and act.cls.reserved == action_id:
            act.cls.reserved = None
        hold = self._holds.pop(w.id)
        if self.ledger.workers.get(w.id) is w:
            if any(hold):
                self.ledger.release(w, (hold[0], hold[1], hold[2], hold[3]), 1)
            self._dirty[w.id] = w
            self._freed[w.id] = w

    def _overdue(self, act: Act) -> bool:
        # No wake-up needed: a reservation only matters once capacity frees, which is an event anyway.
        return self._now >= act.arrived + self.config.reserve_after_s

    # --- dispatch ---------------------------------------------------------------------------------------
    def _dispatch(self, now: float) -> None:
        self._wake = None
        self._batches = {}
        self.caps.new_round()
        started: list[Act] = []
        if self._recheck and (self._freed or self._caps_touched):
            # Held back by a quota or a cap, not by their worker's room: look again once anything frees.
            self._dirty.update(self._recheck)
            self._recheck = {}
        self._drain_dirty(started)
        self._drain_classes(started)
        if self._dirty:  # actions that followed their session to a worker meanwhile
            self._drain_dirty(started)
        if self.config.elastic and started and any(a.ev.max_par > a.k for a in started):
            self._grow(started)
        out = self._out
        for act in started:  # a batch's leader comes before its riders
            w = act.worker
            assert w is not None
            lead = act.leader
            if lead is not None:  # runs in its leader's batch, at its width, on its devices
                act.k, act.cold, act.expect_end = lead.k, lead.cold, lead.expect_end
                out.append(Start(act.id, w.id, act.k, act.api_key, batch_of=lead.id))
                continue
            if w.devices is not None and act.vec[2] > 0:
                self._lend_devices(act)
            self._run_begins(act)
            out.append(Start(act.id, w.id, act.k, act.api_key))
        expiry = self.caps.next_expiry()
        if self._caps_touched or (expiry is not None and expiry <= now):
            self._caps_touched = False
            out.extend(self.caps.rebalance(now))

    def _drain_dirty(self, started: list[Act]) -> None:
        if self._dirty:
            dirty, self._dirty = self._dirty, {}
            workers = self.ledger.workers
            for w in dirty.values():
                if w.id not in workers:
                    continue
                if w.reserved_for is not None:
                    self._start_reserved(w, started)
                if w.aff_heap:
                    self._drain_sessions(w, started)

    def _start_reserved(self, w: Worker, started: list[Act]) -> None:
        """Start the action ``w`` is reserved for, if it fits now (checked whenever ``w`` is dirty)."""
        assert w.reserved_for is not None
        act = self._acts[w.reserved_for]
        k = act.ev.min_par
        opens = act.session is not None and act.session not in self._sessions
        vec = opening_vec(act) if opens else act.vec
        hold, free = self._holds[w.id], w.free
        take = (
            max(0.0, min(free[0], vec[0] * k - hold[0])),
            max(0.0, min(free[1], vec[1] * k - hold[1])),
            max(0.0, min(free[2], vec[2] * k - hold[2])),
            max(0.0, min(free[3], vec[3] * k - hold[3])),
        )
        if take[0] > EPS or take[1] > EPS or take[2] > EPS or take[3] > EPS:
            self.ledger.allocate(w, take, 1)  # units freed here go to it before anyone else
            for i in range(4):
                hold[i] += take[i]
        if any(hold[i] < vec[i] * k - EPS for i in range(4)):
            return  # it will be dirty again when something there finishes
        if opens and not w.room_for_session(act.open_mb, act.vec[1] * k):
            return  # the sessions here must end first: each that closes makes it dirty again
        new_sandbox = act.cls is not None and act.ev.image is not None  # a new session, or none
        if not self._admissible(act, k) or (
            new_sandbox and not self.caps.admit(act.ev.image or "", act.ev.provider, self._now)
        ):
            self._recheck[w.id] = w
            return
        self._unreserve(act.id)  # what it held becomes its grant
        self._start(act, w, k)  # its heap entry goes stale
        started.append(act)

    def _lend_hold(self, w: Worker, vec: Vec, k: int) -> None:
        """Give back what a session action living on ``w`` needs of the units held for its reservation.

        The reserved action may be waiting for memory that those sessions' sandboxes hold, which frees
        only when their actions run: the hold never stands in their way.
        """
        hold, free = self._holds[w.id], w.free
        back = tuple(max(0.0, min(hold[i], vec[i] * k - free[i])) for i in range(4))
        if any(x > EPS for x in back):
            self.ledger.release(w, (back[0], back[1], back[2], back[3]), 1)
            for i in range(4):
                hold[i] -= back[i]

    def _drain_sessions(self, w: Worker, started: list[Act]) -> None:
        heap = w.aff_heap
        skipped: list[tuple[float, int, Act]] = []
        while heap:
            entry = heap[0]
            act = entry[2]
            if act.seq != entry[1] or act.state is not P:
                heapq.heappop(heap)
                continue
            # A reservation does not hold back the sessions already living here: their actions are how
            # the sandboxes' pinned memory (which the reserved action may be waiting for) ever frees.
            k = act.ev.min_par
            if not self._admissible(act, k):  # its share is full; others bound here may still go
                refusal = self._refusal(act)
                if refusal is not None:
                    heapq.heappop(heap)
                    self._dequeued(act)
                    self._transition(act, ActionState.REJECTED, refusal)
                    del self._acts[act.id]
                    self._out.append(Reject(act.id, refusal))
                    continue
                skipped.append(heapq.heappop(heap))
                if len(skipped) >= self.config.probe:
                    break
                continue
            if w.reserved_for is not None and not fits(w.free, act.vec, k):
                self._lend_hold(w, act.vec, k)
            if not fits(w.free, act.vec, k):
                # Reserve only when some room is free here that it cannot use yet but others could
                # take: on a full worker the next room freed goes to this head anyway.
                if w.reserved_for is None and self._overdue(act):
                    assert w.pool is not None
                    if w.free[w.pool.dim_for(act.vec)] > EPS:
                        self._reserve(act, w)
                break
            heapq.heappop(heap)
            self._start(act, w, k)
            started.append(act)
        if skipped:
            self._recheck[w.id] = w
            for entry in skipped:
                heapq.heappush(heap, entry)

    def _head(self, cls: Klass) -> Act | None:
        heap = cls.heap
        while heap:
            _, seq, act = heap[0]
            if act.seq != seq or act.state is not P:
                heapq.heappop(heap)
                continue
            if act.session is not None and act.session in self._sessions:
                # Another action of its session started meanwhile: it must follow it there.
                heapq.heappop(heap)
                self._dequeued(act)
                self._enqueue(act)  # marks its new home dirty (or rejects it, if that can never fit it)
                continue
            return act
        return None

    def _drain_classes(self, started: list[Act]) -> None:
        """Start class heads in key order while any fits; a class whose head cannot start is done."""
        version = self.ledger.version
        # Blocked classes are looked at again for reservations about once a second, not on every call.
        scan_overdue = self._now >= self._overdue_scan_at or (
            self._capacity_wake is not None and self._now >= self._capacity_wake
        )
        if not (self._freed or self._class_touched or self._caps_touched or scan_overdue) and (
            version == self._seen_version
        ):
            return  # no class gained a member, no capacity freed, no cap changed: nothing can start
        self._class_touched = False
        self._capacity_wake = None  # set again below by any action still waiting for capacity
        self._seen_version = version
        if scan_overdue:
            self._overdue_scan_at = self._now + 1.0
        order: list[tuple[float, int, Klass, Act]] = []
        overdue: list[tuple[float, int, Klass, Act]] = []
        freed = [w for w in self._freed.values() if not w.hidden]
        self._freed = {}
        for n, cls in enumerate(self._classes.values()):
            if cls.live <= 0:
                cls.blocked = False  # new arrivals into an empty class get a fresh look
                continue
            if cls.reserved is not None:
                continue
            if cls.blocked and (
                (not freed and cls.blocked_version == version) or not self._unblocked(cls, freed, version)
            ):
                # Nowhere fitted it last time and no capacity it could use has freed since.
                if scan_overdue:
                    act = self._head(cls)
                    if act is not None and self._overdue(act):
                        overdue.append((act.arrived, n, cls, act))
                continue
            act = self._head(cls)
            if act is not None:
                order.append((act.key, n, cls, act))
        # The longest waiting reserve first: a worker holds for one action at a time, and a reservation
        # exists to bound the wait.
        for _, _, cls, act in sorted(overdue, key=lambda o: (o[0], o[1])):
            self._reserve_somewhere(cls, act)
        heapq.heapify(order)
        while order:
            _, n, cls, act = heapq.heappop(order)
            if act.state is not P or cls.reserved is not None:
                continue
            pools = self._pools(cls)
            if not pools:
                if any(p.serves(cls.kind) for p in self.ledger.pools.values()):
                    give_up_at = act.arrived + self.config.await_capacity_s
                    if self._now < give_up_at:  # capacity that fits it may yet join
                        if self._capacity_wake is None or give_up_at < self._capacity_wake:
                            self._capacity_wake = give_up_at
                        continue
                    self._reject(cls, act)
                    nxt = self._head(cls)
                    if nxt is not None:
                        heapq.heappush(order, (nxt.key, n, cls, nxt))
                continue  # else no worker serves its kind yet: it waits for one to join
            if not self._admissible(act, cls.min_par):
                if self._refusal(act) is not None:  # the pool shrank under its quota: it never will be
                    self._reject(cls, act)
                    nxt = self._head(cls)
                    if nxt is not None:
                        heapq.heappush(order, (nxt.key, n, cls, nxt))
                continue
            # A class's action of an image opens a session or runs without one: either may need a
            # new sandbox.
            if cls.image is not None and not self.caps.admit(cls.image, cls.provider, self._now):
                continue
            w = self._place(cls, act)
            if (w is None or w is _DEFER) and cls.key in self._batches:
                self._join_batches(cls, started)  # what cannot start on its own rides in a batch
                act = self._head(cls)
                if act is None:
                    continue
            if w is None or w is _DEFER:
                if w is None:
                    cls.blocked, cls.blocked_version = True, version
                    if self._overdue(act):
                        self._reserve_somewhere(cls, act)
                continue
            assert isinstance(w, Worker)
            cls.blocked = False
            heapq.heappop(cls.heap)
            self._start(act, w, cls.min_par)
            started.append(act)
            if self.config.batch_max > 1 and cls.vec[2] > 0 and not cls.new_session and act.ev.api is None:
                self._batches.setdefault(cls.key, {})[act.id] = 0  # a batch others of its class may join
            nxt = self._head(cls)
            if nxt is not None:
                heapq.heappush(order, (nxt.key, n, cls, nxt))

    def _join_batches(self, cls: Klass, started: list[Act]) -> None:
        """Start the rest of ``cls``'s queue in the batches of its actions started in this call.

        Only what cannot start on units of its own joins (a batch is slower than a lone request), the
        smallest batch first: a GPU worker runs the requests for one loaded model that reach it
        together as one forward pass, far cheaper than one by one; riders hold nothing of their own.
        """
        batches = self._batches[cls.key]
        limit = self.config.batch_max - 1
        while True:
            lead_id = min(batches, key=batches.__getitem__)
            if batches[lead_id] >= limit:
                return
            act = self._head(cls)
            if act is None:
                return
            lead = self._acts[lead_id]
            w = lead.worker
            assert w is not None
            batches[lead_id] += 1
            heapq.heappop(cls.heap)
            self._dequeued(act)
            w.running[act.id] = act
            act.worker, act.k, act.leader = w, lead.k, lead
            self._nrunning += 1
            self._story.record(act.id, self._now, act.state, R, ("in the batch of", lead.id, "on", w.id))
            act.state = R
            started.append(act)

    def _unblocked(self, cls: Klass, freed: list[Worker], version: int) -> bool:
        """Whether a blocked class may fit now: the pools changed, or a freed worker of its pools fits it."""
        if cls.blocked_version != version:
            cls.blocked = False
            return True
        pools = cls.pools  # current: blocked_version is the ledger's version
        v0, v1, v2, v3 = cls.vec
        k = cls.min_par
        for w in freed:
            f = w.free
            if (
                v0 * k <= f[0] + EPS
                and v2 * k <= f[2] + EPS
                and v1 * k <= f[1] + EPS
                and v3 * k <= f[3] + EPS
                and w.pool in pools
            ):
                cls.blocked = False
                return True
        return False

    def _reject(self, cls: Klass, act: Act) -> None:
        heapq.heappop(cls.heap)
        self._dequeued(act)
        self._transition(act, ActionState.REJECTED, "no worker can ever fit it")
        del self._acts[act.id]
        reason = f"no worker serving {cls.kind!r} can ever fit {act.ev.demand} x {cls.min_par}"
        if act.open_mb:
            reason += f" and the {act.open_mb:g} MiB its new sandbox holds between commands (reserve_mb)"
        if self.config.await_capacity_s:
            reason += f", and none that could joined within {self.config.await_capacity_s:g}s"
        self._out.append(Reject(act.id, reason))

    def _reserve_somewhere(self, cls: Klass, act: Act) -> None:
        """Hold the worker with the most free capacity for ``act``, whose class keeps being overtaken."""
        best: Worker | None = None
        for pool in self._pools(cls):
            dim = pool.dim_for(cls.vec)
            for w in pool.indexes[dim].candidates(0.0, worst=True):
                if w.reserved_for is not None:
                    continue  # held for another action already
                if best is None or w.free[dim] / w.cap[dim] > best.free[dim] / best.cap[dim]:
                    best = w
                break
        if best is not None:
            self._reserve(act, best)
