"""API quotas in the scheduler: a token bucket and an in-flight cap per key, several keys, 429 pauses."""

from __future__ import annotations

import pytest

from tangram_env.server.scheduler import ElasticScheduler, FCFSScheduler, TaskIsolatedScheduler
from tangram_env.server.scheduler.events import ActionFinished, ActionThrottled, Start, Tick
from tangram_env.server.scheduler.quotas import ApiQuota, ApiQuotas, QuotaConfig, parse_quota
from tests.server.scheduler.sched_helpers import Driver, arrive, worker

API = "web-search"


def _quotas(**limits: object) -> QuotaConfig:
    return QuotaConfig(apis={API: ApiQuota(**limits)})  # type: ignore[arg-type]


def _searches(n: int, prefix: str = "s") -> list:
    return [arrive(f"{prefix}{i}", kind="search", cpu=0.1, api=API) for i in range(n)]


def test_rate_and_burst_are_a_token_bucket() -> None:
    sched = ElasticScheduler(api_quotas=_quotas(rate=4.0, burst=2))
    drive = Driver(sched)
    drive([worker("w", cpu=64)])
    out = drive(_searches(10), 0.0)
    assert len(drive.starts(out)) == 2  # the burst, not more
    assert sched.next_wakeup(0.0) == pytest.approx(0.25)  # the next token is a wake-up
    out = drive([Tick()], 0.25)
    assert len(drive.starts(out)) == 1
    out = drive([Tick()], 0.3)
    assert not drive.starts(out)  # no token yet
    out = drive([Tick()], 10.0)
    assert len(drive.starts(out)) == 2  # a long idle saves the burst, never more
    # Over a long run the grants follow the rate.
    granted = 5
    for i in range(1, 41):
        granted += len(drive.starts(drive([*_searches(1, f"t{i}-"), Tick()], 10.0 + i * 0.25)))
    assert 5 + 39 <= granted <= 5 + 40  # one token per quarter second, the backlog drained by the rate
    assert sched.api_quotas.snapshot(20.0)[API]["granted"] == granted


def test_in_flight_cap_frees_a_slot_when_an_action_ends() -> None:
    sched = ElasticScheduler(api_quotas=_quotas(rate=100.0, burst=100, max_in_flight=3))
    drive = Driver(sched)
    drive([worker("w", cpu=64)])
    out = drive(_searches(5), 0.0)
    first = list(drive.starts(out))
    assert len(first) == 3
    assert sched.next_wakeup(0.0) is None  # only a finish frees a slot: no timer
    out = drive([ActionFinished(first[0], 0.5)], 0.5)
    assert len(drive.starts(out)) == 1
    assert sched.quota_snapshot()[API]["in_flight"] == 3
    assert sched.quota_snapshot()[API]["waiting"] == 1


def test_several_keys_each_with_its_own_limits_and_the_key_travels_with_the_start() -> None:
    sched = ElasticScheduler(api_quotas=_quotas(rate=1.0, burst=2, max_in_flight=2, keys=["k1", "k2"]))
    drive = Driver(sched)
    drive([worker("w", cpu=64)])
    out = drive(_searches(6), 0.0)
    starts = [d for d in out if isinstance(d, Start)]
    assert len(starts) == 4
    assert sorted(d.api_key or "" for d in starts) == ["k1", "k1", "k2", "k2"]


def test_quota_starved_actions_do_not_block_cpu_work() -> None:
    sched = FCFSScheduler(api_quotas=_quotas(rate=1.0, burst=1))
    drive = Driver(sched)
    drive([worker("w", cpu=4)])
    out = drive(_searches(3) + [arrive(f"cpu{i}", cpu=1) for i in range(3)], 0.0)
    started = drive.starts(out)
    assert {"s0", "cpu0", "cpu1", "cpu2"} <= set(started)
    assert "s1" not in started


def test_429_pauses_the_key_until_retry_after_and_requeues_the_same_action() -> None:
    sched = ElasticScheduler(api_quotas=_quotas(rate=10.0, burst=10, keys=["k1", "k2"]))
    drive = Driver(sched)
    drive([worker("w", cpu=64)])
    out = drive(_searches(2), 0.0)
    on = {d.action_id: d.api_key for d in out if isinstance(d, Start)}
    throttled_key = on["s0"]
    out = drive([ActionThrottled("s0", retry_after_s=5.0)], 0.1)
    # Requeued (same id) and started again at once on the other key: the paused one waits 5 s.
    assert [d.action_id for d in drive.book.requeues] == ["s0"]
    again = [d for d in out if isinstance(d, Start)]
    assert [d.action_id for d in again] == ["s0"] and again[0].api_key != throttled_key
    assert sched.quota_snapshot()[API]["throttled"] == 1
    # Only the paused key left: nothing of the API starts before Retry-After.
    drive([ActionFinished("s0", 0.1), ActionFinished("s1", 0.1)], 0.2)
    sched2 = ElasticScheduler(api_quotas=_quotas(rate=10.0, burst=10))
    drive2 = Driver(sched2)
    drive2([worker("w", cpu=64)])
    drive2(_searches(1), 0.0)
    out = drive2([ActionThrottled("s0", retry_after_s=2.0)], 0.1)
    assert not drive2.starts(out)
    assert sched2.next_wakeup(0.1) == pytest.approx(2.1)
    assert not drive2.starts(drive2([Tick()], 1.0))
    assert list(drive2.starts(drive2([Tick()], 2.1))) == ["s0"]


