"""The resource ledger: what every worker has lent out, indexed so that finding a fit costs O(1).

Workers with the same capacity and the same served kinds form a *pool*. Inside a pool, workers are
bucketed by their free cores (and free GPU units, where the pool has GPUs); a bitmask of the non-empty
buckets answers "the least-free worker that still fits" (best fit) and "the most-free worker" (worst
fit) with a couple of integer operations, whatever the number of workers. Memory and GPU memory are
checked on each candidate, with a bounded number of candidates per query.

Every allocation checks that each of the four demands fits; one that does not raises
:class:`OverCommitError`, so no policy bug can lend what a worker does not have.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from tangram_env.errors import TangramRuntimeError
from tangram_env.protocol import Resources

CPU, MEM, GPU, GMEM = 0, 1, 2, 3
#: Slack for float sums: a demand fits when it exceeds what is free by no more than this.
EPS = 1e-9

Vec = tuple[float, float, float, float]


def vec_of(r: Resources) -> Vec:
    """Return the four amounts of ``r`` as a plain tuple (what the ledger computes with)."""
    return (float(r.cpu), float(r.mem_mb), float(r.gpu), float(r.gpu_mem_mb))


class OverCommitError(TangramRuntimeError, AssertionError):
    """An allocation that would lend more of some resource than a worker has free (a scheduler bug)."""


class Worker:
    """One worker as the ledger books it (plus the per-worker state the policies keep beside it)."""

    __slots__ = (
        "aff_heap",
        "cap",
        "command_mb",
        "devices",
        "free",
        "hidden",
        "id",
        "kinds",
        "pinned_mb",
        "pool",
        "reserved_for",
        "running",
        "sessions",
        "warm",
    )

    def __init__(self, worker_id: str, cap: Vec, kinds: frozenset[str] | None) -> None:
        self.id = worker_id
        self.cap = cap
        self.free = list(cap)
        self.kinds = kinds
        self.pool: Pool | None = None
        self.running: dict[str, Any] = {}  # action id -> the policy's record of it
        self.sessions: set[str] = set()
        self.pinned_mb = 0.0  # memory lent to live sandbox sessions (held between their actions too)
        # The largest command memory seen of a session living here (since the worker last held none):
        # a new sandbox may pin memory only while that much stays free of pins (see room_for_session).
        self.command_mb = 0.0
        self.warm: dict[str, None] = {}  # kinds with warm state here (a loaded model), oldest first
        self.hidden = False  # out of the index (reserved for one action)
        self.reserved_for: str | None = None
        self.aff_heap: list[Any] = []  # pending actions bound to a session here
        self.devices: Any = None  # the policy's model of its GPU devices (see devices.Devices), if any

    def room_for_session(self, open_mb: float, command_mb: float) -> bool:
        """Whether a new sandbox pinning ``open_mb`` (its commands taking ``command_mb``) may live here.

        Idle sandboxes hold their memory until their trajectories end, and a trajectory ends only by
        running its commands: once pins leave less than a command's memory, no command of the
        sessions here can ever start, and none of them can close. Keeping the largest command's
        memory clear of pins means the worker, emptied of commands, can always run the next one.
        """
        need = max(self.command_mb, command_mb)
        return self.cap[1] - self.pinned_mb - open_mb >= need - 1e-6

    def used(self) -> Vec:
        """Return what is lent out."""
        c, f = self.cap, self.free
        return (c[0] - f[0], c[1] - f[1], c[2] - f[2], c[3] - f[3])


class FreeIndex:
    """Workers bucketed by the free amount of one resource, with a bitmask of the non-empty buckets."""

    __slots__ = ("buckets", "dim", "inv", "mask", "quantum", "top", "where")

    def __init__(self, dim: int, capacity: float, nbuckets: int = 64) -> None:
        self.dim = dim
        # Capacities too small to split into buckets (a rounding residue) index as if empty.
        self.quantum = capacity / nbuckets if capacity > 1e-9 else 1.0
        self.inv = 1.0 / self.quantum
        self.top = nbuckets
        self.buckets: list[dict[str, Worker]] = [{} for _ in range(nbuckets + 1)]
        self.mask = 0
        self.where: dict[str, int] = {}

    def _bucket(self, free: float) -> int:
        b = int(free * self.inv + 1e-9)
        return 0 if b < 0 else (self.top if b > self.top else b)

    def put(self, w: Worker) -> None:
        """Index ``w`` by its current free amount."""
        b = self._bucket(w.free[self.dim])
        bucket = self.buckets[b]
        if not bucket:
            self.mask |= 1 << b
        bucket[w.id] = w
        self.where[w.id] = b

    def drop(self, w: Worker) -> None:
        """Forget ``w`` (no-op when it is not indexed)."""
        b = self.where.pop(w.id, None)
        if b is None:
            return
        bucket = self.buckets[b]
        del bucket[w.id]
        if not bucket:
            self.mask &= ~(1 << b)

    def update(self, w: Worker) -> None:
        """Move ``w`` to the bucket of its new free amount."""
        b = int(w.free[self.dim] * self.inv + 1e-9)
        if b < 0:
            b = 0
        elif b > self.top:
            b = self.top
        wid = w.id
        old = self.where.get(wid)
        if old == b:
            return
        buckets = self.buckets
        if old is not None:
            bucket = buckets[old]
            del bucket[wid]
            if not bucket:
                self.mask &= ~(1 << old)
        bucket = buckets[b]
        if not bucket:
            self.mask |= 1 << b
        bucket[wid] = w
        self.where[wid] = b

    def candidates(self, need: float, worst: bool) -> Iterator[Worker]:
        """Workers whose bucket can hold ``need``: most free first when ``worst``, else least free first."""
        lo = int(need * self.inv + 1e-9)
        mask = self.mask >> lo << lo
        short = need > lo * self.quantum + 1e-9  # bucket ``lo`` may hold workers a little short
        if short and not worst and mask & (1 << lo):
            mask &= ~(1 << lo)
            tail = True
        else:
            tail = False
        while mask:
            b = mask.bit_length() - 1 if worst else (mask & -mask).bit_length() - 1
            mask &= ~(1 << b)
            yield from self.buckets[b].values()  # callers stop before they change the index
        if tail:
            yield from self.buckets[lo].values()

    def check(self, workers: Iterable[Worker]) -> None:
        """Assert that exactly ``workers`` are indexed, each in the bucket of its free amount."""
        expected = {w.id: self._bucket(w.free[self.dim]) for w in workers}
        assert expected == self.where, f"index of dim {self.dim} is stale"
        mask = 0
        for b, bucket in enumerate(self.buckets):
            assert all(self.where[i] == b for i in bucket)
            if bucket:
                mask |= 1 << b
        assert mask == self.mask, "bucket mask out of date"


class Pool:
    """Workers of one capacity and one set of served kinds."""

    __slots__ = ("_dims", "cap", "index_list", "indexes", "key", "kinds", "nbuckets", "workers")

    def __init__(self, cap: Vec, kinds: frozenset[str] | None, nbuckets: int) -> None:
        self.key = (cap, kinds)
        self.cap = cap
        self.kinds = kinds
        self.nbuckets = nbuckets
        self.workers: dict[str, Worker] = {}
        self.indexes = {CPU: FreeIndex(CPU, cap[CPU], nbuckets)}
        if cap[GPU] > 0:
            self.indexes[GPU] = FreeIndex(GPU, cap[GPU], nbuckets)
        self.index_list = list(self.indexes.values())
        self._dims: dict[Vec, int] = {}

    def dim_for(self, vec: Vec) -> int:
        """Return the resource ``vec`` takes the largest share of here (the likeliest to bind).

        Cores and GPUs are always indexed; a memory index is built the first time some demand is
        memory-bound here (most workloads never pay for keeping it).
        """
        dim = self._dims.get(vec)
        if dim is None:
            shares = [(vec[d] / self.cap[d] if self.cap[d] > 0 else 0.0, -d, d) for d in (CPU, MEM, GPU)]
            dim = max(shares)[2] if any(x[0] > 0 for x in shares) else CPU
            if dim not in self.indexes:
                idx = self.indexes[dim] = FreeIndex(dim, self.cap[dim], self.nbuckets)
                for w in self.workers.values():
                    if not w.hidden:
                        idx.put(w)
                self.index_list = list(self.indexes.values())
            self._dims[vec] = dim
        return dim

    def serves(self, kind: str) -> bool:
        """Whether this pool's workers run ``kind``."""
        return self.kinds is None or kind in self.kinds


