from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest

from tangram_env.server.prometheus import PrometheusExporter
from tests.cluster.procs import scrape_metrics as scrape


@pytest.fixture
def exporter() -> Iterator[PrometheusExporter]:
    exp = PrometheusExporter()
    yield exp
    exp.stop()


def labels(**kw: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(kw.items()))


# The figures dict as the orchestrator's Stats builds it, with a CPU worker reporting used resources and
# a sandbox pool, and a reward-model worker reporting what GpuRunner.stats() reports.
FIGURES = {
    "server_id": "abc123",
    "scheduler": "fcfs",
    "submitted": 120,
    "finished": 100,
    "act": {"echo": {"count": 50, "mean_s": 0.001, "p50_s": 0.001, "p99_s": 0.002}},
    "queued": {},
    "errors": {"timeout": 2, "rejected": 1},
    "protocol_errors": {"bad_version": 3},
    "pending": 7,
    "running": 5,
    "entries": 12,
    "workers": {
        "local": {
            "capacity": {"cpu": 0.01, "mem_mb": 100, "gpu": 0.0, "gpu_mem_mb": 0},
            "running": 0,
            "kinds": ["sleep"],
            "figures": {"running": 0, "cores": 2},
        },
        "cpu-1": {
            "capacity": {"cpu": 8.0, "mem_mb": 8192, "gpu": 0.0, "gpu_mem_mb": 0},
            "running": 4,
            "used": {"cpu": 2.0, "mem_mb": 1024, "gpu": 0.0, "gpu_mem_mb": 0},
            "kinds": None,
            "figures": {
                "sandboxes": {
                    "provider": "local",
                    "sessions": 2,
                    "created": 6,
                    "cold_starts": 1,
                    "warm_hits": 5,
                    "resets": 4,
                    "reset_ms_mean": 3.5,
                    "shrunk": 0,
                    "discarded": 1,
                    "discard_reasons": {"exec_died": 1},
                    "closed": 0,
                    "images": {
                        "default": {"warm": 3, "in_use": 2, "target": 4},
                        "py311": {"warm": 1, "in_use": 0, "target": 1},
                    },
                }
            },
        },
        "gpu-1": {
            "capacity": {"cpu": 0.0, "mem_mb": 0, "gpu": 2.0, "gpu_mem_mb": 160000},
            "running": 1,
            "used": {"cpu": 0.0, "mem_mb": 0, "gpu": 0.5, "gpu_mem_mb": 40000},
            "kinds": ["minilm"],
            "figures": {
                "policy": "lru",
                "actions": 1,
                "devices": [
                    {
                        "device": "cuda:0",
                        "budget_mb": 80000.0,
                        "used_mb": 88.0,
                        "busy": True,
                        "models": ["minilm"],
                        "running": {
                            "model": "minilm",
                            "what": "forward pass",
                            "for_s": 40.0,
                            "past_limit_s": 12.5,
                        },
                    },
                    {"device": "cuda:1", "budget_mb": 80000.0, "used_mb": 0.0, "busy": False, "models": []},
                ],
                "models": {
                    "minilm": {
                        "loaded_on": ["cuda:0"],
                        "replicas": 1,
                        "queue_items": 6,
                        "memory_mb": 88.0,
                        "loads": 4,
                        "evictions": 3,
                        "load_failures": 0,
                        "ooms": 0,
                    }
                },
            },
        },
    },
}


