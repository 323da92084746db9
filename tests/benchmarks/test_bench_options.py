"""The smaller benchmarks measure what their figures are named after, and refuse bad options cleanly."""

from __future__ import annotations

import io
import itertools
from typing import Any

import pytest

import benchmarks.act_real as act_real
import benchmarks.scheduler_cost as scheduler_cost
from benchmarks.reward import SKEW, EmulatedAccelerator, StaticLayout, static_layouts
from tangram_env.kinds import KindRegistry, reward_model
from tangram_env.server.gpu import GpuRunner, run_grants, score_grant


def test_every_static_layout_the_budget_allows_is_tried_once() -> None:
    layouts, total = static_layouts(SKEW, n_dev=2, per_device=2)
    assert total == len(layouts) == 6
    canon = set()
    for lay in layouts:
        assert set(lay) == set(SKEW) and all(lay.values())  # every model somewhere
        assert all(sum(d in devs for devs in lay.values()) <= 2 for d in (0, 1))  # within the budget
        # One per relabelling of the devices.
        key = min(
            tuple(tuple(sorted(p[d] for d in lay[m])) for m in SKEW) for p in itertools.permutations((0, 1))
        )
        assert key not in canon
        canon.add(key)
    # The hot model on both devices is among them (the server's StaticPolicy cannot express it).
    assert {"rm_hot": (0, 1), "rm_warm": (0,), "rm_cold": (1,)} in layouts
    assert static_layouts(SKEW, n_dev=1, per_device=2) == ([], 0)  # three models never fit on one


def test_a_static_layout_loads_each_model_where_it_says_and_nowhere_else() -> None:
    reg = KindRegistry()
    fast = {"overhead_s": 0.001, "per_item_s": 0.0001, "load_s": 0.001}
    for name in SKEW:
        reward_model(name=name, gpu=0.05, max_batch=8, max_wait_ms=1.0, registry=reg)(
            type(name, (EmulatedAccelerator,), fast)
        )
    layout = {"rm_hot": (0, 1), "rm_warm": (0,), "rm_cold": (1,)}
    with GpuRunner(devices=["cpu", "cpu"], mem_budget_mb=250, registry=reg, policy=StaticLayout(layout)) as r:
        for _ in range(20):
            grants = [score_grant(m, list(range(4))) for m in SKEW for _ in range(3)]
            assert all(res.ok for res in run_grants(r, grants, timeout_s=60))
        models = r.stats()["models"]
        assert isinstance(models, dict)
    assert models["rm_hot"]["replicas"] == 2
    assert models["rm_warm"]["replicas"] == models["rm_cold"]["replicas"] == 1
    assert models["rm_warm"]["loaded_on"] != models["rm_cold"]["loaded_on"]
    assert sum(m["evictions"] for m in models.values()) == 0


def test_the_decision_cost_is_timed_at_the_queue_length_it_is_labelled_with() -> None:
    row = scheduler_cost.measure("elastic", 1_000, workers=100, calls=200, repeats=1)
    assert row["pending_min"] >= 1_000  # topped up before every timed pair (GPU batches drain it)
    assert row["pending_max"] <= 1_100


def test_the_decision_cost_labels_follow_the_sizes_measured() -> None:
    res = scheduler_cost.run(sizes=(500, 2_000), workers=100, calls=50)
    assert res["decision_us_at_10k"] is None and res["within_budget"] is None
    out = io.StringIO()
    scheduler_cost.print_table(res, file=out)
    text = out.getvalue()
    assert "growth 500->2k" in text and "not measured" in text and "1k->100k" not in text
    one = scheduler_cost.run(sizes=(500,), workers=100, calls=50)
    assert one["growth"] is None and one["within_log_bound"] is None


@pytest.mark.parametrize(
    "argv", [["--sizes", "1"], ["--sizes", "abc"], ["--policy", "nope"], ["--workers", "1"]]
)
def test_the_decision_cost_refuses_bad_options(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        scheduler_cost.main(argv)
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err


def test_act_real_help_runs_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def boom(**_: Any) -> dict[str, Any]:
        raise AssertionError("--help ran the benchmark")

    monkeypatch.setattr(act_real, "run_real", boom)
    with pytest.raises(SystemExit) as exc:
        act_real.main(["--help"])
    assert exc.value.code == 0 and "--json" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        act_real.main(["--policies", "nope"])
    assert exc.value.code == 2
