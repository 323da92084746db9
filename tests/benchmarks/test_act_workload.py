"""The agentic-RL workload generator: seeded, shaped as documented."""

from __future__ import annotations

import random

import pytest

from benchmarks.act import gpu_replicas, over_provisioned
from benchmarks.sim.cluster import ClusterSpec
from benchmarks.sim.shapes import SHAPES
from benchmarks.sim.workload import ActionKind, WorkloadConfig, expected_shares, generate, trajectory
from tangram_env.server.scheduler.events import Resources
from tangram_env.server.scheduler.sandbox_memory import SandboxMemory


def test_same_seed_same_workload_other_seed_other_workload() -> None:
    cfg = WorkloadConfig(trajectories=20, steps=2)
    assert generate(cfg) == generate(cfg)
    assert generate(cfg) != generate(cfg.with_(seed=1))
    # A trajectory does not depend on how many others there are (policies see identical work).
    assert trajectory(cfg, 1, 5) == generate(cfg.with_(trajectories=50))[1][5]


def test_trajectories_have_the_rl_shape() -> None:
    cfg = WorkloadConfig(trajectories=200, steps=1)
    trajs = generate(cfg)[0]
    envs = {t.env.env_id for t in trajs}
    assert envs == {"swe", "code"}
    swe = sum(t.env.env_id == "swe" for t in trajs) / len(trajs)
    assert 0.5 < swe < 0.7
    for t in trajs:
        assert t.actions[0].kind == "reset" and t.gaps[0] == 0.0
        assert t.actions[-1].reward and not t.actions[0].reward
        assert all(g > 0 for g in t.gaps[1:])  # LLM generation separates the actions
        assert t.env.turns_min + 2 <= len(t.actions) <= t.env.turns_max + 2
        assert len({a.action_id for a in t.actions}) == len(t.actions)
    kinds = {a.kind for t in trajs for a in t.actions}
    assert kinds == {"reset", "bash", "run_tests", "exec_python", "score"}


def test_durations_are_long_tailed_around_the_median() -> None:
    rng = random.Random(0)
    k = ActionKind("x", Resources(1, 1), median_s=2.0, sigma=1.0)
    xs = sorted(k.draw(rng) for _ in range(20_000))
    assert xs[len(xs) // 2] == pytest.approx(2.0, rel=0.05)
    assert sum(xs) / len(xs) == pytest.approx(k.mean_s(), rel=0.05)
    assert xs[int(0.99 * len(xs))] > 15 * xs[int(0.01 * len(xs))]
    p = ActionKind("p", Resources(1, 1), median_s=2.0, dist="pareto", pareto_alpha=2.0)
    ys = sorted(p.draw(rng) for _ in range(20_000))
    assert ys[len(ys) // 2] == pytest.approx(2.0, rel=0.05)
    assert k.run_s(10.0, 4) == 10.0  # serial: no speed-up
    assert ActionKind("e", Resources(1, 1), median_s=1, parallel=0.9).run_s(10.0, 10) == pytest.approx(1.9)


def test_expected_shares_add_up_per_resource() -> None:
    shares = expected_shares(WorkloadConfig())
    assert sum(s.cpu for s in shares.values()) == pytest.approx(1.0)
    assert shares["code"].gpu == pytest.approx(1.0) and shares["swe"].gpu == 0.0


def test_scaled_pools_keep_every_resource_in_proportion() -> None:
    full = ClusterSpec.for_cores(512)
    assert full.gpus == 32 and full.capacity().gpu == 32
    for f, gpus in ((0.75, 24), (0.5, 16), (0.35, 11), (0.125, 4)):
        pool = full.scaled(f)
        assert pool.gpus == gpus == sum(w.capacity.gpu for w in pool.workers())
        assert pool.cores == pytest.approx(512 * f, rel=0.05)
        assert pool.capacity().mem_mb == pytest.approx(full.capacity().mem_mb * f, rel=0.05)
    small = ClusterSpec.for_cores(64)
    assert [small.scaled(f).gpus for f in (1.0, 0.75, 0.5, 0.125)] == [4, 3, 2, 1]  # never the same GPUs
    assert ClusterSpec.for_cores(64, gpu_kinds=frozenset()).gpus == 0  # no GPU kind: no GPUs


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shapes_and_their_baseline_configuration(shape: str) -> None:
    s = SHAPES[shape]
    wl = s.workload(seed=0, steps=1, cores=64)
    assert wl.trajectories == round(s.per_core * 64)
    trajs = generate(wl)[0]
    assert {t.env.env_id for t in trajs} == {e.env_id for e in wl.envs}
    base = ClusterSpec.for_cores(64, s.cores_per_gpu, wl.gpu_kinds())
    over = over_provisioned(wl, base)
    assert sum(t.env.slot.cpu for t in trajs) <= over.cores  # every trajectory holds its slot at once
    assert over.gpus * base.cores == pytest.approx(base.gpus * over.cores, rel=0.1)  # GPUs in ratio
    replicas = gpu_replicas(wl, base.gpus)
    assert set(replicas) == set(wl.gpu_kinds())  # every reward model, not just one
    assert all(n >= 1 for n, _ in replicas.values())
    assert sum(n * one.gpu for n, one in replicas.values()) <= max(base.gpus, len(replicas) * 2)


def test_equal_act_crossing_interpolates_between_the_pools_around_it() -> None:
    from benchmarks.act_report import crossing

    # (pool size, mean ACT, resource-seconds): ACT grows as the pool shrinks.
    pts = [(100.0, 5.0, 1000.0), (50.0, 20.0, 800.0), (25.0, 80.0, 700.0)]
    c = crossing(pts, 10.0)  # between 100 (5 s) and 50 (20 s): half-way on log ACT
    assert c["bound"] == "interpolated"
    assert c["size"] == pytest.approx(75.0) and c["resource_s"] == pytest.approx(900.0)
    assert crossing(pts, 100.0)["size"] == 25.0  # reached even at the smallest pool: an upper bound
    assert crossing(pts, 1.0)["size"] is None  # never reached


def test_a_sandbox_holds_its_idle_footprint_and_a_command_the_rest_of_its_limit() -> None:
    mem = SandboxMemory(3072)
    assert mem.idle_mb == 3072 / 8 and SandboxMemory(3072, reserve_mb=100).idle_mb == 100
    assert mem.command_mb() == 3072 - 384 and mem.command_mb(8) == (3072 - 384) / 8
    wl = SHAPES["swe_fast"].build()
    (env,) = wl.envs
    assert wl.demand("bash", env) == wl.kinds["bash"].demand + Resources(mem_mb=3072 - 384)
    assert wl.demand("full_tests", env).mem_mb == (3072 - 384) / 16  # its 16 shards share it
    assert wl.with_(sessions=False).demand("bash", env) == wl.kinds["bash"].demand  # no sandbox: none
    gj = SHAPES["gpu_judged"].build()
    assert gj.demand("search", gj.envs[0]) == gj.kinds["search"].demand  # runs outside the sandbox