def test_results_become_histograms_and_error_counters(exporter: PrometheusExporter) -> None:
    port = exporter.start(0)
    assert port > 0 and exporter.port == port
    for act in (0.004, 0.02, 0.3):
        exporter.observe_result("bash", True, None, act, act / 2)
    exporter.observe_result("bash", False, "timeout", 12.0, 1.0)
    exporter.observe_result("score", False, None, 0.5, 0.0)
    m = scrape(port)
    assert m["tangram_action_completion_seconds_count"][labels(kind="bash")] == 4
    assert m["tangram_action_completion_seconds_sum"][labels(kind="bash")] == pytest.approx(12.324)
    # Cumulative buckets: 2 of the 4 bash actions took at most 25 ms, 3 at most 0.5 s, all at most 30 s.
    buckets = m["tangram_action_completion_seconds_bucket"]
    assert buckets[labels(kind="bash", le="0.025")] == 2
    assert buckets[labels(kind="bash", le="0.5")] == 3
    assert buckets[labels(kind="bash", le="30.0")] == 4
    assert m["tangram_action_queue_seconds_sum"][labels(kind="bash")] == pytest.approx(0.162 + 1.0)
    assert m["tangram_actions_finished_total"] == {
        labels(kind="bash", outcome="ok"): 3,
        labels(kind="bash", outcome="error"): 1,
        labels(kind="score", outcome="error"): 1,
    }
    assert m["tangram_action_errors_total"] == {
        labels(kind="bash", reason="timeout"): 1,
        labels(kind="score", reason="error"): 1,
    }


def test_figures_become_state_series(exporter: PrometheusExporter) -> None:
    port = exporter.start(0)
    exporter.update(FIGURES)
    m = scrape(port)
    assert m["tangram_queue_length"][()] == 7
    assert m["tangram_running_actions"][()] == 5
    assert m["tangram_submitted_total"][()] == 120
    assert m["tangram_finished_total"][()] == 100
    assert m["tangram_errors_total"] == {labels(reason="timeout"): 2, labels(reason="rejected"): 1}
    assert m["tangram_protocol_errors_total"] == {labels(code="bad_version"): 3}
    assert m["tangram_server_info"] == {labels(server_id="abc123", scheduler="fcfs"): 1}
    assert m["tangram_workers"][()] == 3
    assert m["tangram_worker_running_actions"][labels(worker="cpu-1")] == 4
    assert m["tangram_capacity"][labels(resource="cpu")] == pytest.approx(8.01)
    assert m["tangram_used"][labels(resource="cpu")] == 2.0
    assert m["tangram_utilisation_ratio"][labels(resource="cpu")] == pytest.approx(2.0 / 8.01)
    assert m["tangram_utilisation_ratio"][labels(resource="gpu")] == pytest.approx(0.25)
    assert m["tangram_worker_utilisation_ratio"][labels(worker="gpu-1", resource="gpu_mem_mb")] == 0.25
    # The local worker reports no use: no per-worker utilisation is invented for it.
    assert labels(worker="local", resource="cpu") not in m["tangram_worker_utilisation_ratio"]
    pool = m["tangram_sandbox_pool"]
    assert pool[labels(worker="cpu-1", image="default", state="warm")] == 3
    assert pool[labels(worker="cpu-1", image="default", state="in_use")] == 2
    assert pool[labels(worker="cpu-1", image="py311", state="target")] == 1
    assert len(pool) == 6
    assert m["tangram_sandbox_sessions"] == {labels(worker="cpu-1"): 2}
    assert m["tangram_sandbox_events_total"][labels(worker="cpu-1", event="warm_hits")] == 5
    assert m["tangram_sandbox_discards_total"] == {labels(worker="cpu-1", reason="exec_died"): 1}
    assert m["tangram_sandbox_reset_ms_mean"] == {labels(worker="cpu-1"): 3.5}
    assert m["tangram_model_loads_total"] == {labels(worker="gpu-1", model="minilm"): 4}
    assert m["tangram_model_evictions_total"] == {labels(worker="gpu-1", model="minilm"): 3}
    assert m["tangram_model_replicas"][labels(worker="gpu-1", model="minilm")] == 1
    assert m["tangram_model_queue_items"][labels(worker="gpu-1", model="minilm")] == 6
    assert m["tangram_device_used_mb"][labels(worker="gpu-1", device="cuda:0")] == 88.0
    assert m["tangram_device_busy"] == {
        labels(worker="gpu-1", device="cuda:0"): 1,
        labels(worker="gpu-1", device="cuda:1"): 0,
    }
    assert m["tangram_device_past_limit_seconds"] == {  # an alert can fire before the worker restarts
        labels(worker="gpu-1", device="cuda:0"): 12.5,
        labels(worker="gpu-1", device="cuda:1"): 0,
    }


