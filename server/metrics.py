"""In-process figures of the orchestrator (counts, ACT per kind, errors by reason), served by ``Stats``."""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Series:
    """Count, mean and a bounded sample of recent values (for percentiles)."""

    count: int = 0
    total: float = 0.0
    recent: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=2048))

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.recent.append(value)

    def summary(self) -> dict[str, float]:
        ordered = sorted(self.recent)

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] if ordered else 0.0

        return {
            "count": self.count,
            "mean_s": self.total / self.count if self.count else 0.0,
            "p50_s": pct(0.5),
            "p99_s": pct(0.99),
        }


@dataclass
class Metrics:
    """What the orchestrator counts. One instance per orchestrator; no global state."""

    submitted: int = 0
    finished: int = 0
    act: dict[str, _Series] = field(default_factory=lambda: collections.defaultdict(_Series))
    queued: dict[str, _Series] = field(default_factory=lambda: collections.defaultdict(_Series))
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    protocol_errors: collections.Counter[str] = field(default_factory=collections.Counter)

    def record_result(
        self, kind: str, ok: bool, error_type: str | None, act_s: float, queued_s: float
    ) -> None:
        """Count one finished action."""
        self.finished += 1
        self.act[kind].add(act_s)
        self.queued[kind].add(queued_s)
        if not ok:
            self.errors[error_type or "error"] += 1

    def snapshot(self) -> dict[str, Any]:
        """The figures as plain data."""
        return {
            "submitted": self.submitted,
            "finished": self.finished,
            "act": {kind: s.summary() for kind, s in self.act.items()},
            "queued": {kind: s.summary() for kind, s in self.queued.items()},
            "errors": dict(self.errors),
            "protocol_errors": dict(self.protocol_errors),
        }
