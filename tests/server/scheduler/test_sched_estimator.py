"""The online duration estimator: learns Amdahl's law per kind, starts from a prior, forgets slowly."""

from __future__ import annotations

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
