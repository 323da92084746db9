"""The orchestrator as a separate process: results, failures as data, and bad input."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import msgpack
import pytest
import zmq

from tangram_env import Action, ActionRejected, ActionTimeout, Client, wire
from tangram_env.protocol import MAX_ACTIONS_PER_SUBMIT, PROTOCOL_VERSION, Error, Heartbeat, Results, Submit


def test_echo_and_sleep(client: Client) -> None:
    assert client.call("echo", {"value": {"a": [1, 2]}}) == {"a": [1, 2]}
    res = client.run("sleep", {"seconds": 0.05})
    assert res.ok and res.value == 0.05 and res.worker == "local"
    assert res.timing.run_s >= 0.05


def test_action_errors_come_back_as_data(client: Client) -> None:
    res = client.run("test.raise", {"message": "kaput"})
    assert not res.ok and res.error_type == "error"
    assert "ValueError: kaput" in res.message and "raise ValueError" in res.traceback
    res = client.run("test.exit", {"code": 7})
    assert not res.ok and "exited with code 7" in res.message


def test_timeout_kills_the_whole_process_tree(client: Client, tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    with pytest.raises(ActionTimeout, match="limit of 1s"):
        client.call("test.spawn_and_hang", {"pidfile": str(pidfile), "seconds": 30})
    grandchild = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"grandchild {grandchild} outlived its action's timeout")


def test_client_timeout_override(client: Client) -> None:
    res = client.run("sleep", {"seconds": 10}, timeout_s=0.3)
    assert res.error_type == "timeout"


def test_unknown_kind_and_bad_payload_are_rejected_with_reasons(client: Client) -> None:
    with pytest.raises(ActionRejected, match="did you mean 'echo'"):
        client.call("ecko", {})
    with pytest.raises(ActionRejected, match="seconds"):
        client.call("sleep", {"seconds": "soon"})


def test_a_resubmitted_id_runs_once(client: Client, tmp_path: Path) -> None:
    path = tmp_path / "count"
    action = Action(kind="test.touch", payload={"path": str(path), "line": "x"})
    futures = client.submit([action, action.model_copy()])  # twice before the result: one future
    assert futures[0] is futures[1] and futures[0].result(10).ok
    time.sleep(0.2)  # let the acknowledgement reach the server
    again = client.submit([action.model_copy()])[0].result(10)
    assert not again.ok and again.error_type == "rejected" and "at most once" in again.message
    assert path.read_text().splitlines() == ["x"]


def test_stats_and_kinds(client: Client) -> None:
    client.call("echo", {"value": 1})
    stats = client.stats()
    assert stats["act"]["echo"]["count"] >= 1 and "local" in stats["workers"]
    kinds = client.kinds()
    assert kinds["sleep"]["schema"]["function"]["name"] == "sleep"
    assert "test.touch" in kinds


def _exchange(sock: zmq.Socket[bytes], frames: list[bytes] | bytes) -> object:
    sock.send_multipart([frames] if isinstance(frames, bytes) else frames)
    return wire.decode_frames(sock.recv_multipart())


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([b"hello"], "bad_frames"),
        ([wire.frame(b"heartbeat", b"\x80"), b"extra"], "bad_frames"),
        (wire.frame(b"submit", b"\x80", version=PROTOCOL_VERSION + 9), "bad_version"),
        (wire.frame(b"nonsense", b"\x80"), "unknown_type"),
        (wire.frame(b"submit", b"\xc1garbage"), "bad_body"),
        (wire.frame(b"submit", msgpack.packb({"actions": "many"})), "bad_schema"),
        (wire.frame(b"submit", b"\x00" * (16 * 2**20 + 1)), "too_large"),
        (
            wire.frame(b"dispatch", msgpack.packb({"grants": [{"action": {"kind": "x"}, "timeout_s": 1}]})),
            "unexpected_type",
        ),
    ],
)
def test_bad_frames_get_an_error_and_the_server_keeps_serving(
    raw_socket: zmq.Socket[bytes], client: Client, frames: list[bytes] | bytes, code: str
) -> None:
    reply = _exchange(raw_socket, frames)
    assert isinstance(reply, Error) and reply.code == code, reply
    assert reply.message
    # Everyone else is still served, and so is the same peer.
    assert client.call("echo", {"value": code}) == code
    assert isinstance(_exchange(raw_socket, wire.encode(Heartbeat())), Heartbeat)


def test_a_message_listing_more_than_its_limit_is_refused_before_any_work(
    raw_socket: zmq.Socket[bytes], client: Client
) -> None:
    # One Submit of 500,000 actions held the loop for seconds while every other client waited.
    many = [{"id": f"a{i}", "kind": "no.such.kind"} for i in range(MAX_ACTIONS_PER_SUBMIT + 1)]
    body = msgpack.packb({"actions": many})
    started = time.monotonic()
    reply = _exchange(raw_socket, wire.frame(b"submit", body))
    assert isinstance(reply, Error) and reply.code == "bad_schema" and "at most 4096" in reply.message
    assert time.monotonic() - started < 1.0
    assert client.call("echo", {"value": 1}) == 1


def test_raw_submit_of_unknown_kind_names_it(raw_socket: zmq.Socket[bytes]) -> None:
    reply = _exchange(raw_socket, wire.encode(Submit(actions=[Action(id="zz", kind="no.such.tool")])))
    assert isinstance(reply, Error) and reply.code == "unknown_kind" and reply.action_ids == ["zz"]
    assert "no.such.tool" in reply.message
    reply = _exchange(raw_socket, wire.encode(Submit(actions=[Action(id="yy", kind="sleep", payload={})])))
    assert isinstance(reply, Error) and reply.code == "bad_payload" and "seconds" in reply.message


def test_other_clients_cannot_take_an_action_id(raw_socket: zmq.Socket[bytes], client: Client) -> None:
    fut = client.submit([Action(id="owned-by-client", kind="sleep", payload={"seconds": 0.2})])[0]
    client.ping()  # same connection, in order: the server has the submission now
    reply = _exchange(raw_socket, wire.encode(Submit(actions=[Action(id="owned-by-client", kind="echo")])))
    assert isinstance(reply, Error) and reply.code == "conflict"
    assert fut.result(10).ok


def test_stored_result_is_resent_until_acknowledged(raw_socket: zmq.Socket[bytes]) -> None:
    action = Action(id="resend-me", kind="echo", payload={"value": 42})
    first = _exchange(raw_socket, wire.encode(Submit(actions=[action])))  # resubmitted at once: again
    again = _exchange(raw_socket, wire.encode(Submit(actions=[action])))
    assert isinstance(first, Results) and isinstance(again, Results)
    assert first.results[0].value == again.results[0].value == 42


def test_a_failing_scheduler_stops_the_loop_loudly_instead_of_dropping_work(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Fail-stop: events the scheduler did not apply would leave actions queued forever.
    from tangram_env.server import builtin_tools  # noqa: F401  (sleep)
    from tangram_env.server.cli import build
    from tangram_env.server.config import ServerSettings
    from tangram_env.server.scheduler import FCFSScheduler
    from tangram_env.server.scheduler.events import ActionArrived, Decision, Event

    class Broken(FCFSScheduler):
        def handle(self, events: Sequence[Event], now: float) -> list[Decision]:
            if any(isinstance(ev, ActionArrived) for ev in events):
                raise RuntimeError("scheduler bug")
            return super().handle(events, now)

    settings = ServerSettings(bind="tcp://127.0.0.1:0", cpus=1, mem_mb=256, entry_point_plugins=False)
    orchestrator = build(settings, scheduler=Broken())
    peer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    try:
        peer.connect(orchestrator.address)
        peer.send(wire.encode(Submit(actions=[Action(kind="sleep", payload={"seconds": 0})])))
        with caplog.at_level("CRITICAL"), pytest.raises(RuntimeError, match="scheduler bug"):
            orchestrator.serve_forever()
    finally:
        peer.close(linger=0)
    assert any("loop failed" in r.message and r.exc_info for r in caplog.records)


def test_a_closed_client_acknowledges_its_last_results() -> None:
    # The last results of a client that closed were never acknowledged (no Submit came to carry the
    # acknowledgement), so the orchestrator kept them result_ttl_s (600 s) for nobody.
    from tests.conftest import ServerProcess, wait_for

    srv = ServerProcess()
    try:
        with Client(srv.address) as watcher:
            for value in range(3):
                client = Client(srv.address)
                assert client.call("echo", {"value": value}) == value
                client.close()
            wait_for(lambda: watcher.stats()["entries"] == 0, 10, "the closed clients' results forgotten")
    finally:
        srv.stop()
