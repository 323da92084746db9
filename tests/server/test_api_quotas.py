"""API quotas end to end: a real orchestrator, real workers' tools, the real local search service.

The service enforces its own per-key quota and answers 429 beyond it, so every test reads the
service's counters to see what the API saw. The orchestrator's quota is set a little under the
service's, as a deployment would, so that the jitter between a grant and the request's arrival never
overdraws the provider's bucket.
"""

from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tangram_env import Action, Client, launch
from tangram_env.envs.deep_search.service import ServiceProcess
from tests.envs.deep_search.tiny import build_tiny_index

ROOT = Path(__file__).resolve().parents[2]
SECRETS = {"k1": "secret-one", "k2": "secret-two"}
ENV = {
    **os.environ,
    "PYTHONPATH": str(ROOT),
    **{f"TANGRAM_API_KEY_{k.upper()}": v for k, v in SECRETS.items()},
}


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_index(tmp_path_factory.mktemp("quota-index"))[0]


def _server(
    *quotas: str, extra: tuple[str, ...] = (), bind: str = "tcp://127.0.0.1:0"
) -> launch.ServerProcess:
    args = [a for q in quotas for a in ("--quota", q)]
    return launch.ServerProcess(
        "--no-entry-points",  # only the search tools: no torch to import, a quicker start
        "--plugin",
        "tangram_env.envs.deep_search.tools",
        "--no-gpu-worker",
        *args,
        *extra,
        bind=bind,
        env=ENV,
        cwd=ROOT,
    )


def _searches(url: str, n: int, prefix: str = "q") -> list[Action]:
    return [
        Action(id=f"{prefix}{i}", kind="deep_search.search", payload={"query": "river", "endpoint": url})
        for i in range(n)
    ]


def _run(address: str, actions: list[Action]) -> list[Any]:
    with Client(address) as client:
        return [f.result(120) for f in client.submit(actions)]


@pytest.fixture
def service(index: Path) -> Iterator[Any]:
    started: list[ServiceProcess] = []

    def start(*args: str) -> ServiceProcess:
        svc = ServiceProcess(index, *args)
        started.append(svc)
        return svc

    yield start
    for svc in started:
        svc.stop()


def test_rate_and_burst_hold_at_the_service_with_no_429(service: Any) -> None:
    svc = service("--key", SECRETS["k1"], "--rate", "10", "--burst", "3")
    with _server("web-search:rate=8,burst=2,keys=k1") as srv:
        t0 = time.monotonic()
        results = _run(srv.address, _searches(svc.url, 18))
        wall = time.monotonic() - t0
    assert all(r.ok for r in results), [r.message for r in results if not r.ok][:3]
    assert all(r.value["results"][0]["id"] == "river" for r in results)
    stats = svc.stats()
    assert stats["accepted"] == 18 and stats["throttled"] == 0
    # 2 at once, then 8 a second: the last grant comes 2 s after the first, whatever the machine's speed.
    assert wall >= (18 - 2) / 8 - 0.05
    spread = stats["keys"]["key0"]["last_at"] - stats["keys"]["key0"]["first_at"]
    assert spread >= (18 - 2) / 8 - 0.1


def test_in_flight_cap_holds_with_a_slow_api(service: Any) -> None:
    svc = service("--max-in-flight", "2", "--latency-ms", "300")
    with _server("web-search:rate=100,in_flight=2") as srv:
        results = _run(srv.address, _searches(svc.url, 8))
        with Client(srv.address) as client:
            srv_stats = client.stats()
    stats = svc.stats()
    assert all(r.ok for r in results)
    assert stats["peak_in_flight"] == 2 and stats["throttled"] == 0 and stats["accepted"] == 8
    quota = srv_stats["api_quotas"]["web-search"]
    assert quota["granted"] == 8 and quota["in_flight"] == 0 and quota["waiting"] == 0


def test_several_keys_share_the_work_and_the_secret_never_travels(service: Any) -> None:
    svc = service("--key", SECRETS["k1"], "--key", SECRETS["k2"], "--rate", "5", "--burst", "2")
    with _server("web-search:rate=4,burst=1,keys=k1+k2") as srv:
        t0 = time.monotonic()
        results = _run(srv.address, _searches(svc.url, 16))
        wall = time.monotonic() - t0
        with Client(srv.address) as client:
            quota = client.stats()["api_quotas"]["web-search"]
    stats = svc.stats()
    assert all(r.ok for r in results) and stats["throttled"] == 0
    per_key = [k["accepted"] for k in stats["keys"].values()]
    assert sorted(per_key) == [8, 8] or min(per_key) >= 6, per_key  # both keys carry the load
    assert set(quota["keys"]) == {"k1", "k2"}  # names in the figures, secrets nowhere
    assert SECRETS["k1"] not in repr(quota) and SECRETS["k1"] not in repr([r.model_dump() for r in results])
    assert wall < (16 - 1) / 4  # faster than one key alone could go


