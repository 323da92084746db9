"""The online duration estimator: learns Amdahl's law per kind, starts from a prior, forgets slowly."""

from __future__ import annotations

import math
import random

import pytest

from tangram_env.server.scheduler.estimator import DurationEstimator, EstimatorConfig


def test_prior_before_any_data() -> None:
    est = DurationEstimator(EstimatorConfig(prior_s=2.0, prior_parallel=0.5))
    assert est.estimate("new") == pytest.approx(2.0)
    assert est.estimate("new", 2) == pytest.approx(1.5)
    assert est.setup("new") == 0.0


def test_learns_run_time_and_parallel_fraction() -> None:
    rng = random.Random(1)
    est = DurationEstimator()
    t1, p = 40.0, 0.9
    for _ in range(400):
        k = rng.choice([1, 2, 4, 8, 16])
        est.observe("tests", k, t1 * ((1 - p) + p / k) * rng.lognormvariate(0, 0.2))
    got_t1, got_p = est.params("tests")
    assert got_t1 == pytest.approx(t1 * 1.02, rel=0.1)  # the noise's mean is exp(0.02)
    assert got_p == pytest.approx(p, abs=0.05)
    assert est.estimate("tests", 8) == pytest.approx(t1 * 1.02 * (0.1 + 0.9 / 8), rel=0.15)


def test_learns_that_a_kind_is_serial() -> None:
    est = DurationEstimator()
    for k in [1, 2, 4, 8] * 20:
        est.observe("serial", k, 5.0)
    t1, p = est.params("serial")
    assert t1 == pytest.approx(5.0, rel=0.05)
    assert p < 0.05


def test_a_kind_seen_at_one_parallelism_keeps_the_prior_shape() -> None:
    est = DurationEstimator(EstimatorConfig(prior_parallel=0.5))
    for _ in range(50):
        est.observe("rigid", 1, 10.0)
    t1, p = est.params("rigid")
    assert t1 == pytest.approx(10.0, rel=0.02)
    assert p == pytest.approx(0.5, abs=0.01)


def test_new_kinds_borrow_the_typical_known_kind() -> None:
    est = DurationEstimator()
    for kind, t in (("a", 1.0), ("b", 3.0), ("c", 100.0)):
        for _ in range(20):
            est.observe(kind, 1, t)
    assert est.estimate("fresh") == pytest.approx(3.0, rel=0.05)  # the median, not the mean


def test_tracks_a_drifting_workload() -> None:
    est = DurationEstimator(EstimatorConfig(forget=0.95))
    for _ in range(100):
        est.observe("x", 1, 1.0)
    for _ in range(100):
        est.observe("x", 1, 10.0)
    assert est.estimate("x") == pytest.approx(10.0, rel=0.05)


def test_setup_time_is_a_moving_average() -> None:
    est = DurationEstimator(EstimatorConfig(setup_alpha=0.5))
    est.observe_setup("score", 8.0)
    est.observe_setup("score", 8.0)
    assert est.setup("score") == pytest.approx(6.0)


def test_bad_observations_are_refused() -> None:
    est = DurationEstimator()
    with pytest.raises(ValueError, match="bad observation"):
        est.observe("x", 0, 1.0)
    with pytest.raises(ValueError):
        est.observe("x", 1, float("nan"))
    assert est.snapshot() == {}  # nothing was learned from them


def _burst(est: DurationEstimator, noted: bool, until: float) -> None:
    """A test suite (t1 100 s, 90% parallel): 300 runs start on 2 units at 0 s, then 300 on one unit at
    40 s; completions are fed up to ``until``, the first being the short draws. ``noted``: the starts
    are told to the estimator (else it sees completions only)."""
    rng = random.Random(7)
    events = []
    for i in range(600):
        k, t0 = (2, 0.0) if i < 300 else (1, 40.0)
        d = 100 * (0.1 + 0.9 / k) * rng.lognormvariate(0, 0.6)
        events += [(t0, 0, i, k, d), (t0 + d, 1, i, k, d)]
    for t, end, i, k, d in sorted(events):
        if t > until:
            break
        if end:
            est.observe("suite", k, d, key=f"a{i}" if noted else None, now=t)
        elif noted:
            est.start("suite", f"a{i}", k, t, t)


def test_short_draws_finishing_first_do_not_pull_the_parallel_fraction() -> None:
    # At 110 s most one-unit runs are still going and those done are the short draws: counted alone
    # they look as fast as the two-unit runs (a serial kind); the running ones say otherwise.
    blind = DurationEstimator()
    _burst(blind, noted=False, until=110.0)
    assert blind.params("suite")[1] < 0.5  # the bias this guards against
    est = DurationEstimator()
    _burst(est, noted=True, until=110.0)
    t1, p = est.params("suite")
    assert p == pytest.approx(0.9, abs=0.1)
    assert t1 == pytest.approx(100 * math.exp(0.18), rel=0.3)  # the log-normal's mean
    est = DurationEstimator()
    _burst(est, noted=True, until=1e9)  # every run done: nothing is censored any more
    assert est.params("suite")[1] == pytest.approx(0.9, abs=0.06)


def test_a_running_action_past_its_estimate_raises_it() -> None:
    est = DurationEstimator()
    est.observe("x", 1, 1.0, now=0.0)
    for i in range(20):
        est.start("x", f"a{i}", 1, 1.0, 1.0)
    est.observe("x", 1, 1.0, now=60.0)  # 20 actions have now run 59 s each
    assert est.estimate("x") > 20.0
    for i in range(20):
        est.abandon("x", f"a{i}")  # failed: no evidence either way
    est.observe("x", 1, 1.0, now=61.0)
    assert est.estimate("x") < 2.0
