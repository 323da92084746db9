"""The baselines behind the same interface: trajectory-bound slots and replicas, task-isolated quotas."""

from __future__ import annotations

import pytest

from tangram_env.server.scheduler import FCFSScheduler, TaskIsolatedScheduler, TrajectoryBoundScheduler
from tangram_env.server.scheduler.events import (
    ActionCancelled,
    ActionFinished,
    Requeue,
    Resources,
    Tick,
    TrajectoryClosed,
    WorkerRemoved,
)
from tests.server.scheduler.sched_helpers import Driver, arrive, worker


def test_trajectory_bound_slots_are_held_from_first_action_to_close() -> None:
    drive = Driver(TrajectoryBoundScheduler(slot=Resources(2, 1000)))
    drive([worker("w", cpu=4, mem=4000)])
    out = drive([arrive(f"t{i}a0", trajectory_id=f"T{i}", hi=8) for i in range(3)])
    starts = drive.starts(out)
    assert set(starts) == {"t0a0", "t1a0"}  # two slots of two cores; the third trajectory waits
    assert starts["t0a0"].parallelism == 2  # it runs on all of its slot's cores
    assert drive.sched.held().cpu == 4
    drive([ActionFinished("t0a0", 1.0)], 1.0)
    assert drive.sched.held().cpu == 4  # idle, but still held: the trajectory is not closed
    out = drive([arrive("t0a1", trajectory_id="T0")], 2.0)
    assert drive.starts(out)["t0a1"].parallelism == 1  # a rigid action: one unit even in a 2-core slot
    out = drive([ActionFinished("t0a1", 1.0), TrajectoryClosed("T0")], 3.0)
    assert set(drive.starts(out)) == {"t2a0"}  # the slot passed to the waiting trajectory


def test_trajectory_bound_runs_a_trajectorys_actions_one_at_a_time() -> None:
    drive = Driver(TrajectoryBoundScheduler(slot=Resources(2, 1000)))
    drive([worker("w", cpu=8, mem=8000)])
    out = drive([arrive("a", trajectory_id="T"), arrive("b", trajectory_id="T")])
    assert set(drive.starts(out)) == {"a"}
    assert set(drive.starts(drive([ActionFinished("a", 1.0)], 1.0))) == {"b"}


def test_trajectory_bound_reward_replicas_are_fixed() -> None:
    sched = TrajectoryBoundScheduler(rm_replicas={"score": (1, Resources(1, 100, 1, 0))}, batch_max=1)
    drive = Driver(sched)
    drive([worker("g", cpu=4, gpu=2, gmem=0, kinds=frozenset({"score"}))])
    assert sched.held().gpu == 1  # the replica holds its GPU before any request
    out = drive([arrive(f"s{i}", kind="score", gpu=1, hi=4) for i in range(2)])
    assert [(s.action_id, s.parallelism) for s in drive.starts(out).values()] == [("s0", 1)]
    out = drive([ActionFinished("s0", 1.0)], 1.0)
    assert set(drive.starts(out)) == {"s1"}  # the second GPU stays unused: replicas are fixed


def test_trajectory_bound_replicas_batch_queued_requests() -> None:
    sched = TrajectoryBoundScheduler(rm_replicas={"score": (1, Resources(1, 100, 1, 0))}, batch_max=3)
    drive = Driver(sched)
    drive([worker("g", cpu=4, gpu=2, gmem=0, kinds=frozenset({"score"}))])
    out = drive([arrive(f"s{i}", kind="score", gpu=1, hi=4) for i in range(4)])
    starts = drive.starts(out)
    assert [(s.action_id, s.batch_of) for s in starts.values()] == [("s0", None), ("s1", "s0"), ("s2", "s0")]
    assert sched.held().gpu == 1  # the batch runs on the one replica
    assert not drive.starts(drive([ActionFinished("s0", 1.0), ActionFinished("s1", 1.0)], 1.0))
    out = drive([ActionFinished("s2", 1.0)], 1.0)  # the replica is free once its whole batch ended
    assert set(drive.starts(out)) == {"s3"}
    out = drive([WorkerRemoved("g")], 2.0)
    assert Requeue("s3") in out and sched.pending() == 1


def test_trajectory_bound_lost_worker_and_idle_release() -> None:
    sched = TrajectoryBoundScheduler(slot=Resources(1, 100), idle_release_s=10.0)
    drive = Driver(sched)
    drive([worker("w1", cpu=1), arrive("a", trajectory_id="T")])
    out = drive([WorkerRemoved("w1")], 1.0)
    assert Requeue("a") in out and sched.pending() == 1
    out = drive([worker("w2", cpu=1)], 2.0)
    assert drive.starts(out)["a"].worker_id == "w2"
    drive([ActionFinished("a", 1.0)], 3.0)
    assert sched.next_wakeup(3.0) == pytest.approx(13.0)
    drive([Tick()], 14.0)
    assert sched.held().cpu == 0  # released without a close
    drive([arrive("q", trajectory_id="U"), ActionCancelled("q")], 15.0)
    assert sched.pending() == 0


