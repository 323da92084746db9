"""ClientCore, the rules both clients share, fed frames and times with no socket at all."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from tangram_env import wire
from tangram_env.client_core import SUBMIT_BATCH, ClientCore, submissions
from tangram_env.errors import ServerUnavailable
from tangram_env.protocol import (
    MAX_IDS_PER_MESSAGE,
    Ack,
    Action,
    CloseSessions,
    Error,
    Heartbeat,
    Result,
    Results,
    Submit,
    id_batches,
)
from tangram_env.settings import ClientSettings


def _core(**settings: Any) -> ClientCore[Future[Any]]:
    return ClientCore(ClientSettings(address="tcp://127.0.0.1:1", **settings), "tcp://127.0.0.1:1", now=0.0)


def _frames(message: Any) -> list[bytes]:
    return [wire.encode(message)]


def _sent(core: ClientCore[Future[Any]]) -> list[Any]:
    return [wire.decode_frames([frame], 2**24) for frame in core.outgoing()]


def _submit(core: ClientCore[Future[Any]], *actions: Action, now: float = 0.0) -> list[Future[Any]]:
    futures, new = core.register(actions, Future, now)
    core.outbox.extend(submissions(new))
    return futures


def test_an_outstanding_id_shares_its_future_and_is_not_sent_again() -> None:
    core = _core()
    a = Action(kind="echo", payload={"value": 1})
    (first,) = _submit(core, a)
    (again,) = _submit(core, a)
    assert again is first
    assert [len(m.actions) for m in _sent(core)] == [1]


def test_an_outstanding_id_reused_for_other_work_is_refused_not_answered_with_the_first_result() -> None:
    core = _core()
    first = Action(id="step-1", kind="echo", payload={"value": "answer A"})
    (fa,) = _submit(core, first)
    reused = [
        first.model_copy(update={"payload": {"value": "answer B"}}),
        first.model_copy(update={"kind": "noop"}),
    ]
    reused.append(first.model_copy(update={"affinity": "another-sandbox"}))
    for action in reused:
        (fb,) = _submit(core, action)
        assert fb is not fa and fb.done()
        result = fb.result(0)
        assert (
            result.error_type == "rejected" and "outstanding for a different 'echo' action" in result.message
        )
    assert [len(m.actions) for m in _sent(core)] == [1] and not fa.done()  # the first still waits


def test_results_resolve_and_are_acknowledged_on_the_next_submit_or_alone() -> None:
    core = _core()
    a, b = Action(kind="echo"), Action(kind="echo")
    (fa,) = _submit(core, a)
    _sent(core)
    core.receive(_frames(Results(results=[Result(action_id=a.id, ok=True, value=7)])), now=1.0)
    assert fa.result(0).value == 7 and core.pending == {}
    _submit(core, b)
    (carrier,) = _sent(core)
    assert isinstance(carrier, Submit) and carrier.acks == [a.id]
    core.receive(_frames(Results(results=[Result(action_id=b.id, ok=True)])), now=2.0)
    assert core.next_wake() == pytest.approx(2.0 + 0.05)
    core.tick(2.01)
    assert _sent(core) == []  # not due yet
    core.tick(2.06)
    (alone,) = _sent(core)
    assert isinstance(alone, Ack) and alone.action_ids == [b.id]
    assert core.quiet and core.next_wake() is None


def test_acknowledgements_and_cancels_go_in_messages_of_at_most_the_limit() -> None:
    core = _core()
    actions = [Action(kind="echo") for _ in range(MAX_IDS_PER_MESSAGE + 5)]
    _submit(core, *actions)
    _sent(core)
    core.receive(_frames(Results(results=[Result(action_id=a.id, ok=True) for a in actions])), now=1.0)
    core.tick(2.0)
    acks = _sent(core)
    assert [len(m.action_ids) for m in acks] == [MAX_IDS_PER_MESSAGE, 5]
    assert {i for m in acks for i in m.action_ids} == {a.id for a in actions}
    assert [len(ids) for ids in id_batches([str(i) for i in range(2 * MAX_IDS_PER_MESSAGE)])] == [
        MAX_IDS_PER_MESSAGE,
        MAX_IDS_PER_MESSAGE,
    ]


def test_a_failure_with_retries_left_is_resubmitted_as_a_new_attempt() -> None:
    core = _core(retries={"sandbox_died": 1})
    a = Action(kind="bash")
    (fut,) = _submit(core, a)
    _sent(core)
    core.receive(_frames(Results(results=[Result.failure(a.id, "sandbox_died", "gone")])), now=1.0)
    (retry,) = _sent(core)
    assert retry.actions[0].id == f"{a.id}~1" and not fut.done()
    core.receive(_frames(Results(results=[Result.failure(f"{a.id}~1", "sandbox_died", "again")])), now=2.0)
    result = fut.result(0)  # one retry only: the second failure is the answer, under the original id
    assert (result.action_id, result.error_type) == (a.id, "sandbox_died")


def test_busy_answers_are_resubmitted_after_a_growing_wait() -> None:
    core = _core(busy_backoff_s=0.1, heartbeat_s=100.0)
    a = Action(kind="echo")
    _submit(core, a)
    _sent(core)
    core.receive(_frames(Error(code="busy", message="full", action_ids=[a.id])), now=1.0)
    assert core.next_wake() == pytest.approx(1.1) and not core.quiet
    core.tick(1.05)
    assert _sent(core) == []
    core.tick(1.1)
    (again,) = _sent(core)
    assert [x.id for x in again.actions] == [a.id]
    core.receive(_frames(Error(code="busy", message="full", action_ids=[a.id])), now=2.0)
    core.receive(_frames(Error(code="busy", message="full", action_ids=[a.id])), now=2.0)
    assert core.next_wake() == pytest.approx(2.1)  # the first of the two, at the doubled wait...
    core.tick(2.1)
    _sent(core)
    assert core.next_wake() == pytest.approx(2.2)  # ...and the second at twice that


def test_a_rejected_action_fails_as_data() -> None:
    core = _core()
    a = Action(kind="echo")
    (fut,) = _submit(core, a)
    core.receive(_frames(Error(code="bad_request", message="no such kind", action_ids=[a.id])), now=1.0)
    result = fut.result(0)
    assert not result.ok and result.error_type == "rejected" and "no such kind" in (result.message or "")


def test_heartbeats_while_outstanding_and_a_silent_orchestrator_fails_what_waits() -> None:
    core = _core(heartbeat_s=1.0, server_timeout_s=5.0)
    (fut,) = _submit(core, Action(kind="sleep"))
    _sent(core)
    assert core.next_wake() == pytest.approx(1.0)
    core.tick(1.0)
    assert [type(m) for m in _sent(core)] == [Heartbeat]
    core.tick(6.5)
    with pytest.raises(ServerUnavailable, match="silent for 6s"):
        fut.result(0)
    assert core.pending == {}


def test_a_restarted_orchestrator_gets_every_unanswered_action_again() -> None:
    core = _core()
    actions = [Action(kind="echo") for _ in range(SUBMIT_BATCH + 3)]
    _submit(core, *actions)
    _sent(core)
    core.receive(_frames(Heartbeat(server_id="one")), now=1.0)
    assert _sent(core) == []
    core.receive(_frames(Heartbeat(server_id="two")), now=2.0)
    again = _sent(core)
    assert [len(m.actions) for m in again] == [SUBMIT_BATCH, 3]
    assert {x.id for m in again for x in m.actions} == {a.id for a in actions}


def test_messages_a_broken_connection_lost_either_way_are_made_good_by_resubmitting() -> None:
    core = _core()
    a, b = Action(kind="echo"), Action(kind="echo")
    _submit(core, a, b)
    assert [m.actions[0].id for m in _sent(core)] == [a.id]  # one Submit out: 1 message
    core.receive(_frames(Heartbeat(server_id="one")), now=0.5)  # 1 message in
    core.tick(1.0)
    (beat,) = _sent(core)
    assert isinstance(beat, Heartbeat) and beat.sent == 1  # the beat says what went before it
    # Everything arrived both ways: nothing is sent again.
    core.receive(_frames(Heartbeat(server_id="one", sent=1, heard=2, answered=1)), now=1.1)
    assert _sent(core) == []
    # A result the orchestrator sent never came (its answer counts 2 before itself; 2 arrived, this
    # one included): what waits goes again, once.
    core.receive(_frames(Heartbeat(server_id="one", sent=2, heard=3, answered=3)), now=2.0)
    assert [{x.id for x in m.actions} for m in _sent(core)] == [{a.id, b.id}]
    core.receive(_frames(Heartbeat(server_id="one", sent=3, heard=4, answered=4)), now=3.0)
    assert _sent(core) == []  # the same loss, seen again, is not made good twice
    # A submission it never heard of: the same.
    core.receive(_frames(Heartbeat(server_id="one", sent=4, heard=4, answered=5)), now=4.0)
    assert [{x.id for x in m.actions} for m in _sent(core)] == [{a.id, b.id}]
    # An answer without counts (an older orchestrator, or not an answer to a beat) changes nothing.
    core.receive(_frames(Heartbeat(server_id="one")), now=5.0)
    assert _sent(core) == []


def test_after_a_restart_a_sessions_actions_fail_until_it_is_closed_never_run_in_an_empty_sandbox() -> None:
    core = _core()
    plain, first = Action(kind="echo"), Action(kind="bash", affinity="s1")
    _submit(core, plain, first)
    core.receive(_frames(Heartbeat(server_id="one")), now=1.0)
    assert [m.server_id for m in _sent(core)] == ["one"]  # each Submit names the orchestrator last heard
    core.receive(_frames(Results(results=[Result(action_id=first.id, ok=True)])), now=1.5)
    (waiting,) = _submit(core, Action(kind="bash", affinity="s1"))
    _sent(core)
    core.receive(_frames(Heartbeat(server_id="two")), now=2.0)
    assert waiting.result(0).error_type == "sandbox_died" and "restarted" in waiting.result(0).message
    assert [[a.id for a in m.actions] for m in _sent(core)] == [[plain.id]]  # only the other goes again
    (later,) = _submit(core, Action(kind="bash", affinity="s1"))
    assert later.result(0).error_type == "sandbox_died" and _sent(core) == []  # failed here, not sent
    core.outbox.append(CloseSessions(session_ids=["s1"]))
    _sent(core)
    (fresh,) = _submit(core, Action(kind="bash", affinity="s1"))  # the id may start afresh
    assert not fresh.done() and [m.server_id for m in _sent(core)] == ["two"]


def test_a_malformed_message_is_dropped_and_requests_get_their_replies() -> None:
    core = _core()
    fut: Future[Any] = Future()
    core.expect("heartbeat", fut)
    core.receive([b"\x00garbage"], now=1.0)
    assert not fut.done()
    core.receive(_frames(Heartbeat(server_id="s")), now=1.0)
    assert fut.result(0).server_id == "s"


def test_silence_counts_only_while_something_waits() -> None:
    core = _core(heartbeat_s=1.0, server_timeout_s=5.0)
    a = Action(kind="sleep")
    _submit(core, a)
    _sent(core)
    core.receive(_frames(Results(results=[Result(action_id=a.id, ok=True)])), now=0.5)
    core.tick(0.6)
    _sent(core)
    (fut,) = _submit(core, Action(kind="sleep"), now=100.0)  # after a long quiet spell
    _sent(core)
    assert core.next_wake() == pytest.approx(101.0)
    core.tick(101.0)
    assert [type(m) for m in _sent(core)] == [Heartbeat] and not fut.done()
    core.tick(105.5)
    with pytest.raises(ServerUnavailable, match="silent for 6s"):
        fut.result(0)


def test_heartbeats_go_on_while_a_sandbox_session_is_open_and_stop_when_it_closes() -> None:
    # The orchestrator ends a silent client's sessions: an agent thinking for a minute lost its files.
    core = _core(heartbeat_s=1.0, server_timeout_s=5.0)
    a = Action(kind="bash", affinity="box-1")
    _submit(core, a)
    _sent(core)
    core.receive(_frames(Results(results=[Result(action_id=a.id, ok=True)])), now=0.5)
    assert core.quiet and core.next_wake() is not None
    for now in (1.0, 2.0, 30.0):  # nothing outstanding, the orchestrator silent: still no failure
        core.tick(now)
        assert Heartbeat in [type(m) for m in _sent(core)]
    core.outbox.append(CloseSessions(session_ids=["box-1"]))
    _sent(core)
    core.tick(40.0)
    assert _sent(core) == [] and core.sessions == set()


def test_a_message_that_does_not_encode_is_dropped_with_a_log_and_the_rest_go() -> None:
    core = _core()
    core.outbox.append(CloseSessions(session_ids=["box-\ud800"]))  # a lone surrogate: not UTF-8
    a = Action(kind="echo")
    _submit(core, a)
    assert [type(m) for m in _sent(core)] == [Submit]  # the thread that sends them lives on


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        (
            "TANGRAM_RETRIES",
            "3",
            r'retries \(TANGRAM_RETRIES\) \(.*e\.g\. \{"sandbox_died": 1\}\): .*dictionary \(got 3\)',
        ),
        (
            "TANGRAM_CONNECT_TIMEOUT_S",
            "soon",
            r"connect_timeout_s \(TANGRAM_CONNECT_TIMEOUT_S\) .*cannot read 'soon'",
        ),
        (
            "TANGRAM_ADDRESS",
            "127.0.0.1:5555",
            r"'127.0.0.1:5555' must start with tcp://, ipc:// or inproc://",
        ),
        (  # ZeroMQ took it and retried it silently: the connect timeout was all it said
            "TANGRAM_ADDRESS",
            "tcp://localhost:5555x",
            r"'tcp://localhost:5555x' is not tcp://HOST:PORT with a port of 1-65535",
        ),
    ],
)
def test_a_bad_client_setting_names_its_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, said: str
) -> None:
    # Pydantic's block named neither the variable nor what it takes; a bare host:port reached ZeroMQ
    # and came back as "Invalid argument".
    from tangram_env import Client

    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=said):
        Client()
    monkeypatch.delenv(variable)
    with pytest.raises(ValueError, match="'localhost:5555' must start with tcp://"):
        Client("localhost:5555")


def test_an_empty_address_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    # TANGRAM_ADDRESS= (a shell's or a container's) was refused as an address, though unset is allowed.
    monkeypatch.setenv("TANGRAM_ADDRESS", "")
    assert ClientSettings.resolve().address is None
    assert ClientSettings.resolve(address="tcp://[::1]:5555").address == "tcp://[::1]:5555"


def test_a_host_name_that_does_not_resolve_is_said() -> None:
    # ZeroMQ resolves in the background: "no orchestrator answered" was all a typo in the host got.
    from tangram_env import Client

    with pytest.raises(
        ServerUnavailable, match=r"the host name 'orchestrator.invalid' does not resolve here"
    ):
        Client("tcp://orchestrator.invalid:5555", connect_timeout_s=0.5)
