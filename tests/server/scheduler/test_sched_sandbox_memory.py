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
    assert "9000 MiB its new sandbox holds" in drive.book.rejects[0].reason


def test_a_negative_sandbox_memory_is_rejected() -> None:
    drive = Driver(ElasticScheduler())
    drive([worker("w", cpu=8, mem=8000)])
    drive([_open("x", "X", sandbox_mb=-1)])
    assert "sandbox_mem_mb" in drive.book.rejects[0].reason


def test_idle_sandboxes_never_pin_the_memory_their_own_commands_need() -> None:
    # Four sandboxes pin 500 MiB each and run 1,500 MiB commands on a 4,000 MiB worker. A fifth with
    # small commands fits (1,500 MiB stay free of pins); a sixth would leave 1,000 MiB, and then no
    # command of the first four could ever start again, nor their sessions end to free memory (the
    # mixed fleet's smallest pool stopped that way with 55 actions pending and none running). It waits
    # for a session to close instead.
    def command(action_id: str, session: str, mem: float) -> object:
        return arrive(action_id, mem=mem, affinity=session, image="img", sandbox_mem_mb=500)

    for sched in (ElasticScheduler(), FCFSScheduler()):
        drive = Driver(sched)
        drive([worker("w", cpu=4, mem=4000)])
        t = 0.0
        for s, mem in (("A", 1500), ("B", 1500), ("C", 1500), ("D", 1500), ("S1", 200)):
            assert set(drive.starts(drive([command(f"{s}0", s, mem)], t))) == {f"{s}0"}
            drive([ActionFinished(f"{s}0", 1.0)], t + 1.0)
            t += 2.0
        assert set(drive.starts(drive([command("A1", "A", 1500)], t))) == {"A1"}
        assert not drive.starts(drive([command("S20", "S2", 200)], t + 0.5))
        assert not drive.starts(drive([ActionFinished("A1", 1.0)], t + 1.0))  # S2 must not pin here
        assert set(drive.starts(drive([command("B1", "B", 1500)], t + 1.5))) == {"B1"}
        drive([ActionFinished("B1", 1.0)], t + 2.5)
        assert set(drive.starts(drive([SessionClosed("A")], t + 3.0))) == {"S20"}


def test_a_command_that_cannot_fit_beside_its_own_sandbox_is_rejected_not_left_waiting() -> None:
    # A session opened by a small action on a 1,024 MiB worker pins 128 MiB; a 1,024 MiB command of
    # it fitted the worker's size, so it queued, and waited forever for memory its own sandbox held.
    for sched in (ElasticScheduler(), FCFSScheduler()):
        drive = Driver(sched)
        drive([worker("w", cpu=4, mem=1024)])
        opened = arrive("write", mem=128, affinity="S", image="img", sandbox_mem_mb=128)
        assert set(drive.starts(drive([opened]))) == {"write"}
        drive([ActionFinished("write", 0.1)], 1.0)
        big = arrive("bash", mem=1024, affinity="S", image="img", sandbox_mem_mb=128)
        out = drive([big], 2.0)
        assert not drive.starts(out) and sched.pending() == 0
        (reject,) = drive.book.rejects
        assert "beside the 128 MiB its sandbox holds" in reject.reason and "reserve_mb" in reject.reason
        ok = arrive("small", mem=896, affinity="S", image="img", sandbox_mem_mb=128)
        assert set(drive.starts(drive([ok], 3.0))) == {"small"}
