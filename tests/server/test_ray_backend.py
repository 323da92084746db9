"""The Ray backend's pure parts: what a node's workers lend, and when the autoscaler is asked."""

from __future__ import annotations

import pytest

from tangram_env import Action
from tangram_env.protocol import Register, Submit
from tangram_env.server.cli import build
from tangram_env.server.config import RaySettings, ServerSettings
from tangram_env.server.ray_backend import CapacityPolicy, RayNode, WorkerSpec, _worker_argv, plan_workers
from tangram_env.server.resources import RAY_AWAIT_AUTOSCALE_S, RAY_AWAIT_NODES_S
from tangram_env.server.scheduler.events import Resources

GIB = 2**30


def node(**resources: float) -> RayNode:
    return RayNode("ab" * 28, True, resources)


def test_a_cpu_node_lends_what_ray_reports_minus_the_reserve() -> None:
    settings = RaySettings(reserve_cpu=2, reserve_mem="4GiB")
    (plan,) = plan_workers(node(CPU=16, memory=64 * GIB), settings, reward_models=True)
    assert plan.worker_id == "ray-abababababab-cpu" and plan.runner == "cpu"
    assert plan.lend == Resources(cpu=14, mem_mb=60 * 1024)


def test_a_gpu_node_runs_a_gpu_worker_with_a_core_per_device_when_reward_models_exist() -> None:
    settings = RaySettings(reserve_gpu=1)
    cpu, gpu = plan_workers(node(CPU=32, memory=100 * GIB, GPU=8), settings, reward_models=True)
    assert gpu.runner == "gpu" and gpu.lend.gpu == 7 and gpu.lend.cpu == 7
    assert gpu.devices == tuple(f"cuda:{i}" for i in range(7))
    assert cpu.lend.cpu == 25 and cpu.lend.mem_mb + gpu.lend.mem_mb == 100 * 1024
    # Without reward models the GPUs are not lent: every core goes to the CPU worker.
    (only,) = plan_workers(node(CPU=32, memory=100 * GIB, GPU=8), settings, reward_models=False)
    assert only.runner == "cpu" and only.lend.cpu == 32


def test_a_gpu_workers_command_line_carries_the_servers_stuck_device_limit() -> None:
    (_, gpu) = plan_workers(node(CPU=8, memory=32 * GIB, GPU=2), RaySettings(), reward_models=True)
    address = "tcp://10.0.0.1:5555"
    spec = WorkerSpec(gpu, address, (), (), True, "local", None, 1 << 20, gpu_stuck_after_s=42.5)
    argv = _worker_argv(spec, parent_pid=1)
    assert argv[argv.index("--gpus") + 1] == "cuda:0,cuda:1"
    assert argv[argv.index("--stuck-after-s") + 1] == "42.5"


def test_node_resource_keeps_tangram_to_the_nodes_that_declare_it() -> None:
    settings = RaySettings(node_resource="tangram")
    assert plan_workers(node(CPU=8, memory=GIB), settings, reward_models=False) == []
    assert len(plan_workers(node(CPU=8, memory=GIB, tangram=1), settings, reward_models=False)) == 1
    # A node whose whole CPU is reserved gets no worker at all.
    assert plan_workers(node(CPU=2, memory=GIB), RaySettings(reserve_cpu=2), reward_models=False) == []


def test_the_autoscaler_is_asked_only_after_a_shortfall_lasts_and_for_the_pool_plus_the_shortfall() -> None:
    policy = CapacityPolicy(RaySettings(scale_up_after_s=5, release_after_s=30, max_cpus=12))
    pool = [{"CPU": 4.0}]
    waiting, free = Resources(cpu=10.5), Resources(cpu=1)
    assert policy.decide(0.0, waiting, free, pool, busy=True) is None  # not for long enough yet
    assert policy.decide(4.9, waiting, free, pool, busy=True) is None
    request = policy.decide(5.0, waiting, free, pool, busy=True)
    assert request == [{"CPU": 4.0}] + [{"CPU": 1.0}] * 8  # 9.5 cores short, whole bundles, capped at 12
    assert policy.decide(6.0, waiting, free, pool, busy=True) is None  # unchanged: not asked again
    # A GPU shortfall asks for GPU bundles; a blip of no shortfall restarts the wait.
    assert policy.decide(7.0, Resources(), Resources(cpu=3), pool, busy=True) is None
    assert policy.decide(8.0, Resources(gpu=2), Resources(), pool, busy=True) is None
    assert policy.decide(13.0, Resources(gpu=2), Resources(), pool, busy=True) == [
        {"CPU": 4.0},
        {"GPU": 1.0},
        {"GPU": 1.0},
    ]