def fits(free: list[float], vec: Vec, k: int) -> bool:
    """``k`` units of ``vec`` fit in ``free``."""
    return (
        vec[0] * k <= free[0] + EPS
        and vec[1] * k <= free[1] + EPS
        and vec[2] * k <= free[2] + EPS
        and vec[3] * k <= free[3] + EPS
    )


def max_units(free: list[float] | Vec, vec: Vec) -> int:
    """How many units of ``vec`` fit in ``free`` (a large number when ``vec`` is all zero)."""
    k = 1 << 30
    for i in range(4):
        if vec[i] > 0:
            k = min(k, int((free[i] + EPS) / vec[i]))
    return k


class Ledger:
    """Capacity, free amounts and the fit index of every worker; the only place that lends resources."""

    def __init__(self, nbuckets: int = 64) -> None:
        self.nbuckets = nbuckets
        self.workers: dict[str, Worker] = {}
        self.pools: dict[tuple[Vec, frozenset[str] | None], Pool] = {}
        self.version = 0  # bumped whenever the set of pools changes (cached eligibility goes stale)
        self.used_total = [0.0, 0.0, 0.0, 0.0]
        self.cap_total = [0.0, 0.0, 0.0, 0.0]
        self.cap_version = 0  # bumped whenever a worker joins or leaves

    # --- capacity -----------------------------------------------------------------------------------
    def add_worker(self, worker_id: str, cap: Vec, kinds: frozenset[str] | None) -> Worker:
        """Book a new worker with nothing lent out."""
        if worker_id in self.workers:
            raise ValueError(f"worker {worker_id!r} is already in the ledger")
        if any(c < 0 for c in cap):
            raise ValueError(f"worker {worker_id!r} has a negative capacity {cap}")
        w = Worker(worker_id, cap, kinds)
        pool = self.pools.get((cap, kinds))
        if pool is None:
            pool = self.pools[(cap, kinds)] = Pool(cap, kinds, self.nbuckets)
            self.version += 1
        w.pool = pool
        pool.workers[worker_id] = w
        self.workers[worker_id] = w
        for idx in pool.indexes.values():
            idx.put(w)
        for i in range(4):
            self.cap_total[i] += cap[i]
        self.cap_version += 1
        return w

    def remove_worker(self, worker_id: str) -> Worker | None:
        """Forget a worker and everything lent on it; returns it (with its ``running`` records) or None."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return None
        pool = w.pool
        assert pool is not None
        for idx in pool.indexes.values():
            idx.drop(w)
        del pool.workers[worker_id]
        if not pool.workers:
            del self.pools[pool.key]
            self.version += 1
        for i in range(4):
            self.used_total[i] -= w.cap[i] - w.free[i]
            self.cap_total[i] -= w.cap[i]
        self.cap_version += 1
        return w

    # --- lending ------------------------------------------------------------------------------------
    def allocate(self, w: Worker, vec: Vec, k: int) -> None:
        """Lend ``k`` units of ``vec`` on ``w``; raises :class:`OverCommitError` if any part does not fit."""
        free, used = w.free, self.used_total
        a0, a1, a2, a3 = vec[0] * k, vec[1] * k, vec[2] * k, vec[3] * k
        if a0 > free[0] + EPS or a1 > free[1] + EPS or a2 > free[2] + EPS or a3 > free[3] + EPS:
            raise OverCommitError(f"{k} x {vec} does not fit in {tuple(free)} free on worker {w.id}")
        free[0] -= a0
        free[1] -= a1
        free[2] -= a2
        free[3] -= a3
        used[0] += a0
        used[1] += a1
        used[2] += a2
        used[3] += a3
        if not w.hidden:
            for idx in w.pool.index_list:  # type: ignore[union-attr]
                idx.update(w)

    def release(self, w: Worker, vec: Vec, k: int) -> None:
        """Take back ``k`` units of ``vec`` from ``w`` (see :meth:`settle` for float drift)."""
        free, used = w.free, self.used_total
        a0, a1, a2, a3 = vec[0] * k, vec[1] * k, vec[2] * k, vec[3] * k
        free[0] += a0
        free[1] += a1
        free[2] += a2
        free[3] += a3
        used[0] -= a0
        used[1] -= a1
        used[2] -= a2
        used[3] -= a3
        if not w.hidden:
            for idx in w.pool.index_list:  # type: ignore[union-attr]
                idx.update(w)

    def settle(self, w: Worker) -> None:
        """Mark ``w`` as lending nothing: its free amounts become exactly its capacity.

        Sums of fractional demands drift by float rounding; an idle worker is reset so the drift can
        never accumulate into a lost or an invented fraction of a core.
        """
        free, cap, used = w.free, w.cap, self.used_total
        for i in (0, 1, 2, 3):
            used[i] -= cap[i] - free[i]
            free[i] = cap[i]
        if not w.hidden:
            for idx in w.pool.index_list:  # type: ignore[union-attr]
                idx.update(w)

    def _reindex(self, w: Worker) -> None:
        assert w.pool is not None
        for idx in w.pool.index_list:
            idx.update(w)

    def hide(self, w: Worker) -> None:
        """Take ``w`` out of the fit index (a reservation: only its holder may be placed there)."""
        if not w.hidden:
            assert w.pool is not None
            for idx in w.pool.indexes.values():
                idx.drop(w)
            w.hidden = True

    def show(self, w: Worker) -> None:
        """Put a hidden worker back into the fit index."""
        if w.hidden:
            w.hidden = False
            self._reindex(w)

    # --- queries ------------------------------------------------------------------------------------
    def eligible_pools(self, kind: str, vec: Vec, min_par: int) -> list[Pool]:
        """Pools that serve ``kind`` and could ever hold ``min_par`` units of ``vec``."""
        return [p for p in self.pools.values() if p.serves(kind) and fits(list(p.cap), vec, min_par)]

    def find(
        self,
        pools: list[Pool],
        vec: Vec,
        k: int,
        worst: bool,
        probe: int,
        session: tuple[float, float] | None = None,
    ) -> Worker | None:
        """Find a worker of ``pools`` where ``k`` units of ``vec`` fit now.

        The most free one when ``worst``, else the least free that fits; at most ``probe`` candidates
        are checked per pool. ``session``: (memory it pins, its commands' memory) of a new sandbox,
        which also needs :meth:`Worker.room_for_session`.
        """
        best: Worker | None = None
        for pool in pools:
            dim = pool.dim_for(vec)
            need = vec[dim] * k
            idx = pool.indexes[dim]
            if not idx.mask >> int(need / idx.quantum + 1e-9):
                continue  # no worker of this pool has that much free
            left = probe
            for w in idx.candidates(need, worst):
                if fits(w.free, vec, k) and (session is None or w.room_for_session(*session)):
                    # Across pools, compare by cores (what elastic growth and packing are about).
                    f, g = w.free[CPU], (best.free[CPU] if best is not None else 0.0)
                    if best is None or (f > g if worst else f < g):
                        best = w
                    break
                left -= 1
                if left <= 0:
                    break
        return best

    def capacity_total(self) -> Vec:
        """Return the sum of every worker's capacity."""
        c = self.cap_total
        return (c[0], c[1], c[2], c[3])

    def validate(self, lent: dict[str, list[float]]) -> None:
        """Assert the books against ``lent`` (worker id -> what the policy believes it granted there).

        Each worker lends exactly that, nothing is negative or over capacity, and the index matches.
        """
        totals = [0.0, 0.0, 0.0, 0.0]
        for w in self.workers.values():
            used = w.used()
            expect = lent.get(w.id, [0.0, 0.0, 0.0, 0.0])
            for i in range(4):
                tol = 1e-6 * max(1.0, w.cap[i])
                assert -tol <= w.free[i] <= w.cap[i] + tol, f"worker {w.id} free {w.free} outside 0..{w.cap}"
                assert abs(used[i] - expect[i]) <= tol, (
                    f"worker {w.id} lends {used} but grants add to {expect}"
                )
                totals[i] += used[i]
        caps = [sum(w.cap[i] for w in self.workers.values()) for i in range(4)]
        for i in range(4):
            assert abs(totals[i] - self.used_total[i]) <= 1e-6 * max(1.0, abs(totals[i])), (
                "used_total drifted"
            )
            assert abs(caps[i] - self.cap_total[i]) <= 1e-6 * max(1.0, caps[i]), "cap_total drifted"
        for pool in self.pools.values():
            assert pool.workers, "empty pool kept"
            shown = [w for w in pool.workers.values() if not w.hidden]
            for idx in pool.indexes.values():
                idx.check(shown)
        assert sum(len(p.workers) for p in self.pools.values()) == len(self.workers)
