"""Ageing and reservations: no action starves under a stream of others, with a stated bound.

The bound for ordering (a rigid action that fits once anything frees): an action with estimated run
time ``L`` arriving at ``t0`` has key ``t0 + L / age_rate``-equivalent, so only actions with a smaller
key (``arrival + estimate / age_rate`` below it) go first. It therefore starts no later than the
moment the pool has worked off every action with a smaller key, plus one short action's run time:

    start <= (work of actions with key below its key) / cores + longest short run

The bound for fitting (an action wider than what usually frees): after ``reserve_after_s`` it
reserves a worker, which then drains; it starts within ``reserve_after_s`` + the dispatch scan
(1 s) + the longest run already on that worker.
"""

from __future__ import annotations

from tangram_env.server.scheduler import ElasticScheduler, FCFSScheduler
from tangram_env.server.scheduler.events import ActionArrived
from tests.server.scheduler.sched_helpers import arrive, run_timeline, worker

SHORT_S, LONG_S, CORES = 1.0, 20.0, 4


def _stream(rate: float, until: float) -> list[tuple[float, ActionArrived]]:
    n = int(rate * until)
    return [(i / rate, arrive(f"s{i}", kind="short")) for i in range(n)]


def _duration(action_id: str, k: int) -> float:
    return LONG_S if action_id.startswith("L") else SHORT_S


def _trained(sched: ElasticScheduler) -> ElasticScheduler:
    for _ in range(20):
        sched.estimator.observe("short", 1, SHORT_S)
        sched.estimator.observe("long", 1, LONG_S)
    return sched


def test_long_action_finishes_within_the_bound_under_an_overload_of_short_ones() -> None:
    rate, t0 = 6.0, 10.0  # 6 one-second actions a second on 4 cores: 1.5x overload, the queue only grows
    arrivals = [*_stream(rate, until=90.0), (t0, arrive("L", kind="long"))]
    sched = _trained(ElasticScheduler(reserve_after_s=float("inf")))  # ageing alone
    tl = run_timeline(sched, [worker("w", cpu=CORES)], arrivals, _duration, until=80.0)
    key = t0 + LONG_S  # age_rate 1: expected completion if started at once
    ahead = sum(1 for t, ev in arrivals if ev.action_id != "L" and t + SHORT_S < key)
    start_bound = ahead * SHORT_S / CORES + SHORT_S
    assert "L" in tl.end, "the long action never finished"
    assert tl.start["L"] <= start_bound + 1e-9
    assert tl.end["L"] <= start_bound + LONG_S + 1e-9
    # And it did wait for shorter work that came after it: ordering is by expected completion.
    assert (
        sum(1 for a, s in tl.start.items() if a != "L" and s < tl.start["L"] and int(a[1:]) / rate > t0) > 0
    )


def test_without_ageing_the_long_action_starves() -> None:
    rate, t0 = 6.0, 10.0
    arrivals = [*_stream(rate, until=100.0), (t0, arrive("L", kind="long"))]
    sched = _trained(
        ElasticScheduler(age_rate=0.001, reserve_after_s=float("inf"))
    )  # near pure shortest-first
    tl = run_timeline(sched, [worker("w", cpu=CORES)], arrivals, _duration, until=90.0)
    assert "L" not in tl.start


def test_a_long_action_is_overtaken_only_by_arrivals_within_the_cap_over_the_age_rate() -> None:
    # Estimates above order_cap_s order as order_cap_s: the long action (20 s) is passed over only by
    # short ones that arrive within (cap - short) / age_rate of it, however long it is.
    rate, t0, cap, age = 6.0, 10.0, 5.0, 1.0
    arrivals = [*_stream(rate, until=90.0), (t0, arrive("L", kind="long"))]
    # The queue grows without bound here; the weight of estimates is held at 1 to see the cap alone.
    sched = _trained(
        ElasticScheduler(age_rate=age, order_cap_s=cap, reserve_after_s=float("inf"), wait_aware_order=False)
    )
    tl = run_timeline(sched, [worker("w", cpu=CORES)], arrivals, _duration, until=80.0)
    ahead = sum(1 for t, ev in arrivals if ev.action_id != "L" and t + SHORT_S / age < t0 + cap / age)
    assert tl.start["L"] <= ahead * SHORT_S / CORES + SHORT_S + 1e-9
    uncapped = _trained(
        ElasticScheduler(
            age_rate=age, order_cap_s=float("inf"), reserve_after_s=float("inf"), wait_aware_order=False
        )
    )
    later = run_timeline(uncapped, [worker("w", cpu=CORES)], arrivals, _duration, until=80.0)
    assert later.start["L"] > tl.start["L"] + (LONG_S - cap) * rate / CORES / 2  # it waited for more


