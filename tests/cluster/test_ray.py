"""Tangram on a real local multi-node Ray cluster (``ray.cluster_utils.Cluster``): workers come from
Ray's nodes, follow them as they join, die and crash, and the autoscaler is asked for capacity."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tangram_env import Action, Client
from tangram_env.server.scheduler.events import Resources
from tests.cluster.procs import (
    ROOT,
    Processes,
    check_delivery,
    child_env,
    free_port,
    read_marks,
    read_records,
    scrape_metrics,
    start_orchestrator,
    start_trainer,
    wait_for,
)

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [pytest.mark.slow]


@pytest.fixture
def ray_cluster() -> Iterator[Cluster]:
    """A head node with one CPU; tests add the others. The test process is a driver too (it reads
    actors and the autoscaler's request)."""
    sigterm = signal.getsignal(signal.SIGTERM)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    ray.init(address=cluster.address, namespace="tangram", log_to_driver=False, configure_logging=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        signal.signal(signal.SIGTERM, sigterm)  # ray.init replaced pytest's handler


def ray_env(**extra: str) -> dict[str, str]:
    """The orchestrator's environment: workers import the test plugin through Ray's runtime env."""
    runtime_env = {"env_vars": {"PYTHONPATH": str(ROOT)}}
    return child_env(TANGRAM_RAY_RUNTIME_ENV=json.dumps(runtime_env), TANGRAM_RAY_POLL_S="0.3", **extra)


def ray_workers(client: Client) -> dict[str, Any]:
    return {w: info for w, info in client.stats()["workers"].items() if w.startswith("ray-")}


def worker_of(node_id: str, runner: str = "cpu") -> str:
    return f"ray-{node_id[:12]}-{runner}"


def actor_pid(worker_id: str) -> int:
    return int(ray.get(ray.get_actor(f"tangram-{worker_id}").info.remote(), timeout=30)["pid"])


@pytest.mark.timeout(240)
def test_trainers_on_ray_nodes_that_join_die_and_crash(
    ray_cluster: Cluster, procs: Processes, tmp_path: Path
) -> None:
    node_a = ray_cluster.add_node(num_cpus=2)
    node_b = ray_cluster.add_node(num_cpus=2)
    ray_cluster.wait_for_nodes()
    head, a, b = (worker_of(n.node_id) for n in (ray_cluster.head_node, node_a, node_b))
    _, address = start_orchestrator(
        procs, "tcp://127.0.0.1:0", "--ray", ray_cluster.address, env=ray_env(TANGRAM_RAY_AUTOSCALE="0")
    )
    n, gate_at, trainers = 300, 150, 4
    marks, gate = tmp_path / "marks", tmp_path / "second-half"
    marks.mkdir()
    with Client(address) as client:
        wait_for(lambda: set(ray_workers(client)) == {head, a, b}, 60, "a worker on each of 3 Ray nodes")
        # Each lends what Ray reports for its node: its CPUs, and Ray's memory figure in MiB.
        assert ray_workers(client)[a]["capacity"]["cpu"] == 2.0
        assert ray_workers(client)[head]["capacity"]["cpu"] == 1.0
        outs = [tmp_path / f"t{i}.json" for i in range(trainers)]
        started = [
            start_trainer(
                procs, address, f"t{i}", n, marks, outs[i], seconds=0.05, gate=gate, gate_at=gate_at
            )
            for i in range(trainers)
        ]

        def b_busy() -> bool:
            figures = client.stats()
            return figures["finished"] >= n and figures["workers"].get(b, {}).get("running", 0) >= 2

        wait_for(b_busy, 90, "node b's worker to be busy mid-run", every_s=0.02)
        # Mid-run: node b dies, node a's worker actor crashes, node c joins.
        pid_a = actor_pid(a)
        ray_cluster.remove_node(node_b, allow_graceful=False)
        os.kill(pid_a, signal.SIGKILL)
        node_c = ray_cluster.add_node(num_cpus=2)
        c = worker_of(node_c.node_id)
        wait_for(lambda: set(ray_workers(client)) == {head, a, c}, 60, "b's worker removed and c's added")
        # Ray restarted a's actor on its node (a new process) and it registered again.
        wait_for(lambda: actor_pid(a) != pid_a, 60, "Ray to restart a's worker actor")
        gate.touch()
        for t in started:
            assert t.wait(timeout=120) == 0
        figures = client.stats()

    records = read_records(*outs)
    expected = {f"t{i}-{j}" for i in range(trainers) for j in range(n)}
    seen = check_delivery(records, expected, read_marks(marks), faulty={a, b})
    print("results per worker and requeues:", seen)
    assert figures["submitted"] == figures["finished"] == len(expected)
    assert figures["pending"] == figures["running"] == 0
    assert seen.get(b, 0) > 0 and seen.get(c, 0) > 0, seen  # b worked before it died, c after it joined
    assert seen["requeued"] >= 1, seen  # what ran on b (or on a's crashed actor) completed elsewhere
    second_half = {r["worker"] for r in records if int(r["id"].split("-")[1]) >= gate_at}
    assert a in second_half, second_half  # the restarted actor serves again


def requested_cpus() -> float:
    """The CPUs of the request standing with Ray's autoscaler (v1 keeps it in the internal KV store,
    v2 in the GCS)."""
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    if is_autoscaler_v2():
        from ray.autoscaler.v2.sdk import get_cluster_resource_state

        gcs = ray._private.worker.global_worker.gcs_client
        state = get_cluster_resource_state(gcs)
        return sum(
            b.resources_bundle.get("CPU", 0.0)
            for c in state.cluster_resource_constraints
            for r in c.resource_requests
            for b in [r.request] * r.count
        )
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return sum(b.get("CPU", 0.0) for b in json.loads(raw)) if raw else 0.0


@pytest.mark.timeout(180)
def test_a_queue_larger_than_the_cluster_asks_the_autoscaler_and_an_idle_pool_releases(
    ray_cluster: Cluster, procs: Processes, tmp_path: Path
) -> None:
    env = ray_env(
        TANGRAM_RAY_SCALE_UP_AFTER_S="1s", TANGRAM_RAY_RELEASE_AFTER_S="2s", TANGRAM_RAY_MAX_CPUS="6"
    )
    metrics_port = free_port()
    _, address = start_orchestrator(
        procs, "tcp://127.0.0.1:0", "--ray", ray_cluster.address, "--metrics-port", str(metrics_port), env=env
    )
    head = worker_of(ray_cluster.head_node.node_id)

    def requested_metric() -> float:
        return scrape_metrics(metrics_port)["tangram_ray_requested"][(("resource", "CPU"),)]

    marks = tmp_path / "marks"
    marks.mkdir()
    with Client(address) as client:
        # Two cores fit no node yet (the orchestrator's own worker lends 0.01, the head one): it waits
        # for a node that fits it, as shortfall, instead of being rejected before one can join.
        big = Action(
            id="big", kind="cluster.mark", payload={"dir": str(marks)}, demand=Resources(cpu=2, mem_mb=16)
        )
        (big_future,) = client.submit([big])
        wait_for(lambda: head in ray_workers(client), 60, "the head node's worker")
        assert not big_future.done()
        wait_for(lambda: requested_cpus() == 3, 30, "a request for the big action's node")
        assert requested_cpus() == 3  # the pool's one core, plus the two it lacks
        assert not big_future.done()
        # 40 actions of a quarter core each on one core: 9 cores short of running them all at once.
        # 30 s of work on the head alone: long enough for the new node to join and take some, however
        # loaded the host is.
        actions = [
            Action(id=f"q-{i}", kind="cluster.mark", payload={"dir": str(marks), "seconds": 3.0})
            for i in range(40)
        ]
        futures = client.submit(actions)
        # The pool (1 CPU) plus the shortfall, capped by max_cpus=6.
        wait_for(lambda: requested_cpus() == 6, 30, "a request to the autoscaler")
        ray_figures = client.stats()["ray"]
        assert ray_figures["last_request"] == "scale_up" and ray_figures["requested"] == {"CPU": 6.0}
        wait_for(lambda: requested_metric() == 6, 10, "the request in the metrics")
        # Play the autoscaler's provider: a node joins, gets a worker and takes work.
        node = ray_cluster.add_node(num_cpus=3)
        wait_for(lambda: worker_of(node.node_id) in ray_workers(client), 60, "the new node's worker")
        results = [f.result(timeout=120) for f in futures]
        assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
        assert worker_of(node.node_id) in {r.worker for r in results}
        big_result = big_future.result(timeout=60)
        assert big_result.ok and big_result.worker == worker_of(node.node_id), big_result
        # Idle for release_after_s: the request is withdrawn so that the autoscaler may scale down.
        t_idle = time.monotonic()
        wait_for(lambda: requested_cpus() == 0, 30, "the request to be released")
        assert time.monotonic() - t_idle >= 1.0
        ray_figures = client.stats()["ray"]
        assert ray_figures["last_request"] == "release" and ray_figures["requests"] >= 2
        assert ray_figures["nodes"] == 2
        wait_for(lambda: requested_metric() == 0, 10, "the release in the metrics")
        assert scrape_metrics(metrics_port)["tangram_ray_autoscaler_requests_total"][()] >= 2


@pytest.mark.timeout(120)
def test_a_plugin_missing_on_the_nodes_is_a_clear_error(
    ray_cluster: Cluster, procs: Processes, tmp_path: Path
) -> None:
    # No runtime env: the Ray workers cannot import the test plugin from the repository.
    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir()
    (plugin_dir / "only_here.py").write_text(
        "import tangram_env\n\n@tangram_env.tool(name='only_here.noop')\ndef noop() -> int:\n    return 1\n"
    )
    env = child_env(PYTHONPATH=f"{ROOT}{os.pathsep}{plugin_dir}", TANGRAM_RAY_AUTOSCALE="0")
    _, address = start_orchestrator(
        procs, "tcp://127.0.0.1:0", "--plugin", "only_here", "--ray", ray_cluster.address, env=env
    )
    with Client(address) as client:
        errors = wait_for(lambda: client.stats()["ray"]["errors"], 60, "the worker's start to fail")
        (message,) = errors.values()
        assert "only_here" in message and "TANGRAM_RAY_RUNTIME_ENV" in message, message
        assert not ray_workers(client)  # nothing registered with a partial set of kinds


@pytest.mark.timeout(120)
def test_a_second_orchestrator_on_the_same_nodes_is_told_why_it_gets_no_workers(
    ray_cluster: Cluster, procs: Processes
) -> None:
    env = ray_env(TANGRAM_RAY_AUTOSCALE="0")
    _, first = start_orchestrator(procs, "tcp://127.0.0.1:0", "--ray", ray_cluster.address, env=env)
    head = worker_of(ray_cluster.head_node.node_id)
    with Client(first) as client:
        wait_for(lambda: head in ray_workers(client), 60, "the first orchestrator's worker")
    _, second = start_orchestrator(procs, "tcp://127.0.0.1:0", "--ray", ray_cluster.address, env=env)
    with Client(second) as client:
        errors = wait_for(lambda: client.stats()["ray"]["errors"], 60, "the second's workers to fail")
        (message,) = errors.values()
        assert "another orchestrator" in message and "TANGRAM_RAY_NAMESPACE" in message, message
        assert not ray_workers(client)
    with Client(first) as client:  # the first keeps its worker, and it still serves
        assert head in ray_workers(client)
        result = client.call("cluster.mark", {"dir": "/tmp", "seconds": 0})
        assert result["worker"] == head


@pytest.mark.timeout(120)
def test_a_draining_node_loses_its_worker(
    ray_cluster: Cluster, procs: Processes, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    doomed = ray_cluster.add_node(num_cpus=2)
    worker = worker_of(doomed.node_id)
    env = ray_env(TANGRAM_RAY_AUTOSCALE="0")
    _, address = start_orchestrator(procs, "tcp://127.0.0.1:0", "--ray", ray_cluster.address, env=env)
    with Client(address) as client:
        head = worker_of(ray_cluster.head_node.node_id)
        wait_for(lambda: {head, worker} <= set(ray_workers(client)), 60, "the two nodes' workers")
        # Other Ray work on the node keeps it up while it drains (Ray lets an idle drained node go).
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        started = tmp_path / "holding"

        def sleep(seconds: float) -> None:
            started.touch()
            time.sleep(seconds)

        hold = ray.remote(num_cpus=1)(sleep).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(doomed.node_id, soft=False)
        )
        held = hold.remote(60)
        wait_for(started.exists, 60, "the holding task to start")
        deadline_ms = int(time.time() * 1000) + 60_000  # a preemption notice: the node goes in a minute
        accepted, why = GcsClient(address=ray_cluster.address).drain_node(
            doomed.node_id, autoscaler_pb2.DRAIN_NODE_REASON_PREEMPTION, "spot reclaimed", deadline_ms
        )
        assert accepted, why
        wait_for(lambda: worker not in ray_workers(client), 30, "the draining node's worker to leave")
        assert any(n["NodeID"] == doomed.node_id and n["Alive"] for n in ray.nodes())  # before it dies
        assert f"worker {worker} left (its Ray node is draining)" in capfd.readouterr().err
        assert head in ray_workers(client)  # the other node's worker stays
        ray.cancel(held, force=True)


@pytest.mark.timeout(120)
def test_the_embedded_orchestrator_attaches_to_ray_from_the_environment(
    ray_cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TANGRAM_ADDRESS", raising=False)
    for key, value in ray_env(TANGRAM_RAY_ADDRESS=ray_cluster.address, TANGRAM_RAY_AUTOSCALE="0").items():
        if key.startswith("TANGRAM_RAY_"):
            monkeypatch.setenv(key, value)
    with Client() as client:  # no address: an embedded orchestrator, which reads TANGRAM_RAY_*
        head = worker_of(ray_cluster.head_node.node_id)
        wait_for(lambda: head in ray_workers(client), 60, "the head node's worker")
        assert client.stats()["ray"]["nodes"] == 1