def test_an_action_no_worker_can_hold_is_asked_for_as_one_bundle() -> None:
    # Two loose cores could come as two one-core nodes; an action of two cores needs a node of two.
    policy = CapacityPolicy(RaySettings(scale_up_after_s=0, max_gpus=1))
    whole = [{"CPU": 2.0}, {"CPU": 1.0, "GPU": 1.0}]
    request = policy.decide(0.0, Resources(), Resources(cpu=1), [{"CPU": 1.0}], busy=True, whole=whole)
    assert request == [{"CPU": 1.0}, {"CPU": 2.0}, {"CPU": 1.0, "GPU": 1.0}]
    beyond = CapacityPolicy(RaySettings(scale_up_after_s=0, max_gpus=0))  # no GPU may be asked for
    assert (
        beyond.decide(0.0, Resources(), Resources(), [], busy=True, whole=[{"CPU": 1.0, "GPU": 1.0}]) is None
    )
    assert beyond.requested == []


def test_an_idle_pool_releases_its_request_after_release_after_s() -> None:
    policy = CapacityPolicy(RaySettings(scale_up_after_s=0, release_after_s=30))
    assert policy.decide(0.0, Resources(cpu=2), Resources(), [], busy=True) == [{"CPU": 1.0}] * 2
    assert policy.decide(10.0, Resources(), Resources(cpu=2), [], busy=True) is None  # busy: kept
    assert policy.decide(20.0, Resources(), Resources(cpu=2), [], busy=False) is None  # idle from here
    assert policy.decide(49.0, Resources(), Resources(cpu=2), [], busy=False) is None
    assert policy.decide(50.0, Resources(), Resources(cpu=2), [], busy=False) == []
    assert policy.decide(90.0, Resources(), Resources(cpu=2), [], busy=False) is None  # nothing to release
    assert policy.requested == []


def test_ray_settings_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANGRAM_RAY_ADDRESS", "auto")
    monkeypatch.setenv("TANGRAM_RAY_RUNTIME_ENV", '{"pip": ["mypkg"]}')
    monkeypatch.setenv("TANGRAM_RAY_RELEASE_AFTER_S", "2m")
    ray = ServerSettings().ray
    assert ray.address == "auto" and ray.runtime_env == {"pip": ["mypkg"]} and ray.release_after_s == 120
    assert ServerSettings(ray=RaySettings(address="ray://head:10001")).ray.address == "ray://head:10001"


def test_the_orchestrator_reports_queued_demand_and_removes_workers_on_request() -> None:
    from tests.cluster import plugin  # noqa: F401  (registers cluster.mark: 0.25 cpu, 16 MiB)

    orch = build(ServerSettings(bind="tcp://127.0.0.1:0", cpus=0.01, mem_mb=64, gpu_worker=False))
    try:
        calls: list[float] = []
        orch.attach(lambda o, now: calls.append(now), lambda: {"nodes": 3}, name="ray")
        register = Register(worker_id="w", capacity=Resources(cpu=1, mem_mb=100))
        orch.core.receive(b"w", register, 0.0)
        assert orch.figures()["ray"] == {"nodes": 3} and "w" in orch.figures()["workers"]
        orch._housekeeping(1.0)
        assert calls == [1.0]
        assert orch.remove_worker("w", "its Ray node died") and "w" not in orch.figures()["workers"]
        assert not orch.remove_worker("local", "the local executor is not a remote worker")
        assert orch.queued_demands() == []
        submit = Submit(actions=[Action(id="a1", kind="cluster.mark", payload={"dir": "/tmp"})])
        orch.core.receive(b"c", submit, 2.0)
        assert orch.queued_demands() == [Resources(cpu=0.25, mem_mb=16)]
    finally:
        orch.close()


def test_with_ray_what_no_worker_fits_yet_waits_for_nodes_and_counts_as_shortfall() -> None:
    from tests.cluster import plugin  # noqa: F401  (registers cluster.mark: 0.25 cpu, 16 MiB)

    for autoscale, wait in ((True, RAY_AWAIT_AUTOSCALE_S), (False, RAY_AWAIT_NODES_S)):
        settings = ServerSettings(
            bind="tcp://127.0.0.1:0",
            cpus=0.5,
            mem_mb=64,
            gpu_worker=False,
            ray=RaySettings(address="auto", autoscale=autoscale),
        )
        orch = build(settings)  # the Ray backend attaches later (`serve`): only the scheduler is built here
        try:
            assert orch.scheduler.config.await_capacity_s == wait
            big = Action(
                id="big", kind="cluster.mark", payload={"dir": "/tmp"}, demand=Resources(cpu=2, mem_mb=16)
            )
            orch.core.receive(b"c", Submit(actions=[big]), 0.0)
            orch.core.flush(0.0)
            assert orch.core.entries["big"].stage.name == "QUEUED"  # not rejected: a node may fit it
            assert orch.queued_demands() == [Resources(cpu=2, mem_mb=16)]
        finally:
            orch.close()


def test_without_ray_the_server_never_imports_it_and_asking_for_it_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import subprocess
    import sys

    from tangram_env.server.ray_backend import attach_ray

    code = (
        "import sys, tangram_env.server.cli, tangram_env.server.worker, tangram_env.server.ray_backend\n"
        "print('ray' in sys.modules)"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
    )
    assert attach_ray(ServerSettings(), orchestrator=None) is None  # no address: no Ray
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ImportError, match=r"pip install 'tangram-env\[ray\]'"):
        attach_ray(ServerSettings(ray=RaySettings(address="auto")), orchestrator=None)
