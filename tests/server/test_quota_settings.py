"""API quota settings at the edge, and the figures they produce in Prometheus."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tangram_env.server.config import ServerSettings
from tangram_env.server.prometheus import families_from_figures
from tangram_env.server.quota_hooks import scheduler_options
from tangram_env.server.scheduler import ElasticScheduler, make_scheduler
from tangram_env.server.scheduler.events import ActionArrived, Resources, WorkerAdded


def test_quotas_read_from_the_environment_reach_the_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "TANGRAM_SERVER_QUOTAS", '{"apis": {"web-search": {"rate": 19, "burst": 4, "keys": ["a", "b"]}}}'
    )
    settings = ServerSettings()
    sched = make_scheduler("elastic", **scheduler_options(settings))
    assert isinstance(sched, ElasticScheduler)
    assert sched.api_quotas.config.apis["web-search"].keys == ["a", "b"]
    monkeypatch.delenv("TANGRAM_SERVER_QUOTAS")
    assert scheduler_options(ServerSettings()) == {}  # no quota: the scheduler is built as before


def test_trajectory_bound_cannot_enforce_quotas_and_says_so() -> None:
    with pytest.raises(ValidationError, match="drop --quota or pick another --scheduler"):
        ServerSettings(scheduler="trajectory_bound", quotas={"apis": {"web-search": {"rate": 1}}})


def test_quota_figures_become_prometheus_series() -> None:
    sched = make_scheduler("elastic", api_quotas={"apis": {"web-search": {"rate": 1, "keys": ["k1"]}}})
    sched.handle([WorkerAdded("w", Resources(4, 4096))], 0.0)
    arrivals = [ActionArrived(f"a{i}", "search", Resources(0.1, 10), api="web-search") for i in range(3)]
    sched.handle(arrivals, 0.0)
    figures = {"api_quotas": sched.quota_snapshot()}
    series = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in families_from_figures(figures)
        for s in m.samples
    }
    assert series[("tangram_api_waiting", (("api", "web-search"),))] == 2
    key = (("api", "web-search"), ("key", "k1"))
    assert series[("tangram_api_in_flight", key)] == 1
    assert series[("tangram_api_granted_total", key)] == 1
    assert series[("tangram_api_throttled_total", key)] == 0
    assert series[("tangram_api_tokens", key)] == 0


def test_stats_view_shows_each_keys_budget() -> None:
    from rich.console import Console

    from tangram_env.server.stats_view import render

    sched = make_scheduler("elastic", api_quotas={"apis": {"web-search": {"rate": 1, "keys": ["k1", "k2"]}}})
    sched.handle([WorkerAdded("w", Resources(4, 4096))], 0.0)
    arrivals = [ActionArrived(f"a{i}", "search", Resources(0.1, 10), api="web-search") for i in range(5)]
    sched.handle(arrivals, 0.0)
    console = Console(width=120, record=True)
    console.print(render({"api_quotas": sched.quota_snapshot()}))
    text = console.export_text()
    assert "API quotas" in text and "k1" in text and "k2" in text
    assert "web-search" in text and " 3 " in text  # three actions wait for a token