def test_task_isolated_keeps_its_env_shares_and_the_api_quota() -> None:
    sched = TaskIsolatedScheduler(quotas={"a": 0.5}, api_quotas=_quotas(rate=1.0, burst=1))
    drive = Driver(sched)
    drive([worker("w", cpu=4)])
    out = drive([arrive(f"x{i}", kind="search", api=API, env_id="a") for i in range(3)], 0.0)
    assert len(drive.starts(out)) == 1


def test_unlisted_api_is_unlimited_and_the_flag_parses() -> None:
    sched = ElasticScheduler(api_quotas=_quotas(rate=1.0))
    drive = Driver(sched)
    drive([worker("w", cpu=64)])
    out = drive([arrive(f"o{i}", cpu=0.1, api="other") for i in range(5)], 0.0)
    assert len(drive.starts(out)) == 5
    api, quota = parse_quota("web-search:rate=20,burst=5,in_flight=4,keys=a+b")
    assert (api, quota.rate, quota.bucket_size, quota.max_in_flight, quota.keys) == (
        "web-search",
        20.0,
        5.0,
        4,
        ["a", "b"],
    )
    with pytest.raises(ValueError, match="cannot read"):
        parse_quota("web-search:speed=3")
    with pytest.raises(ValueError, match="distinct"):
        ApiQuota(rate=1, keys=["a", "a"])


def test_bucket_never_exceeds_burst() -> None:
    q = ApiQuotas(_quotas(rate=5.0, burst=3))
    assert q.pick(API, 0.0) == "default"
    for _ in range(3):
        q.take(API, "default", 0.0)
    assert q.pick(API, 0.0) is None and q.next_wakeup() == pytest.approx(0.2)
    q.validate()
    assert q.snapshot(100.0)[API]["keys"]["default"]["tokens"] == 3.0


@pytest.mark.parametrize("seed", range(5))
def test_random_runs_never_exceed_a_keys_rate_burst_or_cap(seed: int) -> None:
    import random

    from tangram_env.server.scheduler.events import WorkerRemoved

    rng = random.Random(seed)
    rate, burst, cap = 5.0, 3, 2
    sched = ElasticScheduler(api_quotas=_quotas(rate=rate, burst=burst, max_in_flight=cap, keys=["a", "b"]))
    drive = Driver(sched)
    drive([worker("w1", cpu=8), worker("w2", cpu=8)], 0.0)
    grants: dict[str, list[float]] = {"a": [], "b": []}
    running: dict[str, str] = {}
    now, n = 0.0, 0
    for _ in range(300):
        now += rng.expovariate(20.0)
        events: list = []
        roll = rng.random()
        if roll < 0.4:
            events += [arrive(f"x{n}", kind="search", cpu=0.5, api=API)]
            n += 1
        elif roll < 0.75 and running:
            events.append(ActionFinished(rng.choice(sorted(running)), 0.2))
        elif roll < 0.8 and running:
            events.append(ActionThrottled(rng.choice(sorted(running)), retry_after_s=rng.uniform(0, 1)))
        elif roll < 0.82:
            events += [WorkerRemoved("w2"), worker("w2", cpu=8)]  # its actions go back to the queue
        else:
            events.append(Tick())
        for ev in events:
            if isinstance(ev, ActionFinished | ActionThrottled):
                running.pop(ev.action_id, None)
        out = drive(events, now)
        for d in drive.book.requeues:
            running.pop(d.action_id, None)
        drive.book.requeues.clear()
        for d in out:
            if isinstance(d, Start):
                assert d.api_key in grants
                grants[d.api_key].append(now)
                running[d.action_id] = d.api_key
        for key in grants:
            assert sum(1 for k in running.values() if k == key) <= cap
    for times in grants.values():
        for i, t0 in enumerate(times):  # any window [t0, t1] holds at most burst + rate x (t1 - t0) grants
            for j in range(i, len(times)):
                assert j - i + 1 <= burst + rate * (times[j] - t0) + 1e-6
    assert sum(map(len, grants.values())) > 50


def test_quota_starved_names_what_the_keys_cannot_start_now() -> None:
    # What Ray's autoscaler is asked for leaves these out: more cores would not start them sooner.
    sched = ElasticScheduler(api_quotas=_quotas(rate=1.0, burst=2, max_in_flight=1))
    drive = Driver(sched)
    assert sched.quota_starved() == set()
    drive(_searches(5), 0.0)  # no worker yet: all pending, and the key could start one (its cap)
    assert sched.quota_starved() == {"s1", "s2", "s3", "s4"}
    drive([worker("w", cpu=64)], 0.5)  # s0 starts; the cap is full: none of the rest could start
    assert sched.quota_starved() == {"s1", "s2", "s3", "s4"}
    drive([ActionFinished("s0", 0.1)], 1.0)  # s1 starts at once on the freed slot
    assert sched.running() == 1 and sched.quota_starved() == {"s2", "s3", "s4"}
