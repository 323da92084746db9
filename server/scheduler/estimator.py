"""Online duration estimates per action kind: run time against parallelism, learned from completions.

Each kind's run time at parallelism ``k`` is modelled Amdahl-style as ``t1 * ((1 - p) + p / k)``:
``t1`` the time on one unit, ``p`` the parallel fraction. Run times are long-tailed and their noise
is multiplicative, so the fit is done on log durations: for each ``p`` of a grid the best ``log t1``
is the mean of ``log y - log g_p(k)``, and the ``p`` with the least squared residual (plus a small
penalty pulling it to the prior's ``p``) wins. The evidence is kept as decayed per-``k`` sums, so
old observations fade geometrically and a drifting workload is followed. The estimate returned is the
mean (not the median) of the fitted log-normal, which is what shortest-expected-first needs. A kind
only ever seen at one ``k`` keeps the prior's ``p``. Set-up time on a cold start (a sandbox to
create, a model to load) is tracked beside it as a moving average.
"""

from __future__ import annotations

import math
from collections.abc import Callable

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


_PHI = (math.sqrt(5) - 1) / 2


def _sse(rows: list[tuple[int, float, float, float]], n: float, s2: float, p: float) -> tuple[float, float]:
    """Residual sum of squares of log durations, and the best mean log ``t1``, for parallel fraction ``p``."""
    sl = sq = 0.0
    for k, w, s1, _ in rows:
        lg = math.log((1 - p) + p / k)
        sl += s1 - w * lg
        sq += lg * (w * lg - 2 * s1)
    mu = sl / n
    return max(0.0, s2 + sq - n * mu * mu), mu


def _golden(f: Callable[[float], float], tol: float = 0.005) -> float:
    """The minimiser of ``f`` on [0, 1] (golden-section search; the ends are tried too)."""
    lo, hi = 0.0, 1.0
    c, d = hi - _PHI * (hi - lo), lo + _PHI * (hi - lo)
    fc, fd = f(c), f(d)
    while hi - lo > tol:
        if fc < fd:
            hi, d, fd = d, c, fc
            c = hi - _PHI * (hi - lo)
            fc = f(c)
        else:
            lo, c, fc = c, d, fd
            d = lo + _PHI * (hi - lo)
            fd = f(d)
    best = (lo + hi) / 2
    return min((0.0, 1.0, best), key=f)


_FLOOR_S = 1e-6  # durations below this are read as this (log of zero)


class KindModel:
    """The running fit of one kind: decayed per-parallelism sums of log durations, and its prior.

    ``a`` (serial seconds) and ``b`` (parallel seconds on one unit) are the current fit, so that the
    estimate at ``k`` is ``a + b / k``.
    """

    __slots__ = (
        "_dirty",
        "_fitted_at",
        "_stats",
        "_t",
        "_var",
        "a",
        "b",
        "multi",
        "n",
        "nm",
        "observations",
        "p0",
        "setup_s",
        "w0",
    )

    def __init__(self, t1: float, parallel: float, weight: float, setup_s: float) -> None:
        self.p0, self.w0 = parallel, weight
        self.a = t1 * (1 - parallel)
        self.b = t1 * parallel
        self.observations = 0
        self.multi = 0  # observations at k > 1 (the ones that show the speed-up)
        self.n = 0.0  # decayed weight of all evidence
        self.nm = 0.0  # the same for k > 1: how much of the current evidence shows a speed-up
        self.setup_s = setup_s
        self._stats: dict[int, list[float]] = {}  # k -> [weight, sum log y, sum (log y)^2, at observation]
        self._t = 0
        self._fitted_at = 0
        self._dirty = False
        self._var = 0.5  # residual variance of log durations at the last fit

    def observe(self, k: int, duration_s: float, forget: float) -> None:
        """Add one completion at parallelism ``k`` (refits lazily, see :meth:`refit`)."""
        self._t = t = self._t + 1
        ly = math.log(duration_s if duration_s > _FLOOR_S else _FLOOR_S)
        st = self._stats.get(k)
        if st is None:
            st = self._stats[k] = [0.0, 0.0, 0.0, t]
        else:
            d = forget if st[3] == t - 1 else forget ** (t - st[3])
            st[0] *= d
            st[1] *= d
            st[2] *= d
            st[3] = t
        st[0] += 1.0
        st[1] += ly
        st[2] += ly * ly
        self.n = self.n * forget + 1.0
        self.nm *= forget
        self.observations += 1
        if k > 1:
            self.multi += 1
            self.nm += 1.0
        self._dirty = True
        # Refit at once while evidence is thin, then about every eighth observation, at most every 64th.
        if self.observations - self._fitted_at >= min(64, 1 + self.observations // 8):
            self.refit(forget)

    def refit(self, forget: float) -> None:
        """Fit ``t1`` and ``p`` to the evidence (see the module docstring)."""
        if not self._dirty:
            return
        self._dirty = False
        self._fitted_at = self.observations
        rows = []
        for k, (w, s1, s2, at) in self._stats.items():
            d = forget ** (self._t - at)
            rows.append((k, w * d, s1 * d, s2 * d))
        n = sum(r[1] for r in rows)
        if n <= 0:
            return
        s1 = sum(r[2] for r in rows)
        s2 = sum(r[3] for r in rows)
        if len(rows) == 1 and rows[0][0] == 1:
            # Only ever seen on one unit: the speed-up is unidentified and stays the prior's.
            p, mu = self.p0, s1 / n
            var = max(0.0, s2 / n - mu * mu)
        else:
            # The prior on p (sd 0.25) weighs like ``w0`` observations with the data's own noise, so it
            # decides only what the data cannot and fades as evidence accumulates.
            strength = self.w0 * (self._var + 1e-9) / 0.0625
            p = _golden(lambda q: _sse(rows, n, s2, q)[0] + strength * (q - self.p0) ** 2)
            sse, mu = _sse(rows, n, s2, p)
            var = sse / n
        self._var = var
        t1 = math.exp(mu + var / 2)  # the log-normal's mean
        self.a, self.b = t1 * (1 - p), t1 * p

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
        if m is not None:
            return m
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
        m.refit(self.config.forget)
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