def test_reservations_bound_the_wait_even_without_ageing() -> None:
    rate, t0, reserve_after = 6.0, 10.0, 15.0
    arrivals = [*_stream(rate, until=60.0), (t0, arrive("L", kind="long"))]
    sched = _trained(ElasticScheduler(age_rate=0.001, reserve_after_s=reserve_after))
    tl = run_timeline(sched, [worker("w", cpu=CORES)], arrivals, _duration, until=50.0)
    assert tl.start["L"] <= t0 + reserve_after + 1.0 + SHORT_S + 1e-9


def test_a_wide_action_reserves_a_worker_and_starts_within_the_bound() -> None:
    reserve_after = 10.0
    arrivals = [*_stream(5.0, until=120.0), (5.0, arrive("Lwide", kind="wide", cpu=CORES))]
    sched = _trained(ElasticScheduler(reserve_after_s=reserve_after))

    def duration(action_id: str, k: int) -> float:
        return 2.0 if action_id == "Lwide" else SHORT_S

    tl = run_timeline(sched, [worker("w", cpu=CORES)], arrivals, duration, until=300.0)
    assert tl.start["Lwide"] <= 5.0 + reserve_after + 1.0 + SHORT_S + 1e-9
    assert any("reserv" in s[3] or s[2] == "running" for s in sched.story("Lwide"))


def test_without_reservations_the_wide_action_starves() -> None:
    arrivals = [*_stream(5.0, until=120.0), (5.0, arrive("Lwide", kind="wide", cpu=CORES))]
    sched = _trained(ElasticScheduler(reserve_after_s=float("inf")))
    tl = run_timeline(sched, [worker("w", cpu=CORES)], arrivals, _duration, until=100.0)
    assert "Lwide" not in tl.start


def test_fcfs_keeps_arrival_order_within_a_class() -> None:
    arrivals = [(0.0, arrive(f"a{i}", kind="k")) for i in range(6)]
    tl = run_timeline(FCFSScheduler(), [worker("w", cpu=2)], arrivals, lambda a, k: 1.0)
    order = sorted(tl.start, key=lambda a: (tl.start[a], a))
    assert order == [f"a{i}" for i in range(6)]


def test_a_saturated_pool_orders_by_arrival() -> None:
    # 1.5x overload: by t0 every action waits many times its run time, so putting short ones first
    # only moves the wait onto the long one. It starts about where FCFS starts it, not behind the short
    # ones that came up to (order_cap_s - 1) / age_rate = 3 s after it.
    rate, t0 = 6.0, 30.0
    arrivals = [*_stream(rate, until=90.0), (t0, arrive("L", kind="long"))]
    starts = {}
    for name, sched in (
        ("fcfs", FCFSScheduler()),
        ("aware", _trained(ElasticScheduler(reserve_after_s=float("inf")))),
        ("blind", _trained(ElasticScheduler(reserve_after_s=float("inf"), wait_aware_order=False))),
    ):
        tl = run_timeline(sched, [worker("w", cpu=CORES)], arrivals, _duration, until=80.0)
        starts[name] = tl.start["L"]
    assert starts["aware"] <= starts["fcfs"] + 1.0
    assert starts["blind"] >= starts["aware"] + 3.0


def test_an_idle_pool_still_puts_short_actions_first() -> None:
    # Nothing has waited yet: the estimate counts in full, and a short action arriving after a long
    # one goes first when one core frees.
    arrivals = [
        (0.0, arrive("s0", kind="short")),
        (0.1, arrive("L", kind="long")),
        (0.2, arrive("s1", kind="short")),
    ]
    tl = run_timeline(_trained(ElasticScheduler()), [worker("w", cpu=1)], arrivals, _duration)
    assert tl.start["s1"] < tl.start["L"]
