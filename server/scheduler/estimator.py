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

Completions alone are a biased sample while actions run: in a burst the first to end are the short
draws, and a kind whose actions at one ``k`` started later than those at another looks faster there
(the parallel fraction of a test suite fitted 0.0 against a truth of 0.93). So evidence is weighed by
when each action *started* (the decay clock ticks at starts, and the window outlasts the actions in
flight), and the actions still running count as right-censored: each is known to last longer than it
has run so far, and enters the fit with the expected log duration (and its square) beyond that under
the current fit: one EM step per pass, a few passes per refit, each refit going on from the last fit.
Running actions that have run less than the fit's 2nd percentile say next to nothing and are
skipped; above ``_SAMPLE`` running, an even sample of them stands for all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import islice

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
_SPAN = 4  # the evidence window spans at least this many starts per action in flight
_SAMPLE = 128  # running actions looked at per refit, at most (an even sample in start order)
_EM_PASSES = 8  # at most, per refit (it stops once the fit moves less than 0.002)
_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1 / math.sqrt(2 * math.pi)


def _beyond(m: float, sd: float, lc: float) -> tuple[float, float] | None:
    """``E[z]`` and ``E[z^2]`` of ``z ~ N(m, sd^2)`` given ``z > lc`` (None: ``lc`` is too low to matter)."""
    alpha = (lc - m) / sd
    if alpha < -2.0:
        return None
    if alpha > 30.0:
        lam = alpha + 1 / alpha  # the inverse Mills ratio's asymptote (erfc underflows further out)
    else:
        lam = _INV_SQRT_2PI * math.exp(-0.5 * alpha * alpha) / (0.5 * math.erfc(alpha / _SQRT2))
    ez = m + sd * lam
    return ez, m * m + 2 * m * sd * lam + sd * sd * (1 + alpha * lam)


