"""Task-isolated pools: a static quota of the pool per env kind, FCFS inside each (a baseline).

Each env id listed in ``quotas`` may hold at most its fraction of the pool's total capacity, per
resource type; env ids not listed share what the listed ones leave. With no quotas at all it is FCFS
on one shared pool. Inside a quota actions run oldest first, each at ``min_par`` units.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tangram_env.server.scheduler.core import Act, ActionLevelScheduler
from tangram_env.server.scheduler.events import Resources
from tangram_env.server.scheduler.fcfs import FCFS_POLICY
from tangram_env.server.scheduler.ledger import EPS, Vec, vec_of
from tangram_env.server.scheduler.policy import PolicyConfig

REST = "*"  # the share of env ids without a quota of their own


def _fractions(q: Resources | float) -> Vec:
    vec = (float(q),) * 4 if isinstance(q, int | float) else vec_of(q)
    if any(not 0 <= x <= 1 for x in vec):
        raise ValueError(f"a quota is a fraction of the pool (0..1 per resource), got {q}")
    return (vec[0], vec[1], vec[2], vec[3])


class TaskIsolatedScheduler(ActionLevelScheduler):
    """FCFS within static per-env quotas.

    ``quotas`` maps env id -> fraction of the pool: one number for every resource type, or a
    :class:`Resources` of fractions per type.
    """

    name = "task_isolated"

    def __init__(
        self,
        quotas: Mapping[str, Resources | float] | None = None,
        config: PolicyConfig | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__(config, **{**FCFS_POLICY, **overrides})
        self.quotas: dict[str, Vec] = {env: _fractions(q) for env, q in (quotas or {}).items()}
        if self.quotas:
            rest = tuple(1.0 - sum(q[i] for q in self.quotas.values()) for i in range(4))
            if any(x < -1e-9 for x in rest):
                raise ValueError(f"quotas add up to more than the whole pool: {self.quotas}")
            self.quotas[REST] = (max(0.0, rest[0]), max(0.0, rest[1]), max(0.0, rest[2]), max(0.0, rest[3]))
        self.usage: dict[str, list[float]] = {}
        self._limits: dict[str, list[float]] = {}
        self._limits_version = -1

    def _partition(self, act: Act) -> str:
        if not self.quotas:
            return ""
        return act.ev.env_id if act.ev.env_id in self.quotas else REST

    def _limit(self, part: str) -> list[float]:
        if self._limits_version != self.ledger.cap_version:  # the pool changed: quotas follow it
            cap = self.ledger.cap_total
            self._limits = {p: [q[i] * cap[i] for i in range(4)] for p, q in self.quotas.items()}
            self._limits_version = self.ledger.cap_version
        return self._limits[part]

    def _refusal(self, act: Act) -> str | None:
        if not self.quotas or not self.ledger.workers:
            return None
        part = self._partition(act)
        limit = self._limit(part)
        k = act.ev.min_par
        if any(act.vec[i] * k > limit[i] + EPS for i in range(4)):
            return f"its demand {act.ev.demand} x {k} exceeds the quota of {part!r} ({limit})"
        return None

    def _admissible(self, act: Act, k: int) -> bool:
        if not super()._admissible(act, k):  # an API quota (issue 21): the base checks it
            return False
        if not self.quotas:
            return True
        part = self._partition(act)
        used = self.usage.get(part)
        if used is None:
            used = self.usage[part] = [0.0, 0.0, 0.0, 0.0]
        limit = self._limit(part)
        v = act.vec
        return (
            (v[0] <= 0 or used[0] + v[0] * k <= limit[0] + EPS)
            and (v[1] <= 0 or used[1] + v[1] * k <= limit[1] + EPS)
            and (v[2] <= 0 or used[2] + v[2] * k <= limit[2] + EPS)
            and (v[3] <= 0 or used[3] + v[3] * k <= limit[3] + EPS)
        )

    def _granted(self, act: Act, k: int) -> None:
        super()._granted(act, k)
        if self.quotas:
            used = self.usage.setdefault(self._partition(act), [0.0, 0.0, 0.0, 0.0])
            for i in range(4):
                used[i] += act.vec[i] * k

    def _released(self, act: Act) -> None:
        super()._released(act)
        if self.quotas and act.leader is None:  # a batch's rider took nothing from the quota
            used = self.usage[self._partition(act)]
            for i in range(4):
                used[i] = max(0.0, used[i] - act.vec[i] * act.k)

    def validate_state(self) -> None:
        """Check the base invariants, plus: each share's usage is what its running actions hold."""
        super().validate_state()
        if not self.quotas:
            return
        expect: dict[str, list[float]] = {}
        for w in self.ledger.workers.values():
            for act in w.running.values():
                if act.leader is not None:
                    continue
                acc = expect.setdefault(self._partition(act), [0.0, 0.0, 0.0, 0.0])
                for i in range(4):
                    acc[i] += act.vec[i] * act.k
        for part, used in self.usage.items():
            want = expect.get(part, [0.0, 0.0, 0.0, 0.0])
            assert all(abs(used[i] - want[i]) <= 1e-6 * max(1.0, want[i]) for i in range(4)), (
                f"usage of {part}"
            )
