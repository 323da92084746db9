"""Elastic sizing: how many units an action gets beyond ``min_par``, from its estimated speed-up.

Only units that no pending action could take are handed out (sizing runs after placement), and only
to actions starting now: running actions are never grown or shrunk. A unit is worth lending only if
it cuts the action's estimated run time by ``min_rel_gain`` of itself *and* by more than the queue is
expected to lose while the unit is held: ``queue_cost`` x the resource's busy fraction (what arrivals
keep busy on average, from a decayed sum of their estimated work, over the pool's capacity) x the
time it is held. The pool keeps ``load_headroom`` x that average load free, each worker its
``cpu_headroom``/``gpu_headroom``, and no GPU is lent while a GPU action waits. Units are per
worker, so only actions starting on the same worker compete: one alone is sized in closed form, a
group takes units one at a time, each to the action whose run time falls most per unit of the
worker's dominant resource.
"""

from __future__ import annotations

import heapq

from tangram_env.server.scheduler.estimator import DurationEstimator
from tangram_env.server.scheduler.ledger import EPS, Ledger
from tangram_env.server.scheduler.policy import PolicyConfig
from tangram_env.server.scheduler.records import Act, Klass
from tangram_env.server.scheduler.story import ActionState, StoryLog

R = ActionState.RUNNING