def test_a_429_requeues_the_action_pauses_the_key_and_the_agent_never_sees_it(service: Any) -> None:
    # The orchestrator believes in 50 requests a second; the API allows 4 (burst 1): it answers 429s.
    svc = service("--key", SECRETS["k1"], "--rate", "4", "--burst", "1")
    with _server("web-search:rate=50,burst=10,keys=k1") as srv:
        results = _run(srv.address, _searches(svc.url, 10))
        with Client(srv.address) as client:
            figures = client.stats()
    stats = svc.stats()
    assert all(r.ok for r in results), [(r.error_type, r.message) for r in results if not r.ok]
    assert stats["throttled"] >= 1
    assert stats["accepted"] == 10  # each action reached the API's work exactly once
    quota = figures["api_quotas"]["web-search"]
    assert quota["throttled"] == stats["throttled"] and quota["granted"] == 10 + stats["throttled"]
    assert "throttled" not in figures["errors"]  # no client was told


def test_an_api_that_always_answers_429_fails_the_action_after_max_throttles(service: Any) -> None:
    # A key out of its allowance for good (or a quota set over the provider's) must not requeue forever.
    svc = service("--key", SECRETS["k1"], "--max-in-flight", "0")  # every request: 429, Retry-After 0.05 s
    with _server("web-search:rate=50,burst=10,keys=k1") as srv:
        (result,) = _run(srv.address, _searches(svc.url, 1))
    assert result.error_type == "throttled" and "answered 429 11 times" in (result.message or "")
    assert "--quota" in (result.message or "")
    assert svc.stats()["throttled"] == 11 and svc.stats()["accepted"] == 0


def test_several_trainers_share_one_quota(service: Any) -> None:
    svc = service("--key", SECRETS["k1"], "--rate", "10", "--burst", "3", "--max-in-flight", "3")
    with _server("web-search:rate=8,burst=2,in_flight=3,keys=k1") as srv:
        code = (
            "import sys; from tangram_env import Action, Client\n"
            "url, address, name = sys.argv[1:]\n"
            "with Client(address) as c:\n"
            "    acts = [Action(id=f'{name}-{i}', kind='deep_search.search',"
            " payload={'query': 'ferry', 'endpoint': url}) for i in range(6)]\n"
            "    assert all(f.result(120).ok for f in c.submit(acts))\n"
        )
        trainers = [
            subprocess.Popen([sys.executable, "-c", code, svc.url, srv.address, f"t{i}"], env=ENV, cwd=ROOT)
            for i in range(3)
        ]
        assert [p.wait(180) for p in trainers] == [0, 0, 0]
    stats = svc.stats()
    assert stats["accepted"] == 18 and stats["throttled"] == 0 and stats["peak_in_flight"] <= 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_orchestrator_restart_mid_run_keeps_the_queue_and_the_quota(service: Any, tmp_path: Path) -> None:
    svc = service("--key", SECRETS["k1"], "--rate", "10", "--burst", "2")
    port, db = _free_port(), tmp_path / "state.sqlite"
    quota = "web-search:rate=4,burst=1,keys=k1"  # slow enough that the restart lands mid-run
    bind, extra = f"tcp://127.0.0.1:{port}", ("--state-db", str(db))
    srv = _server(quota, extra=extra, bind=bind)
    client = Client(srv.address, connect_timeout_s=30, server_timeout_s=60)
    try:
        futures = client.submit(_searches(svc.url, 16, "r"))
        deadline = time.monotonic() + 30
        while sum(f.done() for f in futures) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        srv.stop()
        srv = _server(
            quota, extra=extra, bind=bind
        )  # same address and state: the client reconnects, resubmits
        outcomes = collections.Counter()
        for fut in futures:
            result = fut.result(120)
            outcomes["ok" if result.ok else result.error_type or "error"] += 1
            assert result.error_type != "throttled"
    finally:
        client.close()
        srv.stop()
    stats = svc.stats()
    assert outcomes["ok"] >= 14 and sum(outcomes.values()) == 16, outcomes  # only those running are lost
    assert stats["throttled"] == 0
    assert stats["accepted"] <= 16  # nothing ran twice


def test_quota_flag_errors_name_the_fix() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tangram_env.server", "--quota", "web-search:speed=3"],
        env=ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "cannot read 'speed=3'" in proc.stderr


def test_a_retry_after_past_a_day_pauses_the_key_a_day_not_a_second() -> None:
    from tangram_env.protocol import Result
    from tangram_env.server.quota_hooks import MAX_RETRY_AFTER_S, throttle_of

    def pause(retry_after: object) -> float:
        refused = Result.failure("a", "throttled", "429", value={"retry_after_s": retry_after})
        event = throttle_of(refused, "k1")
        assert event is not None
        return event.retry_after_s

    assert pause(30) == 30.0 and pause(0) == 0.0
    assert pause(100_000) == MAX_RETRY_AFTER_S == 86_400.0 and pause(float("inf")) == MAX_RETRY_AFTER_S
    assert pause(float("nan")) == pause(-5) == pause("soon") == pause(True) == 1.0  # unreadable: the default