def test_task_isolated_quotas_hold_even_when_the_rest_is_idle() -> None:
    sched = TaskIsolatedScheduler(quotas={"swe": 0.5})
    drive = Driver(sched)
    drive([worker("w", cpu=8)])
    out = drive([arrive(f"s{i}", env_id="swe") for i in range(6)] + [arrive("c0", env_id="code")])
    starts = drive.starts(out)
    assert sum(a.startswith("s") for a in starts) == 4  # half of eight cores
    assert "c0" in starts  # other envs share the rest
    assert starts["s0"].parallelism == 1
    with pytest.raises(ValueError, match="more than the whole pool"):
        TaskIsolatedScheduler(quotas={"a": 0.7, "b": 0.5})
    with pytest.raises(ValueError, match="fraction"):
        TaskIsolatedScheduler(quotas={"a": 2})
    out = drive([arrive("huge", env_id="swe", cpu=5)])
    assert out and "exceeds the quota" in out[0].reason


def test_fcfs_never_grows_and_ignores_warm_state() -> None:
    drive = Driver(FCFSScheduler())
    drive([worker("w", cpu=16)])
    assert drive.starts(drive([arrive("t", kind="tests", hi=16)]))["t"].parallelism == 1


def test_trajectory_bound_rejects_a_gpu_kind_that_can_never_get_a_replica() -> None:
    # The GPUs are all held, for good, by the replicas of one kind: a second kind gets a reason at once,
    # not a wait that never ends.
    sched = TrajectoryBoundScheduler(rm_replicas={"score": (2, Resources(1, 100, 1, 0))})
    drive = Driver(sched)
    drive([worker("g", cpu=4, gpu=2, kinds=frozenset({"score", "judge"}))])
    out = drive([arrive("j", kind="judge", gpu=1), arrive("s", kind="score", gpu=1)])
    assert set(drive.starts(out)) == {"s"}
    (reject,) = drive.book.rejects
    assert reject.action_id == "j" and "rm_replicas" in reject.reason and "score" in reject.reason
    assert sched.pending() == 0


def test_trajectory_bound_gpu_kind_waits_for_a_worker_that_serves_it() -> None:
    sched = TrajectoryBoundScheduler()
    drive = Driver(sched)
    drive([worker("c", cpu=4, kinds=frozenset({"bash"})), arrive("j", kind="judge", gpu=1, lo=2, hi=4)])
    assert sched.pending() == 1 and not drive.book.rejects  # no worker serves it yet: it waits
    out = drive([worker("g", cpu=8, gpu=4, kinds=frozenset({"judge"}))], 1.0)
    assert drive.starts(out)["j"].parallelism == 2  # one replica of min_par units, run on all of it
    assert sched.held().gpu == 2


def test_trajectory_bound_on_the_orchestrator_frees_a_slot_when_its_trajectory_closes() -> None:
    from tangram_env.protocol import Action, CloseSessions, Submit
    from tangram_env.protocol import Resources as Res
    from tangram_env.server.lifecycle import Lifecycle, Run
    from tests.server.test_lifecycle import ALICE, BOB, _ok, _registry

    core = Lifecycle(_registry(), TrajectoryBoundScheduler(slot=Resources(2, 500)), server_id="S")
    core.add_runner("local", Res(cpu=2, mem_mb=1000), None)
    core.flush(0.0)

    def started(effects: list[object]) -> list[str]:
        return [e.grant.action.id for e in effects if isinstance(e, Run)]

    work = [Action(id=f"a{t}", kind="work", payload={"seconds": 1}, trajectory_id=f"T{t}") for t in (1, 2)]
    core.receive(ALICE, Submit(actions=work), 0.0)
    assert started(core.flush(0.0)) == ["a1"]  # one 2-core slot: T2 waits for it
    core.finished("local", [_ok("a1")], 1.0)
    assert started(core.flush(1.0)) == []  # T1 still holds its slot between actions
    core.receive(BOB, CloseSessions(session_ids=[], trajectory_ids=[]), 2.0)
    core.receive(ALICE, CloseSessions(session_ids=[], trajectory_ids=["T1"]), 2.0)
    assert started(core.flush(2.0)) == ["a2"]
    core.validate_state()
