"""Online duration estimates per action kind: run time against parallelism, learned from completions.

Each kind's run time at parallelism ``k`` is modelled Amdahl-style as ``a + b / k`` (``a`` the serial
part, ``b`` the part that divides over ``k`` units; ``a + b`` is the time on one unit and
``b / (a + b)`` the parallel fraction). The two numbers come from a weighted least-squares fit on
``x = 1 / k`` that starts from a prior worth ``prior_weight`` observations and forgets old evidence
geometrically, so the estimate follows a workload that drifts. Set-up time on a cold start (a sandbox
to create, a model to load) is tracked beside it as a moving average.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EstimatorConfig(BaseModel):
    """How the duration estimator starts and how fast it forgets."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prior_s: float = Field(1.0, gt=0, description="run time on one unit assumed for the first kind ever seen")
    prior_parallel: float = Field(0.5, ge=0, le=1, description="parallel fraction assumed for a new kind")
    prior_weight: float = Field(1.0, gt=0, description="how many observations the prior counts for")
    forget: float = Field(
        0.995, gt=0, le=1, description="weight kept by old evidence at each new observation"
    )
    setup_prior_s: float = Field(
        0.0, ge=0, description="cold set-up time assumed before any is observed (0: no warm state until seen)"
    )
    setup_alpha: float = Field(0.2, gt=0, le=1, description="weight of each new set-up observation")


class KindModel:
    """The running fit of one kind: decayed sums of ``x = 1/k`` and durations ``y``, plus its prior.

    The prior fixes the *shape* (the parallel fraction), not the level: at each refit it adds
    ``prior_weight`` pseudo-observations on the line of the prior's parallel fraction through the
    data's own mean, so a kind only ever seen at one parallelism keeps the prior's speed-up, and data
    at several parallelisms soon outweigh it.
    """

    __slots__ = ("a", "b", "multi", "n", "observations", "p0", "setup_s", "sx", "sxx", "sxy", "sy", "w0")

    def __init__(self, t1: float, parallel: float, weight: float, setup_s: float) -> None:
        self.n = self.sx = self.sxx = self.sy = self.sxy = 0.0
        self.p0, self.w0 = parallel, weight
        self.a = t1 * (1 - parallel)
        self.b = t1 * parallel
        self.observations = 0
        self.multi = 0  # observations at k > 1 (the ones that show the speed-up)
        self.setup_s = setup_s

    def observe(self, k: int, duration_s: float, forget: float) -> None:
        """Add one completion at parallelism ``k`` and refit."""
        x = 1.0 / k
        self.n = self.n * forget + 1.0
        self.sx = self.sx * forget + x
        self.sxx = self.sxx * forget + x * x
        self.sy = self.sy * forget + duration_s
        self.sxy = self.sxy * forget + x * duration_s
        self.observations += 1
        if k > 1:
            self.multi += 1
        self._fit()

    def _fit(self) -> None:
        p0, half = self.p0, self.w0 / 2
        level = self.sy / self.n
        t = level / ((1 - p0) + p0 * (self.sx / self.n))  # the prior's line through the data's mean
        y1, y2 = t, t * ((1 - p0) + p0 / 2)  # its pseudo-observations at k=1 and k=2
        n = self.n + 2 * half
        sx = self.sx + half * 1.5
        sxx = self.sxx + half * 1.25
        sy = self.sy + half * (y1 + y2)
        sxy = self.sxy + half * (y1 + 0.5 * y2)
        det = n * sxx - sx * sx
        b = (n * sxy - sx * sy) / det if det > 1e-12 else 0.0
        a = (sy - b * sx) / n
        if b < 0:  # more units made it slower: treat it as serial
            a, b = sy / n, 0.0
        elif a < 0:  # faster than linear speed-up is noise: no serial part
            a, b = 0.0, sxy / sxx
        self.a, self.b = a, b

    def run_s(self, k: int) -> float:
        """Estimate the run time at parallelism ``k``."""
        return self.a + self.b / k


class DurationEstimator:
    """Per-kind :class:`KindModel` s, each created on first sight with a prior borrowed from the others."""

    def __init__(self, config: EstimatorConfig | None = None) -> None:
        self.config = config or EstimatorConfig()
        self._models: dict[str, KindModel] = {}

    def model(self, kind: str) -> KindModel:
        """Return the model of ``kind`` (created with the prior if new)."""
        m = self._models.get(kind)
        if m is None:
            cfg = self.config
            # A new kind most likely looks like the typical kind already seen (a hierarchical prior).
            known = sorted(x.a + x.b for x in self._models.values() if x.observations)
            t1 = known[len(known) // 2] if known else cfg.prior_s
            m = self._models[kind] = KindModel(t1, cfg.prior_parallel, cfg.prior_weight, cfg.setup_prior_s)
        return m

    def estimate(self, kind: str, k: int = 1) -> float:
        """Estimated run time (seconds) of ``kind`` at parallelism ``k``."""
        m = self._models.get(kind) or self.model(kind)
        return m.a + m.b / k

    def setup(self, kind: str) -> float:
        """Estimated cold set-up time (seconds) of ``kind``."""
        return (self._models.get(kind) or self.model(kind)).setup_s

    def observe(self, kind: str, k: int, duration_s: float) -> None:
        """Learn from one completion of ``kind`` that ran ``duration_s`` seconds at parallelism ``k``."""
        if k < 1 or not duration_s >= 0:
            raise ValueError(f"bad observation of {kind!r}: k={k}, duration_s={duration_s}")
        (self._models.get(kind) or self.model(kind)).observe(k, duration_s, self.config.forget)

    def observe_setup(self, kind: str, setup_s: float) -> None:
        """Learn from one cold start of ``kind`` whose set-up took ``setup_s`` seconds."""
        m = self._models.get(kind) or self.model(kind)
        alpha = self.config.setup_alpha
        m.setup_s = (1 - alpha) * m.setup_s + alpha * max(0.0, setup_s)

    def params(self, kind: str) -> tuple[float, float]:
        """``(time on one unit, parallel fraction)`` of ``kind`` as currently estimated."""
        m = self._models.get(kind) or self.model(kind)
        t1 = m.a + m.b
        return t1, (m.b / t1 if t1 > 0 else 0.0)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Every kind's estimate, for stats and reports."""
        out: dict[str, dict[str, float]] = {}
        for kind, m in self._models.items():
            t1, p = self.params(kind)
            out[kind] = {
                "t1_s": t1,
                "parallel": p,
                "setup_s": m.setup_s,
                "observations": float(m.observations),
            }
        return out