class KindModel:
    """The running fit of one kind: decayed per-parallelism sums of log durations, and its prior.

    ``a`` (serial seconds) and ``b`` (parallel seconds on one unit) are the current fit, so that the
    estimate at ``k`` is ``a + b / k``.
    """

    __slots__ = (
        "_clock",
        "_dirty",
        "_fitted_at",
        "_now",
        "_running",
        "_stats",
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
        self._stats: dict[int, list[float]] = {}  # k -> [weight, sum log y, sum (log y)^2, at clock]
        self._clock = 0.0  # decay clock, in ``forget`` steps: one per start while few actions run
        self._running: dict[str, tuple[int, float, float]] = {}  # key -> (k, clock at start, run began at)
        self._now = 0.0  # the latest time an event of this kind was seen at
        self._fitted_at = 0
        self._dirty = False
        self._var = 0.5  # residual variance of log durations at the last fit

    def _tick(self, forget: float) -> float:
        """Advance the decay clock for one start; return the clock.

        One step per start, unless more than ``1 / (1 - forget) / _SPAN`` actions are in flight: then
        less, so that the window still holds the starts of actions that have finished (else it would
        hold only the running and the short draws among them).
        """
        n = _SPAN * len(self._running)
        self._clock += 1.0 if n * (1.0 - forget) <= 1.0 else 1.0 / (n * (1.0 - forget))
        return self._clock

    def start(self, key: str, k: int, run_from: float, now: float, forget: float) -> None:
        """Note that action ``key`` started at parallelism ``k``; its run begins at ``run_from``."""
        self._now = max(self._now, now)
        self._running[key] = (k, self._tick(forget), run_from)
        self._dirty = True

    def abandon(self, key: str) -> None:
        """Forget running action ``key`` without evidence (it failed or was requeued)."""
        self._running.pop(key, None)

    def observe(
        self, k: int, duration_s: float, forget: float, key: str | None = None, now: float | None = None
    ) -> None:
        """Add one completion at parallelism ``k`` (refits lazily, see :meth:`refit`).

        ``key`` names the action if its start was noted: it is then weighed by when it started, and no
        longer counts as running. Without one it counts as started and finished now.
        """
        if now is not None and now > self._now:
            self._now = now
        run = self._running.pop(key, None) if key is not None else None
        clock = self._tick(forget) if run is None else self._clock
        w = 1.0 if run is None else forget ** (clock - run[1])
        ly = math.log(duration_s if duration_s > _FLOOR_S else _FLOOR_S)
        st = self._stats.get(k)
        if st is None:
            st = self._stats[k] = [0.0, 0.0, 0.0, clock]
        elif st[3] != clock:
            d = forget ** (clock - st[3])
            st[0] *= d
            st[1] *= d
            st[2] *= d
            st[3] = clock
        st[0] += w
        st[1] += w * ly
        st[2] += w * ly * ly
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
        """Fit ``t1`` and ``p`` to the evidence, running actions included (see the module docstring)."""
        if not self._dirty:
            return
        self._dirty = False
        self._fitted_at = self.observations
        done: dict[int, tuple[float, float, float]] = {}
        for k, (w, s1, s2, at) in self._stats.items():
            d = forget ** (self._clock - at)
            done[k] = (w * d, s1 * d, s2 * d)
        if sum(r[0] for r in done.values()) <= 0:
            return
        running = self._censored(forget)
        if running and self.observations > 1:  # EM from the last fit: its passes add up over refits
            t1 = self.a + self.b
            p, var = self.b / t1, self._var
            mu = math.log(t1) - var / 2
        else:
            p, mu, var = self._fit(done)
        for _ in range(_EM_PASSES if running else 0):
            sd = math.sqrt(var) if var > 0.0025 else 0.05
            rows = dict(done)
            for k, w, lc in running:
                m = mu + math.log((1 - p) + p / k)
                moments = _beyond(m, sd, lc)
                if moments is not None:
                    r = rows.get(k, (0.0, 0.0, 0.0))
                    rows[k] = (r[0] + w, r[1] + w * moments[0], r[2] + w * moments[1])
            p2, mu2, var = self._fit(rows)
            converged = abs(p2 - p) < 0.002 and abs(mu2 - mu) < 0.002
            p, mu = p2, mu2
            if converged:
                break
        self._var = var
        t1 = math.exp(mu + var / 2)  # the log-normal's mean
        self.a, self.b = t1 * (1 - p), t1 * p

    def _censored(self, forget: float) -> list[tuple[int, float, float]]:
        """``(k, weight, log of time run so far)`` of the running actions (an even sample, reweighted)."""
        run = self._running
        if not run:
            return []
        step = -(-len(run) // _SAMPLE)
        now, clock = self._now, self._clock
        out = []
        for k, at, began in islice(run.values(), 0, None, step):
            if now > began:
                out.append((k, step * forget ** (clock - at), math.log(now - began)))
        return out

    def _fit(self, by_k: dict[int, tuple[float, float, float]]) -> tuple[float, float, float]:
        """``(p, mean log t1, residual variance)`` that fit per-``k`` sums ``(weight, sum z, sum z^2)``."""
        rows = [(k, w, s1, s2) for k, (w, s1, s2) in by_k.items() if w > 0]
        n = sum(r[1] for r in rows)
        s1 = sum(r[2] for r in rows)
        s2 = sum(r[3] for r in rows)
        if len(rows) == 1 and rows[0][0] == 1:
            # Only ever seen on one unit: the speed-up is unidentified and stays the prior's.
            mu = s1 / n
            return self.p0, mu, max(0.0, s2 / n - mu * mu)
        # The prior on p (sd 0.25) weighs like ``w0`` observations with the data's own noise, so it
        # decides only what the data cannot and fades as evidence accumulates.
        strength = self.w0 * (self._var + 1e-9) / 0.0625
        p = _golden(lambda q: _sse(rows, n, s2, q)[0] + strength * (q - self.p0) ** 2)
        sse, mu = _sse(rows, n, s2, p)
        return p, mu, sse / n

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

    def start(self, kind: str, key: str, k: int, run_from: float, now: float) -> None:
        """Note that action ``key`` of ``kind`` started on ``k`` units, its run beginning at ``run_from``.

        Until it is observed (or abandoned) it counts as a censored observation (see the module docstring).
        """
        (self._models.get(kind) or self.model(kind)).start(key, k, run_from, now, self.config.forget)

    def observe(
        self, kind: str, k: int, duration_s: float, key: str | None = None, now: float | None = None
    ) -> None:
        """Learn from one completion of ``kind`` that ran ``duration_s`` seconds at parallelism ``k``.

        ``key`` names the action if its start was noted (:meth:`start`), ``now`` is the time.
        """
        if k < 1 or not duration_s >= 0:
            raise ValueError(f"bad observation of {kind!r}: k={k}, duration_s={duration_s}")
        (self._models.get(kind) or self.model(kind)).observe(k, duration_s, self.config.forget, key, now)

    def abandon(self, kind: str, key: str) -> None:
        """Forget running action ``key`` of ``kind`` without evidence (it failed, or was requeued)."""
        m = self._models.get(kind)
        if m is not None:
            m.abandon(key)

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
