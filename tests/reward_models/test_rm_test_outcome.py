"""The ``test_outcome`` reward: pass fraction or resolved, from any of the report shapes."""

from __future__ import annotations

import pytest

from tangram_env.kinds import kind_registry
from tangram_env.reward_models import score_reports
from tangram_env.server.gpu import GpuRunner, run_grants, score_grant


@pytest.mark.parametrize(
    ("report", "reward"),
    [
        ({"passed": 3, "total": 4}, 0.75),
        ({"passed": 3, "failed": 1, "errors": 2}, 0.5),
        ({"passed": 0, "total": 0}, 0.0),
        ({"outcomes": ["passed", "failed", True, False]}, 0.5),
        ({"outcomes": []}, 0.0),
        ({"passed": 3, "total": 4, "mode": "resolved"}, 0.0),
        ({"passed": 4, "total": 4, "mode": "resolved"}, 1.0),
        ({"passed": 0, "total": 0, "mode": "resolved"}, 0.0),
        ({"resolved": True}, 1.0),
        ({"passed": 1, "total": 4, "resolved": True, "mode": "resolved"}, 1.0),
        ({"passed": 2, "total": 4, "stdout": "kept out of the reward", "task_id": "t1"}, 0.5),
    ],
)
def test_rewards_of_report_shapes(report, reward):
    assert score_reports([report]) == [reward]


@pytest.mark.parametrize(
    ("report", "reason"),
    [
        ({"passed": 5, "total": 4}, "passed (5) > total (4)"),
        ({"total": 4}, "needs 'passed'"),
        ({"passed": -1, "total": 4}, "greater than or equal to 0"),
        ("all good", "item 0 is not a test report"),
        # Each of these read as every test passed (the misspelt or foreign count was dropped) or was
        # coerced into a reward.
        ({"passed": 3, "totl": 10}, "needs 'total', 'failed' or 'errors'"),
        ({"passed": 3, "failures": 7}, "needs 'total', 'failed' or 'errors'"),
        ({"passed": 3, "tests": 10}, "needs 'total', 'failed' or 'errors'"),
        ({"passed": 3}, "needs 'total', 'failed' or 'errors'"),
        ({"resolved": "yes"}, "resolved: Input should be a valid boolean"),
        ({"passed": "3", "total": "4"}, "passed: Input should be a valid integer"),
        ({"passed": True, "total": True}, "passed: Input should be a valid integer"),
        ({"outcomes": ["passed"], "passed": 0, "total": 10}, "'outcomes' and the counts disagree"),
    ],
)
def test_malformed_reports_are_refused_with_the_reason(report, reason):
    with pytest.raises(ValueError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        score_reports([report])


def test_registered_as_a_host_lane_reward_model():
    spec = kind_registry.get("test_outcome")
    assert spec.role == "reward_model" and spec.demand.gpu == 0.0
    assert spec.options["max_batch"] == 256


def test_scored_by_the_gpu_runner_without_a_device():
    with GpuRunner(devices=["cpu"]) as runner:
        ok, bad = run_grants(
            runner,
            [
                score_grant(
                    "test_outcome", [{"passed": 1, "total": 2}, {"passed": 2, "total": 2, "mode": "resolved"}]
                ),
                score_grant("test_outcome", [{"passed": 9, "total": 2}]),
            ],
        )
        assert ok.ok and ok.value == [0.5, 1.0]
        assert bad.error_type == "model_error" and "passed (9) > total (2)" in bad.message
        host = next(d for d in runner.stats()["devices"] if d["device"] == "host:test_outcome")
        assert host["models"] == ["test_outcome"]
