"""The simulator drives the real schedulers; it catches over-commit from the outside; runs repeat exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.act import (
    BASELINES,
    GRID,
    POLICIES,
    Job,
    least_resource_s,
    main,
    make_policy,
    over_provisioned,
    plan,
    sweep,
)
from benchmarks.act_report import OVER_POOL, assemble, floors
from benchmarks.sim.cluster import ClusterSpec
from benchmarks.sim.shapes import SHAPES
from benchmarks.sim.simulator import SimulationError, simulate
from benchmarks.sim.workload import ActionKind, WorkloadConfig, default_envs, generate
from tangram_env.server.scheduler import ElasticScheduler, FCFSScheduler
from tangram_env.server.scheduler.caps import CapsConfig
from tangram_env.server.scheduler.events import Resources, Start

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
    assert set(res["tangram_vs"]) == set(BASELINES)
    tb = res["tangram_vs"]["trajectory_bound"]
    assert tb["act_ratio"] == pytest.approx(
        res["policies"]["trajectory_bound"]["mean_act_s"] / res["policies"]["elastic"]["mean_act_s"]
    )
    assert {"act_ratio", "step_ratio", "resource_saving", "pool_saving"} <= set(tb)
    fcfs = res["tangram_vs"]["fcfs"]
    assert fcfs["min_act_ratio"] == min(r["act_ratio"] for r in fcfs["by_pool"])
    assert {r["fraction"] for r in fcfs["by_pool"]} == set(sweep(64)) == set(GRID)  # every pool of the sweep
    floors = res["floors"]
    assert {f["name"] for f in floors} >= {
        "vs_tb_over_resource_saving",
        "vs_tb_queued_act_ratio",
        "vs_fcfs_p99_ratio_every_pool",
        "vs_fcfs_resource_s_ratio_equal_act",
    }
    for f in floors:
        keys = {"name", "workload", "cores", "value", "op", "floor", "met", "pools"}
        if f["name"].endswith("_every_pool"):
            assert f["pools"] == list(GRID)
        if f["name"] == "vs_tb_over_resource_saving":  # and the most any policy could save
            keys.add("best_possible")
            assert f["best_possible"] == res["tangram_vs"]["trajectory_bound_over"]["resource_saving_most"]
        assert set(f) == keys
        assert f["workload"] == "default" and f["cores"] == 64 and f["op"] in (">=", "<=")
        assert f["met"] == (
            f["value"] is not None
            and (f["value"] >= f["floor"] if f["op"] == ">=" else f["value"] <= f["floor"])
        )
    assert res["floors_met"] == all(f["met"] for f in floors)


def _fake_figures(job: Job) -> dict[str, object]:
    """Made-up figures for ``job``, distinct per run (enough for ``assemble`` and ``floors``)."""
    size = job.cores * (4.0 if job.over else job.fraction)
    act = 10.0 / job.fraction + (0.3 if job.policy == "fcfs" else 0.0) + len(job.policy) / 100
    return {
        "mean_act_s": act,
        "mean_act_after_first_s": act,
        "mean_step_s": 10 * act,
        "p99_act_s": 5 * act,
        "resource_s": 100 * size,
        "pool": {"cores": size, "size": size},
    }


def _floors_of(jobs: list[Job]) -> list[dict[str, object]]:
    result: dict[str, object] = {"workloads": {}}
    for shape in sorted({j.shape for j in jobs}):
        scales = {}
        for c in sorted({j.cores for j in jobs if j.shape == shape}):
            runs = {
                (j.policy, j.fraction, j.over): _fake_figures(j)
                for j in jobs
                if j.shape == shape and j.cores == c
            }
            scales[str(c)] = assemble(runs, 1.0)
        result["workloads"][shape] = {"scales": scales}  # type: ignore[index]
    return floors(result)


@pytest.mark.parametrize("scales", [[64, 512, 4096], [64], [512], [512, 64]])
def test_the_pools_a_floor_covers_do_not_depend_on_the_plot(scales: list[int]) -> None:
    shapes, steps = ["default", "swe_fast"], [1] * len(scales)
    with_plot = plan(shapes, scales, steps, 0, min(scales))
    no_plot = plan(shapes, scales, steps, 0, None)
    # The plot adds only runs no floor reads (trajectory-bound and task-isolated off the full pool).
    extra = set(with_plot) - set(no_plot)
    assert set(no_plot) <= set(with_plot)
    assert all(j.policy in ("trajectory_bound", "task_isolated") and j.fraction < 1 for j in extra)
    for c in scales:
        swept = {(j.policy, j.fraction) for j in no_plot if j.cores == c and not j.over}
        assert (
            {f for p, f in swept if p == "fcfs"} == {f for p, f in swept if p == "elastic"} == set(sweep(c))
        )
    a, b = _floors_of(with_plot), _floors_of(no_plot)
    assert a == b  # same values, same pools
    for f in a:
        cores = f["cores"]
        assert isinstance(cores, int)
        if str(f["name"]).endswith("_every_pool"):
            assert f["pools"] == list(sweep(cores))
        elif str(f["name"]) in ("vs_tb_over_resource_saving", "vs_fcfs_resource_s_ratio_equal_act"):
            assert f["pools"] == [OVER_POOL, *sweep(cores)]


def test_the_sweep_depends_on_the_scale_alone() -> None:
    assert sweep(64) == GRID and min(sweep(64)) == 0.125
    assert min(sweep(512)) == min(sweep(4096)) == 0.25


@pytest.mark.parametrize(
    "argv",
    [
        ["--scales", "abc"],
        ["--scales", "0"],
        ["--steps", "0"],
        ["--scales", "64,512", "--steps", "1,2,3"],
        ["--quick", "--scales", "512"],
        ["--quick", "--steps", "2"],
        ["--quick", "--workloads", "swe_fast"],
        ["--workloads", "nope"],
        ["--no-plot", "--save-plot"],
    ],
)
def test_bad_options_are_refused_with_a_message(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_workload_shape_runs_under_every_policy(shape: str) -> None:
    wl = SHAPES[shape].workload(seed=1, steps=1, cores=64, per_core=0.4)
    base = ClusterSpec.for_cores(64, SHAPES[shape].cores_per_gpu, wl.gpu_kinds())
    n = sum(len(t.actions) for t in generate(wl)[0])
    least = least_resource_s(wl)
    for policy in POLICIES:
        cl = over_provisioned(wl, base) if policy == "trajectory_bound_over" else base
        fig = simulate(make_policy(policy, wl, cl), cl, wl, validate_every=200).figures()
        assert fig["actions"] == n and fig["rejected"] == 0, (policy, fig["rejected"])
        # No policy holds less than the plan's least (the bound that says which savings are out of reach).
        assert fig["resource_s"] >= least, (policy, fig["resource_s"], least)
        if shape == "swe_fast" and policy == "fcfs":  # no GPU, no queue: little beyond the work itself
            assert fig["resource_s"] <= 1.15 * least, (fig["resource_s"], least)


def test_the_simulator_charges_a_live_sandboxs_memory() -> None:
    # Slots that hold no memory on workers of 8 GiB: the sandboxes (idle 128-256 MiB each from reset to
    # close, and up to their 1-2 GiB limit while a command runs) overflow the workers' memory, and the
    # simulator says so.
    wl = WorkloadConfig(trajectories=24, steps=1)
    wl = wl.with_(envs=tuple(replace(e, slot=replace(e.slot, mem_mb=0.0)) for e in wl.envs))
    cl = replace(ClusterSpec.for_cores(32), mem_mb_per_worker=8 * 1024)
    with pytest.raises(SimulationError, match="over its capacity"):
        simulate(make_policy("trajectory_bound", wl, cl), cl, wl)
    res = simulate(ElasticScheduler(), cl, wl, validate_every=50)  # Tangram books it: new sandboxes wait
    assert res.figures()["rejected"] == 0 and res.figures()["mem_gib_s"] > 0


def _loads(second_model_gib: float) -> int:
    gb = 1024
    kinds = {
        "reset": ActionKind("reset", Resources(1), median_s=1.0),
        "m1": ActionKind("m1", Resources(1, gb, 1, 60 * gb), median_s=1.0, setup="model"),
        "m2": ActionKind("m2", Resources(1, gb, 1, second_model_gib * gb), median_s=1.0, setup="model"),
    }
    env = replace(default_envs()[1], turns=(("reset", 1.0),), rewards=("m1", "m2"), turns_min=1, turns_max=1)
    wl = WorkloadConfig(trajectories=12, steps=1, kinds=kinds, envs=(env,))
    cl = ClusterSpec(cpu_workers=1, gpu_kinds=frozenset({"m1", "m2"})).with_gpus(1)
    return simulate(FCFSScheduler(), cl, wl).figures()["model_loads"]


def test_models_are_loaded_per_device_and_cached_while_its_memory_allows() -> None:
    assert _loads(second_model_gib=10) == 2  # both fit on the one GPU: each is loaded once
    assert _loads(second_model_gib=30) > 2  # they do not (90 GiB > 80): they evict each other


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fraction", [0.35, 0.18])
def test_every_policy_drains_a_crowded_small_pool(policy: str, fraction: float) -> None:
    # Small pools are where reservations, quotas and blocked classes meet; every action must finish.
    wl = WorkloadConfig(trajectories=128, steps=2)
    cl = ClusterSpec.for_cores(64).scaled(fraction)
    res = simulate(make_policy(policy, wl, cl), cl, wl, validate_every=50)
    assert res.figures()["rejected"] == 0 and len(res.steps) == 2


def test_the_simulator_charges_warm_sandboxes_their_memory() -> None:
    # Sandboxes kept warm between steps hold their idle footprint until taken: at least the trainer's
    # update between two steps for each one the next step takes.
    wl = WorkloadConfig(trajectories=16, steps=2)
    cl = ClusterSpec.for_cores(32)
    kept = simulate(ElasticScheduler(caps=CapsConfig(warm_max_idle_s=float("inf"))), cl, wl).figures()
    idle_gib = min(e.sandbox.idle_mb for e in wl.envs if e.sandbox is not None) / 1024
    assert kept["warm_starts"] > 0
    assert kept["warm_mem_gib_s"] >= kept["warm_starts"] * idle_gib * wl.update_s
    assert kept["mem_gib_s"] > kept["warm_mem_gib_s"]
    none = simulate(ElasticScheduler(caps=CapsConfig(warm_pool=False)), cl, wl).figures()
    assert none["warm_starts"] == 0 and none["warm_mem_gib_s"] == 0.0
