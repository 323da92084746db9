"""Reward scoring batched across trajectories, and reward models tracked per GPU device."""

from __future__ import annotations

from tangram_env.server.scheduler import ElasticScheduler, FCFSScheduler
from tangram_env.server.scheduler.devices import Devices
from tangram_env.server.scheduler.events import ActionFinished, Tick, WorkerRemoved
from tests.server.scheduler.sched_helpers import Driver, arrive, worker


def _score(i: int) -> object:
    return arrive(f"s{i}", kind="score", cpu=1, mem=100, gpu=1, gmem=1000, hi=2)


def test_gpu_requests_of_one_model_start_as_one_batch() -> None:
    for sched in (ElasticScheduler(batch_max=3), FCFSScheduler(batch_max=3)):
        drive = Driver(sched)
        drive([worker("g", cpu=8, mem=8000, gpu=1, gmem=2000, kinds=frozenset({"score"}))])
        out = drive([_score(i) for i in range(4)])
        starts = drive.starts(out)
        batches = [(s.action_id, s.batch_of) for s in starts.values()]
        assert batches == [("s0", None), ("s1", "s0"), ("s2", "s0")]
        assert {s.parallelism for s in starts.values()} == {1}  # riders run at their leader's width
        assert sched.held().gpu == 1 and sched.running() == 3  # riders hold nothing of their own
        out = drive([ActionFinished(f"s{i}", 2.0) for i in range(3)], 2.0)
        assert set(drive.starts(out)) == {"s3"}
        assert sched.held().gpu == 1


def test_batching_off_and_riders_requeued_with_their_worker() -> None:
    drive = Driver(ElasticScheduler(batch_max=1))
    drive([worker("g", cpu=8, mem=8000, gpu=2, gmem=4000, kinds=frozenset({"score"}))])
    starts = drive.starts(drive([_score(i) for i in range(3)]))
    assert all(s.batch_of is None for s in starts.values()) and len(starts) == 2
    sched = ElasticScheduler(batch_max=4)
    drive = Driver(sched)
    drive([worker("g", cpu=8, mem=8000, gpu=1, gmem=2000, kinds=frozenset({"score"}))])
    drive([_score(i) for i in range(3)])
    out = drive([WorkerRemoved("g")], 1.0)
    assert sched.pending() == 3 and sched.running() == 0 and len(out) == 3  # three Requeues
    out = drive([worker("h", cpu=8, mem=8000, gpu=1, gmem=2000, kinds=frozenset({"score"}))], 2.0)
    assert len(drive.starts(out)) == 3


def test_devices_prefer_the_model_then_the_emptiest_and_evict_the_least_recent_idle() -> None:
    dev = Devices(2, mem_mb=100)
    chosen, cold, evicted = dev.take("a", 1, 60)
    assert chosen == (0,) and cold and evicted == []
    assert not dev.warm("a", 1)  # its only device is lent out
    dev.give("a", chosen, 1)
    assert dev.warm("a", 1) and not dev.warm("b", 1)
    chosen, cold, _ = dev.take("b", 1, 60)  # the empty device, not the one holding "a"
    assert chosen == (1,) and cold
    dev.give("b", chosen, 1)
    assert not dev.warm("a", 2)  # a 2-GPU grant would find "a" on one device only
    chosen, cold, evicted = dev.take("c", 2, 60)  # both devices: "a" and "b" are evicted
    assert chosen == (0, 1) and cold and sorted(evicted) == ["a", "b"]
    assert not dev.holds("a") and dev.holds("c")
    half = Devices(1, mem_mb=100)
    first, _, _ = half.take("a", 0.5, 10)
    second, cold, _ = half.take("a", 0.5, 10)  # two half-GPU grants share one device
    assert first == second == (0,) and not cold
    assert half.take("a", 0.5, 10)[0] == ()  # none free: the model disagrees with the ledger, lends none


def test_only_what_cannot_start_alone_joins_a_batch() -> None:
    drive = Driver(ElasticScheduler(batch_max=4))
    drive([worker("g", cpu=8, mem=8000, gpu=2, gmem=4000, kinds=frozenset({"score"}))])
    starts = drive.starts(drive([_score(i) for i in range(5)]))
    # Two GPUs: two requests start on their own; the rest join their batches, the smallest first.
    assert [(s.action_id, s.batch_of) for s in starts.values()] == [
        ("s0", None),
        ("s1", None),
        ("s2", "s0"),
        ("s3", "s1"),
        ("s4", "s0"),
    ]


def test_a_reservation_holds_only_the_units_its_action_needs() -> None:
    sched = ElasticScheduler(batch_max=1)
    drive = Driver(sched)
    drive([worker("g", cpu=8, mem=8000, gpu=2, gmem=4000)])
    drive([_score(0)])  # one of the two GPUs busy
    drive([arrive("j", kind="judge", gpu=1, gmem=1000, lo=2, hi=2)], 1.0)  # needs both: it waits
    drive([Tick()], 40.0)  # overdue: it reserves the worker, holding the free GPU
    assert sched.snapshot()["reservations"] == 1 and sched.held().gpu == 2
    out = drive([arrive("b", kind="bash", cpu=1)], 41.0)
    assert set(drive.starts(out)) == {"b"}  # the cores it does not need stay usable
    out = drive([arrive("s9", kind="score", cpu=1, mem=100, gpu=1, gmem=1000, hi=2)], 42.0)
    assert not drive.starts(out)  # the held GPU is not lent to another GPU action
    out = drive([ActionFinished("s0", 2.0)], 43.0)
    assert set(drive.starts(out)) == {"j"}


def test_overdue_actions_reserve_oldest_first_whatever_their_class() -> None:
    # A worker holds for one action at a time. The judge's class is older (created first) but its
    # waiting head arrived after the single-GPU request's: the older request gets the reservation.
    for sched in (ElasticScheduler(batch_max=1), FCFSScheduler(batch_max=1)):
        drive = Driver(sched)
        drive([worker("g", cpu=8, mem=8000, gpu=2, gmem=4000)])
        judge = {"kind": "judge", "gpu": 1, "gmem": 1000, "lo": 2, "hi": 2}
        drive([arrive("j0", **judge)])
        drive([ActionFinished("j0", 0.5)], 0.5)  # the judge's class exists, idle
        drive([_score(0), _score(1)], 1.0)  # both GPUs busy
        drive([arrive("c", kind="classify", gpu=1, gmem=1000)], 2.0)
        drive([arrive("j1", **judge)], 3.0)
        drive([Tick()], 40.0)  # both overdue: the worker is reserved for "c", which came first
        out = drive([ActionFinished("s0", 39.0)], 41.0)
        assert set(drive.starts(out)) == {"c"}, type(sched).__name__
