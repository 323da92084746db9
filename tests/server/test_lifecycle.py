"""The orchestrator's life-cycle core, fed messages and events with no sockets, threads or clock."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, Field

from tangram_env.kinds import KindRegistry, tool
from tangram_env.protocol import (
    Ack,
    Action,
    Cancel,
    CloseSessions,
    Dispatch,
    Error,
    Heartbeat,
    Register,
    Resources,
    Result,
    Results,
    Stats,
    Submit,
    Timing,
)
from tangram_env.server.lifecycle import (
    INLINE,
    RESEND_GAP_S,
    EndSessions,
    Lifecycle,
    Limits,
    Persist,
    Run,
    RunInline,
    Send,
    SendFigures,
    Stage,
    Stop,
)
from tangram_env.server.scheduler import FCFSScheduler
from tangram_env.server.scheduler.story import IllegalTransition
from tangram_env.server.state import Stored

ALICE, BOB, WORKER = b"alice", b"bob", b"worker-1"


class Nothing(BaseModel):
    pass


class Work(BaseModel):
    seconds: float = Field(ge=0)


def _registry() -> KindRegistry:
    reg = KindRegistry()

    @tool(name="noop", cpu=0, mem_mb=0, timeout_s=1, placement="inline", registry=reg)
    def noop(args: Nothing) -> None:
        return None

    @tool(name="work", cpu=1, mem_mb=100, timeout_s=30, registry=reg)
    def work(args: Work) -> float:
        return args.seconds

    @tool(name="shell", cpu=1, mem_mb=100, timeout_s=30, placement="sandbox", registry=reg)
    def shell(args: Nothing) -> None:
        return None

    return reg


class Driver:
    """A core with one in-process runner of 2 cores; checks the books after every stimulus."""

    def __init__(self, limits: Limits | None = None, persistent: bool = False) -> None:
        self.core = Lifecycle(
            _registry(), FCFSScheduler(), server_id="S", limits=limits, persistent=persistent
        )
        self.core.add_runner("local", Resources(cpu=2, mem_mb=1000), None)
        self.now = 0.0
        self.effects: list[Any] = self.turn()

    def _checked(self, effects: list[Any]) -> list[Any]:
        self.core.validate_state()
        return effects

    def receive(self, peer: bytes, message: BaseModel) -> list[Any]:
        return self._checked(self.core.receive(peer, message, self.now))

    def finished(self, worker_id: str, *results: Result) -> list[Any]:
        return self._checked(self.core.finished(worker_id, results, self.now))

    def tick(self) -> list[Any]:
        return self._checked(self.core.tick(self.now))

    def turn(self) -> list[Any]:
        return self._checked(self.core.flush(self.now))

    def submit(self, peer: bytes, *actions: Action, acks: list[str] | None = None) -> list[Any]:
        return self.receive(peer, Submit(actions=list(actions), acks=acks or []))


def _sent(effects: list[Any], peer: bytes | None = None) -> list[BaseModel]:
    return [e.message for e in effects if isinstance(e, Send) and (peer is None or e.peer == peer)]


def _results(effects: list[Any]) -> dict[str, Result]:
    return {r.action_id: r for m in _sent(effects) if isinstance(m, Results) for r in m.results}


def _runs(effects: list[Any]) -> list[Run]:
    return [e for e in effects if isinstance(e, Run)]


def _ok(action_id: str, value: Any = None, run_s: float = 0.5) -> Result:
    return Result(action_id=action_id, ok=True, value=value, timing=Timing(run_s=run_s))


def test_inline_action_runs_at_once_and_its_id_never_runs_again() -> None:
    d = Driver()
    effects = d.submit(ALICE, Action(id="n1", kind="noop"))
    (inline,) = effects
    assert isinstance(inline, RunInline) and inline.action.id == "n1" and inline.timeout_s == 1
    d.finished(INLINE, _ok("n1", run_s=0.0))
    results = _results(d.turn())
    assert results["n1"].ok and d.core.scheduler.pending() == 0  # the scheduler never saw it
    # Resubmitted at once: the stored result again, since the first copy may have been dropped (a
    # ROUTER drops what it sends to a client not connected, as after a restart); once a second.
    d.submit(ALICE, Action(id="n1", kind="noop"))
    assert _results(d.turn())["n1"].ok
    d.submit(ALICE, Action(id="n1", kind="noop"))
    assert "n1" not in _results(d.turn())
    d.now += RESEND_GAP_S
    d.submit(ALICE, Action(id="n1", kind="noop"))  # resubmitted before the ack: the stored result
    assert _results(d.turn())["n1"].ok
    d.receive(ALICE, Ack(action_ids=["n1"]))
    (error,) = _sent(d.submit(ALICE, Action(id="n1", kind="noop")))
    assert isinstance(error, Error) and error.code == "duplicate" and error.action_ids == ["n1"]
    story = d.core.story("n1")
    assert [(old, new) for _, old, new, *_ in story] == [
        ("new", "running"),
        ("running", "done"),
        ("done", "forgotten"),
    ]
    assert [cause.split("-")[0] for *_, cause in story] == ["submit", "results", "ack"]  # stimulus ids


def test_a_queued_action_is_resolved_once_and_granted_with_its_validated_payload() -> None:
    d = Driver()
    assert d.submit(ALICE, Action(id="w1", kind="work", payload={"seconds": 2})) == []
    (run,) = _runs(d.turn())
    action = run.grant.action
    assert run.worker_id == "local" and action.timeout_s == 30 and run.grant.timeout_s == 30
    assert action.demand == Resources(1, 100) and action.elastic is not None
    assert run.grant.args == Work(seconds=2)  # carried from admission: not validated again
    assert d.core.entries["w1"].stage is Stage.RUNNING and d.core.scheduler.running() == 1
    d.now = 3.0
    d.finished("local", _ok("w1", 2.0, run_s=2.5))
    result = _results(d.turn())["w1"]
    assert result.value == 2.0 and result.timing.queued_s == pytest.approx(0.5)
    assert d.core.scheduler.running() == 0


@pytest.mark.parametrize("limit", [0.0, -1.0, float("inf"), float("nan")])
def test_a_kind_whose_limit_no_grant_takes_fails_that_action_alone(limit: float) -> None:
    # Registration refuses such a limit; one that slipped past it must not stop the loop.
    d = Driver()
    bad = d.core.registry.get("work")
    object.__setattr__(bad, "timeout_s", limit)  # what a spec built around the checks would hold
    d.core.registry.add(bad)

    @tool(name="fine", cpu=1, mem_mb=100, timeout_s=30, registry=d.core.registry)
    def fine(args: Work) -> float:
        return args.seconds

    d.submit(ALICE, Action(id="bad", kind="work", payload={"seconds": 1}))
    d.submit(BOB, Action(id="good", kind="fine", payload={"seconds": 1}))
    effects = d.turn()
    failure = _results(effects)["bad"]
    assert failure.error_type == "rejected" and "'work' cannot be started" in failure.message
    assert "timeout_s" in failure.message
    assert [r.grant.action.id for r in _runs(effects)] == ["good"]
    d.turn()
    assert d.core.scheduler.running() == 1  # the scheduler freed what the failed one held
    d.finished("local", _ok("good", 1.0))
    assert _results(d.turn())["good"].ok and d.core.scheduler.running() == 0


def test_a_session_of_an_orchestrator_before_this_one_fails_and_the_client_is_told() -> None:
    d = Driver()  # server id "S"
    before = Submit(actions=[Action(id="old", kind="shell", affinity="s1")], server_id="R")
    effects = d.receive(ALICE, before)
    assert Heartbeat(server_id="S") in _sent(effects, ALICE)
    result = _results(d.turn())["old"]
    assert result.error_type == "sandbox_died" and "restarted" in result.message
    # Actions without a session, and sessions opened on this orchestrator, run as ever.
    d.submit(BOB, Action(id="new", kind="shell", affinity="s2"))
    d.receive(BOB, Submit(actions=[Action(id="plain", kind="work", payload={"seconds": 1})], server_id="R"))
    d.receive(BOB, Submit(actions=[Action(id="next", kind="shell", affinity="s2")], server_id="R"))
    assert {r.grant.action.id for r in _runs(d.turn())} == {"new", "plain"}  # "next" waits for "new"


def test_restored_queued_actions_of_a_session_fail_instead_of_running_in_a_new_sandbox() -> None:
    d = Driver(persistent=True)
    stored = [
        Stored(Action(id="q1", kind="shell", affinity="s1"), ALICE, "queued", None),
        Stored(Action(id="q2", kind="work", payload={"seconds": 1}), ALICE, "queued", None),
    ]
    effects = d.core.restore(stored, [], d.now)
    assert any(isinstance(e, Persist) and e.op == "finished" for e in effects)
    assert d.core.entries["q1"].result.error_type == "sandbox_died"  # type: ignore[union-attr]
    assert [r.grant.action.id for r in _runs(d.turn())] == ["q2"]


def test_a_session_closed_while_its_command_runs_ends_when_the_command_does() -> None:
    # Ended at once, its sandbox was reset under the command: killed, yet reported ok with exit -9.
    d = Driver()
    d.submit(ALICE, Action(id="cmd", kind="shell", affinity="s1"))
    (run,) = _runs(d.turn())
    effects = d.receive(ALICE, CloseSessions(session_ids=["s1"]))
    assert not [e for e in effects + d.turn() if isinstance(e, EndSessions)]
    (refused,) = _sent(d.submit(ALICE, Action(id="late", kind="shell", affinity="s1")))
    assert isinstance(refused, Error) and refused.code == "conflict" and "was closed" in refused.message
    d.finished("local", _ok("cmd"))
    effects = d.turn()
    (ended,) = [e for e in effects if isinstance(e, EndSessions)]
    assert ended.sessions == ("s1",) and _results(effects)["cmd"].ok
    d.submit(ALICE, Action(id="again", kind="shell", affinity="s1"))  # the id may start afresh now
    assert [r.grant.action.id for r in _runs(d.turn())] == ["again"]


def test_a_client_may_ask_for_more_than_its_kind_declares_never_less() -> None:
    # Resources(mem_mb=...) leaves cpu at 0: such actions ran beside everything else, unbooked.
    d = Driver()
    d.submit(ALICE, Action(id="more", kind="work", payload={"seconds": 1}, demand=Resources(mem_mb=400)))
    d.submit(ALICE, Action(id="none", kind="work", payload={"seconds": 1}, demand=Resources(cpu=0, mem_mb=0)))
    d.submit(ALICE, Action(id="third", kind="work", payload={"seconds": 1}, demand=Resources(cpu=0)))
    runs = {r.grant.action.id: r.grant.action.demand for r in _runs(d.turn())}
    assert runs == {"more": Resources(1, 400), "none": Resources(1, 100)}  # 2 cores: the third waits
    assert d.core.scheduler.pending() == 1


def test_bad_input_is_refused_with_reasons_and_costs_no_one_else() -> None:
    d = Driver()
    effects = d.submit(
        ALICE,
        Action(id="a", kind="wrok"),
        Action(id="b", kind="work", payload={"seconds": "soon"}),
        Action(id="c", kind="work", payload={"seconds": 0}),
    )
    errors = {e.action_ids[0]: e for e in _sent(effects) if isinstance(e, Error)}
    assert errors["a"].code == "unknown_kind" and "did you mean 'work'" in errors["a"].message
    assert errors["b"].code == "bad_payload" and "seconds" in errors["b"].message
    assert [r.grant.action.id for r in _runs(d.turn())] == ["c"]
    (conflict,) = _sent(d.submit(BOB, Action(id="c", kind="work", payload={"seconds": 0})))
    assert isinstance(conflict, Error) and conflict.code == "conflict"


def test_backpressure_answers_busy_beyond_the_per_client_limit() -> None:
    d = Driver(Limits(max_queued_per_client=2))
    effects = d.submit(ALICE, *(Action(id=f"q{i}", kind="work", payload={"seconds": 1}) for i in range(3)))
    (busy,) = _sent(effects)
    assert isinstance(busy, Error) and busy.code == "busy" and busy.action_ids == ["q2"]
    assert d.submit(BOB, Action(id="b0", kind="work", payload={"seconds": 1})) == []  # others unaffected


def test_a_client_that_never_acknowledges_is_answered_busy_past_its_unacknowledged_limit() -> None:
    # Finished results are kept until acknowledged; one that never acknowledged held them all.
    d = Driver(Limits(max_unacked_per_client=2))
    for i in range(2):
        d.submit(ALICE, Action(id=f"n{i}", kind="noop"))
        d.finished(INLINE, _ok(f"n{i}"))
        d.turn()
    (busy,) = _sent(d.submit(ALICE, Action(id="n2", kind="noop")))
    assert isinstance(busy, Error) and busy.code == "busy" and busy.action_ids == ["n2"]
    assert "unacknowledged" in busy.message
    assert not _sent(d.submit(BOB, Action(id="b0", kind="noop")))  # another client is not held back
    (inline,) = d.submit(ALICE, Action(id="n2", kind="noop"), acks=["n0"])  # one acknowledged: room
    assert isinstance(inline, RunInline)


def test_cancel_withdraws_queued_actions_and_stops_running_ones_of_their_owner_only() -> None:
    d = Driver()
    d.submit(ALICE, *(Action(id=f"c{i}", kind="work", payload={"seconds": 1}) for i in range(3)))
    d.turn()  # c0 and c1 start on the two cores; c2 waits
    assert d.receive(BOB, Cancel(action_ids=["c0", "c2"])) == []  # not Bob's
    # c0 runs: its runner is asked to stop it (it held its core for nobody until its limit before).
    effects = d.receive(ALICE, Cancel(action_ids=["c0", "c2"]))
    assert [e for e in effects if isinstance(e, Stop)] == [Stop("local", ("c0",))]
    results = _results(d.turn())
    assert list(results) == ["c2"] and results["c2"].error_type == "cancelled"
    assert d.core.entries["c0"].stage is Stage.RUNNING and d.core.scheduler.pending() == 0
    assert not [e for e in d.receive(ALICE, Cancel(action_ids=["c0"])) if isinstance(e, Stop)]  # asked once
    d.finished("local", Result.failure("c0", "cancelled", "cancelled after it started"))
    assert _results(d.turn())["c0"].error_type == "cancelled"  # the runner's word


def test_cancel_of_an_action_running_on_a_remote_worker_reaches_that_worker() -> None:
    d = Driver()
    d.receive(WORKER, Register(worker_id="w", capacity=Resources(4, 1000), kinds=["work"]))
    d.submit(ALICE, *(Action(id=f"a{i}", kind="work", payload={"seconds": 1}) for i in range(6)))
    d.turn()  # the local runner's 2 cores and the worker's 4
    far = next(i for i, e in d.core.entries.items() if e.worker == "w")
    (cancel,) = _sent(d.receive(ALICE, Cancel(action_ids=[far])), WORKER)
    assert isinstance(cancel, Cancel) and cancel.action_ids == [far]
    # The worker is lost before it answers: the cancelled action ends, it is not run again elsewhere.
    effects = d.core.remove_worker("w", "gone", d.now)
    results = {**_results(effects), **_results(d.turn())}
    assert results[far].error_type == "cancelled" and d.core.entries[far].stage is Stage.DONE
    assert far not in {r.action_id for e in d.turn() if isinstance(e, Run) for r in [e.grant.action]}


def test_a_deadline_that_passes_in_the_queue_ends_the_action() -> None:
    d = Driver()
    d.submit(
        ALICE, *(Action(id=f"d{i}", kind="work", payload={"seconds": 1}, deadline_s=5) for i in range(3))
    )
    d.turn()
    d.now = 6.0
    results = _results(d.turn())
    assert list(results) == ["d2"] and results["d2"].error_type == "deadline"
    assert d.core.story("d2")[-1][1:3] == ("queued", "done")


def test_a_lost_worker_s_actions_are_requeued_through_the_scheduler_then_given_up() -> None:
    d = Driver(Limits(max_retries=1, worker_timeout_s=10), persistent=True)
    d.receive(WORKER, Register(worker_id="w", capacity=Resources(4, 1000), kinds=["work"]))
    d.turn()
    d.submit(ALICE, *(Action(id=f"r{i}", kind="work", payload={"seconds": 1}) for i in range(6)))
    effects = d.turn()
    remote = [g.action.id for m in _sent(effects, WORKER) if isinstance(m, Dispatch) for g in m.grants]
    local = [r.grant.action.id for r in _runs(effects)]
    assert len(remote) == 4 and len(local) == 2
    d.now = 11.0
    d.tick()  # the worker fell silent: its actions go back through the scheduler's Requeue
    assert all(d.core.entries[i].stage is Stage.RUNNING for i in remote)  # until the scheduler answers
    effects = d.turn()
    requeued = [e.args[0] for e in effects if isinstance(e, Persist) and e.op == "requeued"]
    assert sorted(requeued) == sorted(remote)
    for action_id in local:  # free the local cores: the requeued ones start there
        d.finished("local", _ok(action_id))
    effects = d.turn()
    again = [r.grant.action.id for r in _runs(effects)]
    assert len(again) == 2 and set(again) <= set(remote)
    late = d.receive(WORKER, Results(results=[_ok(remote[0])]))  # the lost worker's late answer
    assert isinstance(_sent(late)[0], Error)  # it is not registered any more
    d.receive(WORKER, Register(worker_id="w", capacity=Resources(4, 1000), kinds=["work"]))
    effects = d.turn()
    rerun = [g.action.id for m in _sent(effects, WORKER) if isinstance(m, Dispatch) for g in m.grants]
    d.now = 22.0
    d.tick()  # lost a second time: over max_retries, given up with an error
    results = _results(d.turn())
    assert sorted(results) == sorted(rerun)
    assert all(r.error_type == "error" and "lost 2 times" in r.message for r in results.values())


def test_persist_effects_come_in_the_order_that_keeps_a_crash_safe() -> None:
    d = Driver(persistent=True)
    ops = [e.op for e in d.submit(ALICE, Action(id="p", kind="work", payload={"seconds": 1}))]
    effects = d.turn()
    ops += [e.op for e in effects if isinstance(e, Persist)]
    kinds = [type(e).__name__ for e in effects]
    assert kinds.index("Persist") < kinds.index("Run")  # durable before it starts
    ops += [e.op for e in d.finished("local", _ok("p")) if isinstance(e, Persist)]
    d.turn()
    ops += [e.op for e in d.receive(ALICE, Ack(action_ids=["p"])) if isinstance(e, Persist)]
    assert ops == ["added", "started", "finished", "acknowledged"]


def test_restore_queues_the_queued_and_fails_what_was_running() -> None:
    d = Driver(persistent=True)
    work = Action(id="queued", kind="work", payload={"seconds": 1})
    running = Action(id="was-running", kind="work", payload={"seconds": 1})
    stored = [
        Stored(work, ALICE, "queued", None),
        Stored(running, ALICE, "running", None),
        Stored(Action(id="gone", kind="no.longer.registered"), ALICE, "queued", None),
    ]
    d.core.restore(stored, ["old"], d.now)
    d.core.validate_state()
    (run,) = _runs(d.turn())
    assert run.grant.action.id == "queued" and run.grant.args is None  # validated where it runs
    lost = d.core.entries["was-running"].result
    assert lost is not None and "not rerun" in lost.message and "gone" not in d.core.entries
    (dup,) = _sent(d.submit(ALICE, Action(id="old", kind="noop")))
    assert isinstance(dup, Error) and dup.code == "duplicate"


def test_a_silent_client_loses_its_queue_and_sessions_and_heartbeats_keep_it() -> None:
    d = Driver(Limits(client_timeout_s=5))
    d.submit(ALICE, *(Action(id=f"s{i}", kind="work", payload={"seconds": 1}) for i in range(3)))
    d.submit(BOB, Action(id="b", kind="shell", affinity="sess-b", trajectory_id="t-b"))
    d.turn()
    d.now = 4.0
    assert isinstance(_sent(d.receive(BOB, Heartbeat()))[0], Heartbeat)
    d.now = 6.0
    effects = d.tick()
    assert [e.sessions for e in effects if isinstance(e, EndSessions)] == []  # Alice holds none
    results = _results(d.turn())
    assert list(results) == ["s2"] and results["s2"].error_type == "cancelled"  # s0, s1 run on
    effects = d.receive(BOB, CloseSessions(session_ids=["sess-b", "not-bobs"]))
    assert [e.sessions for e in effects if isinstance(e, EndSessions)] == [("sess-b",)]


def test_a_silent_clients_sessions_are_lost_not_ended_and_a_running_one_ends_after_its_action() -> None:
    # Ended outright, a session whose first action was still getting its sandbox leaked that sandbox
    # (the pool had none to reset yet), and a client that was only paused went on in fresh, empty
    # sandboxes under its old session ids, its rewards looking valid.
    d = Driver(Limits(client_timeout_s=5))
    d.submit(BOB, Action(id="busy", kind="shell", affinity="sess-run", trajectory_id="t1"))
    d.submit(BOB, Action(id="done", kind="shell", affinity="sess-idle", trajectory_id="t2"))
    d.turn()
    d.finished("local", _ok("done"))
    d.turn()
    d.now = 6.0
    ended = [e.sessions for e in d.tick() if isinstance(e, EndSessions)]
    assert ended == [("sess-idle",)]  # sess-run waits for its action
    d.finished("local", _ok("busy"))
    ended = [e.sessions for e in d.turn() if isinstance(e, EndSessions)]
    assert ended == [("sess-run",)]
    d.submit(BOB, Action(id="back", kind="shell", affinity="sess-idle", trajectory_id="t2"))
    results = _results(d.turn())
    assert results["back"].error_type == "sandbox_died", results
    assert "client_timeout_s" in results["back"].message
    d.core.validate_state()


def test_a_client_that_closed_its_sessions_leaves_no_book_behind() -> None:
    # An empty set per client that ever opened a session stayed for good (one per trainer process).
    d = Driver(Limits(client_timeout_s=5))
    d.submit(BOB, Action(id="one", kind="shell", affinity="s", trajectory_id="t"))
    d.turn()
    d.finished("local", _ok("one"))
    d.turn()
    d.receive(BOB, CloseSessions(session_ids=["s"]))
    assert BOB not in d.core._sessions
    d.submit(ALICE, Action(id="two", kind="shell", affinity="s2", trajectory_id="t2"))
    d.turn()
    d.finished("local", _ok("two"))
    d.turn()
    d.now = 6.0
    d.tick()  # Alice went silent: her session is lost, and her book goes with it
    assert ALICE not in d.core._sessions


def test_acknowledged_results_leave_the_expiry_queue() -> None:
    # Every result of the last result_ttl_s stayed queued for expiry after it was acknowledged:
    # memory grew with throughput times 600 s (170 bytes an action).
    d = Driver()
    for batch in range(5):
        ids = [f"b{batch}-{i}" for i in range(500)]
        d.submit(ALICE, *(Action(id=i, kind="work", payload={"seconds": 1}) for i in ids))
        while runs := [r.grant.action.id for r in _runs(d.turn())]:
            d.finished("local", *(_ok(i) for i in runs))
        assert all(d.core.entries[i].stage is Stage.DONE for i in ids)
        d.receive(ALICE, Ack(action_ids=ids))
        d.tick()
    assert len(d.core._done_order) <= 2 * len(d.core.entries) + 1024


def test_stats_ask_the_shell_for_runner_figures_and_the_books_add_up() -> None:
    d = Driver()
    d.submit(ALICE, Action(id="f", kind="work", payload={"seconds": 1}))
    d.turn()
    assert d.receive(ALICE, Stats()) == [SendFigures(ALICE)]
    figures = d.core.figures()
    assert figures["running"] == 1 and figures["workers"]["local"]["used"]["cpu"] == 1


def test_results_expire_unread_and_their_ids_still_never_run_again() -> None:
    d = Driver(Limits(result_ttl_s=10))
    d.submit(ALICE, Action(id="e", kind="work", payload={"seconds": 1}))
    d.turn()
    d.finished("local", _ok("e"))
    d.turn()
    d.now = 11.0
    d.tick()
    assert "e" not in d.core.entries and "e" in d.core.acked
    assert d.core.story("e")[-1][3] == "expired unread"


def test_an_illegal_move_is_refused_loudly() -> None:
    d = Driver()
    d.submit(ALICE, Action(id="x", kind="work", payload={"seconds": 1}))
    entry = d.core.entries["x"]
    with pytest.raises(IllegalTransition, match="queued -> forgotten"):
        d.core._move(entry, Stage.FORGOTTEN, d.now, "skipping its result")


def test_a_worker_that_registers_again_does_not_finish_what_it_lost() -> None:
    d = Driver()
    register = Register(worker_id="w", capacity=Resources(4, 1000), kinds=["work"])
    d.receive(WORKER, register)
    d.turn()
    d.submit(ALICE, *(Action(id=f"g{i}", kind="work", payload={"seconds": 1}) for i in range(6)))
    remote = [g.action.id for m in _sent(d.turn(), WORKER) if isinstance(m, Dispatch) for g in m.grants]
    d.receive(WORKER, register)  # it restarted: what it ran is lost, even under the same name
    d.receive(WORKER, Results(results=[_ok(remote[0])]))  # a stale answer in the same turn
    assert d.core.entries[remote[0]].result is None
    again = [g.action.id for m in _sent(d.turn(), WORKER) if isinstance(m, Dispatch) for g in m.grants]
    assert sorted(again) == sorted(remote)
    d.receive(WORKER, Results(results=[_ok(i) for i in again]))
    assert set(_results(d.turn())) == set(remote)


def test_with_a_worker_token_only_peers_that_give_it_register_as_workers() -> None:
    # Without it, any client could register under a worker's name, take its actions and answer them.
    d = Driver()
    d.core.worker_token = "s3cret"
    impostor = Register(worker_id="w", capacity=Resources(64, 10**6), kinds=["work"], token="guess")
    (refusal,) = _sent(d.receive(b"impostor", impostor), b"impostor")
    assert (
        isinstance(refusal, Error)
        and refusal.code == "unauthorized"
        and "TANGRAM_WORKER_TOKEN" in refusal.message
    )
    assert "w" not in d.core.workers
    d.receive(WORKER, Register(worker_id="w", capacity=Resources(4, 1000), kinds=["work"], token="s3cret"))
    assert d.core.workers["w"].identity == WORKER
    d.receive(b"impostor", impostor)  # a refused peer takes nothing over either
    assert d.core.workers["w"].identity == WORKER


@pytest.mark.parametrize("name", ["local", "orchestrator"])
def test_a_peer_cannot_register_under_the_orchestrators_own_worker_names(name: str) -> None:
    d = Driver()
    d.submit(ALICE, Action(id="mine", kind="work", payload={"seconds": 1}))
    (run,) = _runs(d.turn())  # running on the in-process runner "local"
    (refusal,) = _sent(d.receive(WORKER, Register(worker_id=name, capacity=Resources(4, 1000))), WORKER)
    assert isinstance(refusal, Error) and refusal.code == "conflict" and name in refusal.message
    assert d.core.entries["mine"].stage is Stage.RUNNING and d.core.entries["mine"].worker == "local"
    assert not any(isinstance(m, Dispatch) for m in _sent(d.turn(), WORKER))  # nothing went to the peer
    d.finished("local", _ok("mine"))
    assert set(_results(d.turn())) == {"mine"}


def test_timings_out_of_bounds_are_refused_at_the_wire() -> None:
    for bad in ({"run_s": 1e300}, {"setup_s": -1.0}, {"queued_s": float("nan")}):
        with pytest.raises(ValueError):
            Timing(**bad)
    assert Timing(run_s=3600.0).act_s == 3600.0


def test_a_worker_that_holds_a_grant_past_its_time_limit_is_lost_though_it_heartbeats() -> None:
    d = Driver(Limits(max_retries=0, worker_timeout_s=10))
    d.receive(WORKER, Register(worker_id="w", capacity=Resources(4, 1000), kinds=["work"]))
    d.turn()
    d.submit(ALICE, *(Action(id=f"h{i}", kind="work", payload={"seconds": 1}, timeout_s=2) for i in range(4)))
    remote = [g.action.id for m in _sent(d.turn(), WORKER) if isinstance(m, Dispatch) for g in m.grants]
    assert remote
    for now in (5.0, 11.0):  # alive, answering nothing: within its limit and the grace, it keeps them
        d.now = now
        d.receive(WORKER, Heartbeat())
        d.tick()
        assert all(d.core.entries[i].stage is Stage.RUNNING for i in remote)
    d.now = 12.5  # 2 s of limit + 10 s of grace are over
    d.receive(WORKER, Heartbeat())
    d.tick()
    results = _results(d.turn())
    assert sorted(results) == sorted(remote)  # given up (no retries allowed), with the reason
    assert all(not r.ok and "past its time limit" in r.message for r in results.values())


def test_a_workers_figures_too_big_for_a_stats_reply_are_dropped_with_a_note() -> None:
    d = Driver()
    d.receive(WORKER, Register(worker_id="w", capacity=Resources(4, 1000), kinds=["work"]))
    d.receive(WORKER, Heartbeat(figures={"sandboxes": 3}))
    assert d.core.figures()["workers"]["w"]["figures"] == {"sandboxes": 3}
    d.receive(WORKER, Heartbeat(figures={"log": "x" * 2**20}))
    dropped = d.core.figures()["workers"]["w"]["figures"]
    assert set(dropped) == {"dropped"} and "over the" in dropped["dropped"]


def test_a_client_s_count_of_outstanding_actions_goes_when_it_has_none() -> None:
    # A long-lived server sees a new client identity per trainer restart: nothing may stay per client.
    d = Driver()
    for i, peer in enumerate([ALICE, BOB, b"carol"]):
        d.submit(peer, Action(id=f"w{i}", kind="work", payload={"seconds": 1}))
    d.turn()
    assert set(d.core._outstanding) == {ALICE, BOB, b"carol"}
    d.finished("local", _ok("w0"), _ok("w1"))
    d.turn()
    assert dict(d.core._outstanding) == {b"carol": 1}


def test_an_image_the_sandbox_settings_refuse_rejects_that_action_alone() -> None:
    def reserve(image: str) -> float:
        if image.startswith("bad"):
            raise ValueError(f"sandbox settings for image {image!r}: not a valid name")
        return 100.0

    core = Lifecycle(_registry(), FCFSScheduler(), server_id="S", sandbox_mem_mb=reserve)
    core.add_runner("local", Resources(cpu=2, mem_mb=1000), None)
    actions = [
        Action(id=f"s{i}", kind="shell", image=image) for i, image in enumerate(["default", "bad/", "x"])
    ]
    effects = core.receive(ALICE, Submit(actions=actions), 0.0)
    core.validate_state()  # before: the bad one stayed queued, unknown to the scheduler, forever
    (error,) = _sent(effects)
    assert isinstance(error, Error) and error.action_ids == ["s1"] and "not a valid name" in error.message
    assert {a for a, e in core.entries.items() if e.stage is Stage.QUEUED} == {"s0", "s2"}


def test_an_empty_image_name_is_refused_by_the_protocol() -> None:
    with pytest.raises(ValueError, match="image"):
        Action(kind="shell", image="")


def test_a_sandbox_session_serves_only_the_client_that_opened_it_and_its_async_twins() -> None:
    d = Driver()
    d.submit(ALICE, Action(id="a1", kind="shell", affinity="box"))
    (error,) = _sent(d.submit(BOB, Action(id="b1", kind="shell", affinity="box")))
    assert isinstance(error, Error) and error.code == "conflict" and error.action_ids == ["b1"]
    assert "belongs to another client" in error.message
    assert _sent(d.submit(ALICE + b"/twin", Action(id="a2", kind="shell", affinity="box"))) == []
    d.receive(BOB, CloseSessions(session_ids=["box"]))  # not Bob's to close: ignored
    assert "box" in d.core._session_family
    d.receive(ALICE, CloseSessions(session_ids=["box"]))
    assert _sent(d.submit(BOB, Action(id="b2", kind="shell", affinity="box"))) == []  # a new session


def test_a_client_opens_at_most_max_sessions_per_client_live_sessions() -> None:
    d = Driver(Limits(max_sessions_per_client=2))
    d.submit(ALICE, Action(id="a1", kind="shell", affinity="s1"))
    d.submit(ALICE + b"/twin", Action(id="a2", kind="shell", affinity="s2"))  # its async twin counts too
    (error,) = _sent(d.submit(ALICE, Action(id="a3", kind="shell", affinity="s3")))
    assert isinstance(error, Error) and error.code == "session_limit" and error.action_ids == ["a3"]
    assert "holds 2 live sandbox sessions" in error.message and "env.close()" in error.message
    assert _sent(d.submit(ALICE, Action(id="a4", kind="shell", affinity="s1"))) == []  # its own: fine
    assert _sent(d.submit(BOB, Action(id="b1", kind="shell", affinity="s3"))) == []  # another client's
    d.receive(ALICE, CloseSessions(session_ids=["s1"]))
    assert _sent(d.submit(ALICE, Action(id="a5", kind="shell", affinity="s4"))) == []  # room again


def test_the_sessions_of_a_silent_async_twin_live_on_with_its_sync_client() -> None:
    # A trainer's event loop may end between batches: its AsyncClient falls silent, its sync client
    # heartbeats on, and the sessions the AsyncClient opened must keep their sandboxes.
    d = Driver(Limits(client_timeout_s=5))
    twin = ALICE + b"/loop-1"
    d.receive(ALICE, Heartbeat())
    d.submit(twin, Action(id="t1", kind="shell", affinity="box"))
    d.turn()
    d.finished("local", _ok("t1"))
    d.turn()
    d.now = 4.0
    d.receive(ALICE, Heartbeat())
    d.now = 6.0  # the twin has been silent for 6 s
    assert [e for e in d.tick() if isinstance(e, EndSessions)] == []
    d.now = 10.0  # now Alice too
    assert [e.sessions for e in d.tick() if isinstance(e, EndSessions)] == [("box",)]


def test_a_run_cut_short_by_its_deadline_reports_the_deadline_not_a_timeout() -> None:
    d = Driver()
    d.submit(ALICE, Action(id="near", kind="work", payload={"seconds": 9}, deadline_s=2))  # its limit: 30 s
    d.submit(ALICE, Action(id="far", kind="work", payload={"seconds": 9}, deadline_s=100, timeout_s=1))
    runs = {r.grant.action.id: r.grant for r in _runs(d.turn())}
    assert runs["near"].timeout_s == 2 and runs["far"].timeout_s == 1
    d.now = 2.0
    timed_out = [Result.failure(i, "timeout", "ran past its limit", timing=Timing(run_s=1)) for i in runs]
    d.finished("local", *timed_out)
    results = _results(d.turn())
    assert results["near"].error_type == "deadline" and "deadline of 2s passed" in results["near"].message
    assert results["far"].error_type == "timeout"  # its own limit ended it


def test_a_session_idle_past_session_idle_s_ends_though_its_client_lives() -> None:
    d = Driver(Limits(session_idle_s=100))

    def ended() -> list[tuple[str, ...]]:
        d.receive(ALICE, Heartbeat())  # Alice is alive throughout
        return [e.sessions for e in d.tick() if isinstance(e, EndSessions)]

    d.submit(ALICE, Action(id="a1", kind="shell", affinity="box"))
    d.submit(ALICE, Action(id="l1", kind="shell", affinity="long"))
    d.turn()
    d.finished("local", _ok("a1"))
    d.now = 60.0
    d.submit(ALICE, Action(id="a2", kind="shell", affinity="box"))  # box is busy again at 60 s
    d.turn()
    d.finished("local", _ok("a2"))
    d.now = 150.0
    assert ended() == []  # idle for 90 s only; "long" runs on
    d.now = 170.0
    assert ended() == []  # the next look is a quarter of session_idle_s after the last one
    d.now = 176.0
    assert ended() == [("box",)]
    assert "box" not in d.core._sessions[ALICE] and "long" in d.core._sessions[ALICE]
    d.finished("local", _ok("l1"))  # a run longer than session_idle_s kept its session
    d.now = 300.0
    assert ended() == [("long",)]
    d.submit(ALICE, Action(id="a3", kind="shell", affinity="box"))
    failed = _results(d.turn())["a3"]  # never a fresh sandbox's answer
    assert failed.error_type == "sandbox_died" and "session_idle_s" in failed.message
    (error,) = _sent(d.submit(BOB, Action(id="b1", kind="shell", affinity="box")))
    assert isinstance(error, Error) and error.code == "conflict"  # still Alice's
    d.receive(ALICE, CloseSessions(session_ids=["box"]))
    d.submit(ALICE, Action(id="a4", kind="shell", affinity="box"))  # once ended, the id starts afresh
    assert [r.grant.action.id for r in _runs(d.turn())] == ["a4"]


def test_a_session_whose_worker_is_lost_fails_until_its_client_ends_it() -> None:
    # Its sandbox went with the worker: its commands used to be requeued onto another worker and run
    # in an empty sandbox there, reading as the agent's own files gone missing.
    d = Driver(Limits(worker_timeout_s=10))
    d.receive(WORKER, Register(worker_id="w", capacity=Resources(8, 1000), kinds=["shell"]))
    d.turn()
    d.submit(ALICE, *(Action(id=f"busy{i}", kind="work", payload={"seconds": 9}) for i in range(2)))
    assert len(_runs(d.turn())) == 2  # the local runner is full
    d.submit(ALICE, *(Action(id=f"s{i}", kind="shell", affinity="box") for i in range(10)))
    effects = d.turn()
    remote = {g.action.id for m in _sent(effects, WORKER) if isinstance(m, Dispatch) for g in m.grants}
    assert len(remote) == 8  # two more wait for cores
    d.now = 11.0
    d.receive(ALICE, Heartbeat())
    d.tick()  # w fell silent
    results = _results(d.turn())
    assert set(results) == {f"s{i}" for i in range(10)}  # running or queued: none runs anywhere else
    assert all(r.error_type == "sandbox_died" and "worker w was lost" in r.message for r in results.values())
    d.submit(ALICE, Action(id="later", kind="shell", affinity="box"))
    assert _results(d.turn())["later"].error_type == "sandbox_died"
    d.finished("local", _ok("busy0"))  # the other work goes on
    assert _results(d.turn())["busy0"].ok
    d.receive(ALICE, CloseSessions(session_ids=["box"]))
    d.submit(ALICE, Action(id="afresh", kind="shell", affinity="box"))
    assert [r.grant.action.id for r in _runs(d.turn())] == ["afresh"]


def test_actions_of_a_kind_no_live_worker_serves_are_reported(caplog: pytest.LogCaptureFixture) -> None:
    # A remote worker that alone served a kind is gone for good: its actions wait for another to
    # join, and the log and Stats say so instead of nothing.
    core = Lifecycle(_registry(), FCFSScheduler(), server_id="S", limits=Limits(worker_timeout_s=10))
    core.add_runner("local", Resources(cpu=2, mem_mb=1000), frozenset({"noop", "shell"}))
    core.receive(WORKER, Register(worker_id="w", capacity=Resources(4, 1000), kinds=["work"]), 0.0)
    core.flush(0.0)
    core.receive(ALICE, Submit(actions=[Action(id="r", kind="work", payload={"seconds": 1})]), 0.0)
    core.flush(0.0)
    assert core.figures()["unserved"] == {}  # it runs on w
    core.receive(ALICE, Heartbeat(), 11.0)
    core.tick(11.0)  # w fell silent: r goes back to the queue, with nobody to run it
    core.flush(11.0)
    assert core.entries["r"].stage is Stage.QUEUED and core.figures()["unserved"] == {"work": 1}
    core.tick(41.5)
    assert "1 actions of 'work' wait: no live worker serves that kind" in caplog.text
