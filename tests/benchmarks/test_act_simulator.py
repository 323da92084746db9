"""The simulator drives the real schedulers; it catches over-commit from the outside; runs repeat exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.act import POLICIES, make_policy
from benchmarks.sim.cluster import ClusterSpec
from benchmarks.sim.simulator import SimulationError, simulate
from benchmarks.sim.workload import WorkloadConfig, generate
from tangram_env.server.scheduler import ElasticScheduler
from tangram_env.server.scheduler.events import Start

ROOT = Path(__file__).resolve().parents[2]
SMALL = WorkloadConfig(trajectories=24, steps=2)
CLUSTER = ClusterSpec.for_cores(32)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_completes_the_workload(policy: str) -> None:
    res = simulate(make_policy(policy, SMALL, CLUSTER), CLUSTER, SMALL, validate_every=1)
    fig = res.figures()
    n = sum(len(t.actions) for step in generate(SMALL) for t in step)
    assert fig["actions"] == n and fig["rejected"] == 0
    assert 0 < fig["p50_act_s"] <= fig["mean_act_s"] * 3 and fig["p99_act_s"] >= fig["p50_act_s"]
    assert len(res.steps) == 2 and fig["mean_step_s"] > 0
    assert 0 < fig["utilisation"] <= fig["held_fraction"] + 1e-9 <= 1.0 + 1e-9


def test_same_seed_same_figures() -> None:
    a = simulate(ElasticScheduler(), CLUSTER, SMALL).figures()
    b = simulate(ElasticScheduler(), CLUSTER, SMALL).figures()
    assert a == b


def test_tangram_beats_trajectory_bound_on_a_contended_pool() -> None:
    wl = WorkloadConfig(trajectories=64, steps=1)
    cl = ClusterSpec.for_cores(32)
    t = simulate(make_policy("elastic", wl, cl), cl, wl).figures()
    tb = simulate(make_policy("trajectory_bound", wl, cl), cl, wl).figures()
    assert tb["mean_act_s"] > 2 * t["mean_act_s"]
    assert tb["resource_s"] > 2 * t["resource_s"]
    assert t["mean_parallelism"]["run_tests"] > 2  # spare cores went to test shards


class _Overcommitting(ElasticScheduler):
    """A deliberately broken scheduler: it starts every arrival at once on the first worker."""

    def handle(self, events, now):  # type: ignore[no-untyped-def]
        out = super().handle(events, now)
        extra = [Start(e.action_id, "cpu0", 1) for e in events if type(e).__name__ == "ActionArrived"]
        started = {d.action_id for d in out if isinstance(d, Start)}
        return out + [d for d in extra if d.action_id not in started]


def test_the_simulator_catches_a_scheduler_that_breaks_the_rules() -> None:
    with pytest.raises(SimulationError):
        simulate(_Overcommitting(), CLUSTER, SMALL)


def test_quick_benchmark_prints_the_documented_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.act", "--quick", "--json", "--jobs", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    res = json.loads(out.stdout)
    assert set(res["policies"]) == set(POLICIES)
    for fig in res["policies"].values():
        assert {"mean_act_s", "p50_act_s", "p99_act_s", "mean_step_s", "resource_s", "utilisation"} <= set(
            fig
        )
    assert set(res["tangram_vs"]) == {"trajectory_bound", "task_isolated", "fcfs"}
    tb = res["tangram_vs"]["trajectory_bound"]
    assert tb["act_ratio"] == pytest.approx(
        res["policies"]["trajectory_bound"]["mean_act_s"] / res["policies"]["elastic"]["mean_act_s"]
    )
    assert {"act_ratio", "step_ratio", "resource_saving"} <= set(tb)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fraction", [0.35, 0.18])
def test_every_policy_drains_a_crowded_small_pool(policy: str, fraction: float) -> None:
    # Small pools are where reservations, quotas and blocked classes meet; every action must finish.
    wl = WorkloadConfig(trajectories=128, steps=2)
    cl = ClusterSpec.for_cores(64).scaled(fraction)
    res = simulate(make_policy(policy, wl, cl), cl, wl, validate_every=50)
    assert res.figures()["rejected"] == 0 and len(res.steps) == 2
