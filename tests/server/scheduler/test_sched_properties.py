"""Property tests: random event sequences never over-commit, never break the books, never lose actions."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_env.server.scheduler import (
    ElasticScheduler,
    FCFSScheduler,
    TaskIsolatedScheduler,
    TrajectoryBoundScheduler,
)
from tangram_env.server.scheduler.caps import CapsConfig
from tangram_env.server.scheduler.events import (
    ActionCancelled,
    ActionFinished,
    Event,
    Resources,
    SessionClosed,
    Tick,
    TrajectoryClosed,
    WorkerRemoved,
)
from tests.server.scheduler.sched_helpers import Driver, arrive, worker

POLICIES = {
    "elastic": lambda: ElasticScheduler(
        reserve_after_s=3.0, caps=CapsConfig(max_live_per_image={"img": 3}, creation_rate={"local": 2.0})
    ),
    "fcfs": lambda: FCFSScheduler(),
    "task_isolated": lambda: TaskIsolatedScheduler({"e0": 0.5, "e1": 0.3}),
    "trajectory_bound": lambda: TrajectoryBoundScheduler(slot=Resources(1, 500), idle_release_s=5.0),
}

_demand = st.tuples(
    st.sampled_from([0.5, 1.0, 2.0]), st.sampled_from([100.0, 800.0]), st.sampled_from([0.0, 0.0, 0.5, 1.0])
)
_action = st.fixed_dictionaries(
    {
        "demand": _demand,
        "elastic": st.sampled_from([(1, 1), (1, 4), (2, 3)]),
        "session": st.sampled_from([None, "S0", "S1", "S2", "S3"]),
        "sandbox": st.booleans(),  # without a session: whether it runs in a sandbox of its own
        "sandbox_mb": st.sampled_from([0.0, 300.0, 900.0]),  # what its session's sandbox holds while live
        "traj": st.sampled_from(["T0", "T1", "T2"]),
        "env": st.sampled_from(["e0", "e1", "e2"]),
        "kind": st.sampled_from(["bash", "tests", "score"]),
    }
)
_op = st.one_of(
    st.tuples(st.just("arrive"), _action),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(
        st.just("add"),
        st.tuples(st.integers(0, 3), st.sampled_from([1.0, 2.0, 4.0]), st.sampled_from([0.0, 1.0])),
    ),
    st.tuples(st.just("remove"), st.integers(0, 3)),
    st.tuples(st.just("close"), st.integers(0, 3)),
    st.tuples(st.just("tick"), st.just(0)),
)


def _run(policy: str, ops: list[tuple[str, Any]]) -> None:
    drive = Driver(POLICIES[policy]())
    now, n = 0.0, 0
    drive([worker("w0", cpu=4, mem=2000, gpu=1, gmem=0)])
    for op, arg in ops:
        now += 0.5
        events: list[Event] = []
        if op == "arrive":
            n += 1
            cpu, mem, gpu = arg["demand"]
            lo, hi = arg["elastic"]
            image = "img" if arg["session"] or arg.get("sandbox") else None
            events.append(
                arrive(
                    f"a{n}",
                    kind=arg["kind"],
                    cpu=cpu,
                    mem=mem,
                    gpu=gpu,
                    lo=lo,
                    hi=hi,
                    affinity=arg["session"],
                    image=image,
                    sandbox_mem_mb=arg["sandbox_mb"] if arg["session"] else 0.0,
                    trajectory_id=arg["traj"],
                    env_id=arg["env"],
                )
            )
        elif op == "finish" and drive.book.running:
            ids = sorted(drive.book.running)
            events.append(ActionFinished(ids[arg % len(ids)], 1.0, ok=arg % 5 != 0, setup_s=float(arg % 3)))
        elif op == "cancel":
            events.append(ActionCancelled(f"a{arg}"))
        elif op == "add":
            i, cpu, gpu = arg
            events.append(worker(f"w{i}", cpu=cpu, mem=2000, gpu=gpu))
        elif op == "remove":
            events.append(WorkerRemoved(f"w{arg}"))
        elif op == "close":
            events += [SessionClosed(f"S{arg}"), TrajectoryClosed(f"T{arg}")]
        else:
            events.append(Tick())
        drive(events, now)
    # Liveness: with a big worker present and everything finishing, the queue drains.
    drive([worker("big", cpu=64, mem=64_000, gpu=8)], now)
    for _ in range(400):
        if not drive.sched.pending() and not drive.sched.running():
            break
        now += 1.0
        events = [ActionFinished(a, 1.0) for a in sorted(drive.book.running)]
        events += [SessionClosed(f"S{i}") for i in range(4)] + [TrajectoryClosed(f"T{i}") for i in range(3)]
        drive([*events, Tick()], now)
    assert drive.sched.pending() == 0 and drive.sched.running() == 0, f"{policy} lost actions"
    caps = getattr(drive.sched, "caps", None)
    if caps is not None:  # every sandbox lent to a session-less action came back
        assert all(c["sessionless"] == 0 for c in caps.snapshot().values()), caps.snapshot()


@settings(max_examples=60, deadline=None)
@given(st.lists(_op, max_size=40))
def test_elastic_random_sequences(ops: list[tuple[str, Any]]) -> None:
    _run("elastic", ops)


def test_actions_left_bound_to_a_closed_session_pass_the_sandbox_caps_again() -> None:
    # Found by the test above: after SessionClosed, actions still queued for that session started a
    # new sandbox without a creation token (the bucket went to -1).
    def bash(session: str | None) -> tuple[str, Any]:
        return (
            "arrive",
            {
                "demand": (0.5, 100.0, 0.0),
                "elastic": (1, 1),
                "session": session,
                "sandbox_mb": 300.0,
                "traj": "T0",
                "env": "e0",
                "kind": "bash",
            },
        )

    ops = [("add", (0, 2.0, 0.0)), ("add", (1, 1.0, 0.0)), bash(None), bash(None), bash(None)]
    _run("elastic", ops + [bash(s) for s in ("S0", "S1", "S2", "S0", "S1", "S2")])


@settings(max_examples=40, deadline=None)
@given(st.lists(_op, max_size=40))
def test_fcfs_random_sequences(ops: list[tuple[str, Any]]) -> None:
    _run("fcfs", ops)


@settings(max_examples=40, deadline=None)
@given(st.lists(_op, max_size=40))
def test_task_isolated_random_sequences(ops: list[tuple[str, Any]]) -> None:
    _run("task_isolated", ops)


@settings(max_examples=40, deadline=None)
@given(st.lists(_op, max_size=40))
def test_trajectory_bound_random_sequences(ops: list[tuple[str, Any]]) -> None:
    _run("trajectory_bound", ops)
