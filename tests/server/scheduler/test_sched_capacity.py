"""Capacity changes: workers joining, leaving, re-registering; sessions that lived on them."""

from __future__ import annotations

from tangram_env.server.scheduler import ElasticScheduler, FCFSScheduler, TaskIsolatedScheduler
from tangram_env.server.scheduler.events import ActionFinished, Requeue, SessionClosed, Tick, WorkerRemoved
from tests.server.scheduler.sched_helpers import Driver, arrive, worker


def test_added_capacity_starts_waiting_actions() -> None:
    drive = Driver(ElasticScheduler())
    drive([arrive("a"), arrive("b")])
    assert drive.sched.pending() == 2  # no worker yet: nothing to reject, nothing to start
    out = drive([worker("w", cpu=1)], 1.0)
    assert len(drive.starts(out)) == 1
    out = drive([worker("w2", cpu=1)], 2.0)
    assert len(drive.starts(out)) == 1 and drive.sched.pending() == 0


def test_a_departed_workers_actions_are_requeued_and_restart_elsewhere() -> None:
    drive = Driver(ElasticScheduler())
    drive([worker("w1", cpu=2), arrive("a", affinity="S", image="img"), arrive("b")])
    assert {s.worker_id for s in drive.book.starts} == {"w1"}
    out = drive([WorkerRemoved("w1")], 1.0)
    assert sorted(d.action_id for d in out if isinstance(d, Requeue)) == ["a", "b"]
    assert drive.sched.pending() == 2 and drive.sched.running() == 0
    assert drive.sched.held().cpu == 0
    out = drive([worker("w2", cpu=2)], 2.0)
    assert {d.worker_id for d in drive.starts(out).values()} == {"w2"}
    assert [s[2] for s in drive.sched.story("a")] == ["pending", "running", "pending", "running"]
    # The session moved with it: later actions of the session follow it to w2.
    drive([ActionFinished("a", 1.0)], 3.0)
    assert drive.starts(drive([arrive("a2", affinity="S", image="img")], 3.0))["a2"].worker_id == "w2"


def test_session_actions_wait_for_their_worker_and_move_when_it_dies() -> None:
    drive = Driver(ElasticScheduler())
    drive([worker("w1", cpu=1), worker("w2", cpu=1)])
    first = drive.starts(drive([arrive("x1", affinity="S")]))["x1"].worker_id
    other = "w2" if first == "w1" else "w1"
    out = drive([arrive("x2", affinity="S")], 1.0)
    assert not drive.starts(out)  # its sandbox's worker is busy; the other worker cannot run it
    out = drive([WorkerRemoved(first)], 2.0)
    assert drive.starts(out)["x1"].worker_id == other  # requeued, in a fresh session elsewhere
    assert drive.sched.pending() == 1  # x2 follows the session there and waits behind x1
    out = drive([ActionFinished("x1", 1.0)], 3.0)
    assert drive.starts(out)["x2"].worker_id == other
    drive([SessionClosed("S")], 4.0)


def test_reregistration_is_idempotent_and_a_changed_worker_is_replaced() -> None:
    drive = Driver(ElasticScheduler())
    drive([worker("w", cpu=2), arrive("a")])
    assert drive([worker("w", cpu=2)], 1.0) == []  # same capacity: nothing happens
    assert drive.sched.running() == 1
    out = drive([worker("w", cpu=4)], 2.0)
    assert any(isinstance(d, Requeue) for d in out)  # a different worker under the old name
    assert drive.starts(out)["a"].worker_id == "w"


def test_removing_all_capacity_keeps_actions_waiting() -> None:
    for sched in (ElasticScheduler(), FCFSScheduler(), TaskIsolatedScheduler({"e": 0.5})):
        drive = Driver(sched)
        drive([worker("w", cpu=2), arrive("a", env_id="e"), arrive("b", env_id="e")])
        drive([WorkerRemoved("w"), WorkerRemoved("w")], 1.0)
        assert sched.pending() == 2 and sched.running() == 0
        out = drive([worker("w", cpu=2)], 2.0)
        assert len(drive.starts(out)) == (1 if isinstance(sched, TaskIsolatedScheduler) else 2)


def test_with_await_capacity_what_no_worker_fits_waits_for_one_that_does() -> None:
    # A Ray orchestrator's own small worker serves every kind: a GPU action (or one of two cores) waits
    # for the node the autoscaler adds instead of being rejected before it can join.
    sched = ElasticScheduler(await_capacity_s=60.0)
    drive = Driver(sched)
    drive([worker("local", cpu=0.5), arrive("g", cpu=1, gpu=1), arrive("big", cpu=2)])
    assert not drive.book.rejects and sched.pending() == 2
    assert sched.next_wakeup(0.0) == 60.0  # when the first of them gives up
    out = drive([worker("gpu-node", cpu=4, gpu=1)], 10.0)
    assert set(drive.starts(out)) == {"g", "big"} and not drive.book.rejects


def test_with_await_capacity_nothing_joining_rejects_at_its_end() -> None:
    sched = ElasticScheduler(await_capacity_s=60.0)
    drive = Driver(sched)
    drive([worker("local", cpu=0.5), arrive("g", cpu=1, gpu=1)])
    drive([arrive("h", cpu=1, gpu=1)], 30.0)
    drive([Tick()], 59.0)
    assert not drive.book.rejects
    drive([Tick()], 60.0)
    assert [r.action_id for r in drive.book.rejects] == ["g"]
    assert "none that could joined within 60s" in drive.book.rejects[0].reason
    assert sched.next_wakeup(60.0) == 90.0
    drive([Tick()], 90.0)
    assert [r.action_id for r in drive.book.rejects] == ["g", "h"] and sched.pending() == 0


def test_without_await_capacity_what_no_worker_fits_is_rejected_at_once() -> None:
    drive = Driver(ElasticScheduler())
    drive([worker("local", cpu=0.5), arrive("g", cpu=1, gpu=1)])
    assert [r.action_id for r in drive.book.rejects] == ["g"]
    assert "can ever fit" in drive.book.rejects[0].reason and "joined" not in drive.book.rejects[0].reason
