"""A live sandbox holds its memory in the ledger from the action that opens it to its SessionClosed."""

from __future__ import annotations

from tangram_env.server.scheduler import ElasticScheduler, FCFSScheduler
from tangram_env.server.scheduler.events import ActionFinished, SessionClosed
from tests.server.scheduler.sched_helpers import Driver, arrive, worker


def _open(action_id: str, session: str, sandbox_mb: float = 3000, **kw: object) -> object:
    return arrive(action_id, mem=0, affinity=session, image="img", sandbox_mem_mb=sandbox_mb, **kw)


def test_memory_is_held_between_actions_and_freed_at_close() -> None:
    sched = ElasticScheduler()
    drive = Driver(sched)
    drive([worker("w", cpu=4, mem=8000)])
    assert set(drive.starts(drive([_open("a0", "S")]))) == {"a0"}
    assert sched.held().mem_mb == 3000
    drive([ActionFinished("a0", 1.0)], 1.0)
    assert sched.held().mem_mb == 3000 and sched.held().cpu == 0  # idle: no cores, its memory still lent
    out = drive([_open("a1", "S")], 2.0)  # the session's next action: no second sandbox
    assert set(drive.starts(out)) == {"a1"} and sched.held().mem_mb == 3000
    drive([ActionFinished("a1", 1.0), SessionClosed("S")], 3.0)
    assert sched.held().mem_mb == 0 and sched.held().cpu == 0


def test_a_new_sandbox_waits_for_memory_that_idle_sandboxes_hold() -> None:
    for sched in (ElasticScheduler(), FCFSScheduler()):
        drive = Driver(sched)
        drive([worker("w", cpu=8, mem=8000)])
        out = drive([_open("a", "A"), _open("b", "B"), _open("c", "C")])
        assert set(drive.starts(out)) == {"a", "b"}  # 2 x 3000 MiB fit in 8000; a third does not
        out = drive([ActionFinished("a", 1.0), ActionFinished("b", 1.0)], 1.0)
        assert not drive.starts(out)  # idle sandboxes still hold their memory: cores alone do not help
        out = drive([SessionClosed("A")], 2.0)
        assert set(drive.starts(out)) == {"c"}


def test_actions_of_live_sessions_run_while_a_new_one_reserves_the_worker() -> None:
    # An overdue new session reserves the worker for the memory it waits for; the sessions living
    # there must still run their actions, or their memory (what it waits for) would never free.
    sched = ElasticScheduler(reserve_after_s=0.0)
    drive = Driver(sched)
    drive([worker("w", cpu=8, mem=8000)])
    drive([_open("a0", "A"), _open("b0", "B")])
    drive([ActionFinished("a0", 1.0), ActionFinished("b0", 1.0)], 1.0)
    drive([_open("c0", "C")], 2.0)  # blocked on memory, overdue at once: reserves the worker
    out = drive([_open("a1", "A")], 3.0)
    assert set(drive.starts(out)) == {"a1"}
    drive([ActionFinished("a1", 1.0), SessionClosed("A")], 4.0)
    assert sched.running() == 1 and sched.pending() == 0  # c0 started in A's memory


def test_a_sandbox_larger_than_any_worker_is_rejected_with_the_reason() -> None:
    drive = Driver(ElasticScheduler())
    drive([worker("w", cpu=8, mem=8000)])
    out = drive([_open("x", "X", sandbox_mb=9000)])
    assert drive.book.rejects and "can ever fit" in drive.book.rejects[0].reason and not drive.starts(out)


def test_a_negative_sandbox_memory_is_rejected() -> None:
    drive = Driver(ElasticScheduler())
    drive([worker("w", cpu=8, mem=8000)])
    drive([_open("x", "X", sandbox_mb=-1)])
    assert "sandbox_mem_mb" in drive.book.rejects[0].reason