def test_a_departed_worker_stops_being_reported(exporter: PrometheusExporter) -> None:
    port = exporter.start(0)
    exporter.update(FIGURES)
    later = {**FIGURES, "workers": {k: v for k, v in FIGURES["workers"].items() if k != "gpu-1"}}  # type: ignore[attr-defined]
    exporter.update(later)
    m = scrape(port)
    assert all(dict(k).get("worker") != "gpu-1" for k in m["tangram_worker_capacity"])
    assert "tangram_model_loads_total" not in m
    assert m["tangram_workers"][()] == 2


def test_without_used_figures_no_utilisation_is_claimed(exporter: PrometheusExporter) -> None:
    port = exporter.start(0)
    workers = {k: {kk: vv for kk, vv in v.items() if kk != "used"} for k, v in FIGURES["workers"].items()}  # type: ignore[attr-defined]
    exporter.update({**FIGURES, "workers": workers})
    m = scrape(port)
    assert m["tangram_capacity"][labels(resource="gpu")] == 2.0
    assert "tangram_utilisation_ratio" not in m and "tangram_used" not in m


def test_malformed_figures_are_tolerated(exporter: PrometheusExporter) -> None:
    port = exporter.start(0)
    exporter.update(
        {
            "pending": "lots",
            "running": None,
            "errors": [1, 2],
            "workers": {
                "w": "not a dict",
                "v": {
                    "capacity": {"cpu": "many", "mem_mb": 5},
                    "figures": {"models": {"m": 3}, "devices": "x"},
                },
            },
        }
    )
    m = scrape(port)
    assert "tangram_queue_length" not in m
    assert m["tangram_worker_capacity"] == {labels(worker="v", resource="mem_mb"): 5}


def test_many_exporters_side_by_side_and_stop() -> None:
    a, b = PrometheusExporter(), PrometheusExporter()
    try:
        pa, pb = a.start(0), b.start(0)
        assert pa != pb
        a.observe_result("x", True, None, 1.0, 0.0)
        assert "tangram_action_completion_seconds_count" in scrape(pa)
        assert "tangram_action_completion_seconds_count" not in scrape(pb)
        with pytest.raises(RuntimeError):
            a.start(0)
    finally:
        a.stop()
        b.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{pa}/metrics", timeout=2)
    with pytest.raises(ValueError):
        PrometheusExporter().start(70000)


def test_real_orchestrator_figures(procs: object) -> None:
    """Figures from a live orchestrator (Client.stats) feed the exporter as they are."""
    from tangram_env import Client
    from tests.cluster.procs import Processes, start_orchestrator

    assert isinstance(procs, Processes)
    _, address = start_orchestrator(procs, "tcp://127.0.0.1:0")
    exp = PrometheusExporter()
    try:
        port = exp.start(0)
        with Client(address) as client:
            for i in range(3):
                assert client.call("echo", {"value": i}) == i
            r = client.run("sleep", {"seconds": 0}, demand={"cpu": 1000.0, "mem_mb": 1})
            assert not r.ok  # larger than any worker: rejected
            figures = client.stats()
        exp.update(figures)
        m = scrape(port)
    finally:
        exp.stop()
    assert m["tangram_finished_total"][()] == figures["finished"] >= 3
    assert m["tangram_workers"][()] == len(figures["workers"]) >= 1
    assert m["tangram_worker_capacity"][labels(worker="local", resource="cpu")] == pytest.approx(0.01)
    assert sum(m["tangram_errors_total"].values()) == sum(figures["errors"].values()) >= 1