class Sizing:
    """The sizing half of the scheduler (a mixin; the scheduler owns the state)."""

    config: PolicyConfig
    ledger: Ledger
    estimator: DurationEstimator
    _story: StoryLog
    _now: float
    _classes: dict[tuple[object, ...], Klass]
    _gpu_queued = False

    def _admissible(self, act: Act, k: int) -> bool:
        raise NotImplementedError

    def _granted(self, act: Act, k: int) -> None:
        raise NotImplementedError

    def _grow(self, started: list[Act]) -> None:
        """Give units that no pending action could take to the actions just started, best gain first.

        Units are per worker, so only actions started on the same worker compete for them: an action
        alone on its worker is sized in closed form, a group goes through a heap of marginal gains.
        """
        # GPUs are not lent for growth while GPU actions wait: every GPU freed goes to one of them soon.
        self._gpu_queued = any(c.live > 0 and c.vec[2] > 0 for c in self._classes.values())
        by_worker: dict[str, list[Act]] = {}
        for act in started:
            if act.ev.max_par > act.k and act.worker is not None and act.leader is None:
                by_worker.setdefault(act.worker.id, []).append(act)
        for group in by_worker.values():
            if len(group) == 1:
                self._grow_alone(group[0])
            else:
                self._grow_group(group)
        for act in started:
            if act.k > act.ev.min_par:
                self._story.note(act.id, self._now, R, ("grown to x", act.k))

    def _expected_load(self) -> list[float]:
        raise NotImplementedError

    def _room(self, act: Act) -> int:
        """Units of ``act`` its worker can still lend it beyond the growth headroom.

        Two limits: the worker keeps ``cpu_headroom`` / ``gpu_headroom`` of itself free, and the pool
        keeps free ``load_headroom`` times what arrivals keep busy on average, so that a unit goes to a
        running action only when the queue is not expected to need it.
        """
        w = act.worker
        assert w is not None
        if w.reserved_for not in (None, act.id):
            return 0
        cfg, vec, free, cap = self.config, act.vec, w.free, w.cap
        room = act.ev.max_par - act.k
        for i, keep in ((0, cfg.cpu_headroom * cap[0]), (1, 0.0), (2, cfg.gpu_headroom * cap[2]), (3, 0.0)):
            if vec[i] > 0:
                room = min(room, int((free[i] - keep + EPS) / vec[i]))
        if vec[2] > 0 and self._gpu_queued:
            return 0
        if vec[2] > 0 and w.devices is not None:
            # A GPU lent for growth must already hold the model: loading it there costs more than the
            # unit saves, and evicts what that device held for others.
            while room > 0 and not w.devices.warm(act.ev.kind, vec[2] * (act.k + room)):
                room -= 1
        if cfg.load_headroom > 0 and room > 0:
            load = self._expected_load()
            total, used = self.ledger.cap_total, self.ledger.used_total
            for i in (0, 2):  # cores and GPUs: what growth lends
                if vec[i] > 0:
                    spare = total[i] - used[i] - cfg.load_headroom * load[i]
                    room = min(room, int((spare + EPS) / vec[i]))
        return max(0, room)

    def _grow_alone(self, act: Act) -> None:
        a, b = self._shape(act)
        k0 = k = act.k
        limit = k + self._room(act)
        busy = self._busy(act)
        while k < limit and self._worth(a, b, k, busy):
            k += 1
        if k > k0 and self._admissible(act, k - k0):
            assert act.worker is not None
            self.ledger.allocate(act.worker, act.vec, k - k0)
            self._granted(act, k - k0)
            act.k = k
            m = self.estimator.model(act.ev.kind)
            act.expect_end += m.b / k - m.b / k0

    def _grow_group(self, group: list[Act]) -> None:
        heap: list[tuple[float, int, Act]] = []
        for i, act in enumerate(group):
            gain = self._gain(act)
            if gain > 0:
                heap.append((-gain, i, act))
        heapq.heapify(heap)
        while heap:
            _, i, act = heapq.heappop(heap)
            w = act.worker
            assert w is not None
            if self._room(act) < 1 or not self._admissible(act, 1):
                continue
            self.ledger.allocate(w, act.vec, 1)
            self._granted(act, 1)
            act.k += 1
            m = self.estimator.model(act.ev.kind)
            act.expect_end += m.b / act.k - m.b / (act.k - 1)
            if act.k < act.ev.max_par:
                gain = self._gain(act)
                if gain > 0:
                    heapq.heappush(heap, (-gain, i, act))

    def _shape(self, act: Act) -> tuple[float, float]:
        """The ``(a, b)`` of ``act``'s kind that sizing uses (run time ``a + b / k``).

        Until a kind has ``explore`` completions above one unit, and whenever fewer than a quarter of
        its recent completions ran on more than one unit, its speed-up is taken from the prior (at
        least): a noisy fit that says "serial" would otherwise keep every start at one unit, and then
        no new evidence could ever say otherwise.
        """
        m = self.estimator.model(act.ev.kind)
        a, b = m.a, m.b
        if m.multi < self.config.explore or m.nm < 0.25 * m.n:
            t1, p0 = a + b, m.p0
            if b < t1 * p0:
                a, b = t1 * (1 - p0), t1 * p0
        return a, b

    def _busy(self, act: Act) -> float:
        """How busy arrivals keep the resources ``act`` grows on (0..1: the chance a lent unit is missed)."""
        if self.config.queue_cost <= 0:
            return 0.0
        load, total = self._expected_load(), self.ledger.cap_total
        vec = act.vec
        return min(1.0, max((load[i] / total[i] for i in (0, 2) if vec[i] > 0 and total[i] > 0), default=0.0))

    def _worth(self, a: float, b: float, k: int, busy: float) -> bool:
        """Whether a ``k+1``-th unit pays: it cuts the run time by ``min_rel_gain`` of itself, and by more
        than what the queue is expected to lose meanwhile (``queue_cost`` x ``busy`` x the time it is held).
        """
        drop = b / k - b / (k + 1)
        return (
            drop > 0
            and drop >= self.config.min_rel_gain * (a + b / k)
            and drop >= self.config.queue_cost * busy * (a + b / (k + 1))
        )

    def _gain(self, act: Act) -> float:
        """Seconds saved per unit of the worker's dominant resource by one more unit (0: not worth it)."""
        a, b = self._shape(act)
        k = act.k
        drop = b / k - b / (k + 1)
        if not self._worth(a, b, k, self._busy(act)):
            return 0.0
        w = act.worker
        assert w is not None
        share = max((act.vec[i] / w.cap[i] for i in range(4) if w.cap[i] > 0), default=0.0) or 1.0
        return drop / share
