"""Messages over ``max_body``: each action too large to travel fails alone, naming why, and the
actions packed with it arrive (the receiver drops an oversized body whole, every id in it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tangram_env import Action, Client, wire
from tangram_env.protocol import Result, Results, Submit
from tests.conftest import PLUGINS, ROOT, ServerProcess

LIMIT = 2**20  # the orchestrator's and the client's max_body: a few results of 300 KiB overflow one message
WORKER_FLAG = 256 * 2**10  # the remote worker's --max-body: it adopts the orchestrator's on registering


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Echo runs on the orchestrator itself; ``test.text`` only fits a remote worker's cores, so
    results come both ways."""
    config = tmp_path_factory.mktemp("size") / "settings.json"
    config.write_text(json.dumps({"max_body": LIMIT}))
    srv = ServerProcess("--config", str(config), "--cpus", "0.01", "--no-gpu-worker")
    argv = [
        sys.executable,
        "-m",
        "tangram_env.server.worker",
        "--connect",
        srv.address,
        "--worker-id",
        "remote",
    ]
    argv += ["--cpus", "2", "--mem-mb", "1024", "--plugin", PLUGINS, "--max-body", str(WORKER_FLAG)]
    worker = subprocess.Popen(
        argv,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    try:
        with Client(srv.address) as c:
            deadline = time.monotonic() + 30
            while "remote" not in c.stats()["workers"]:
                assert time.monotonic() < deadline and worker.poll() is None, "the remote worker did not join"
                time.sleep(0.1)
        yield srv
    finally:
        worker.terminate()
        worker.wait(timeout=10)
        srv.stop()


@pytest.fixture
def small_client(small_server: ServerProcess) -> Iterator[Client]:
    c = Client(small_server.address, max_body=LIMIT)
    yield c
    c.close()


def _results(client: Client, actions: list[Action]) -> list[Result]:
    return [f.result(timeout=30) for f in client.submit(actions)]


def test_results_that_overflow_one_message_all_arrive(small_client: Client) -> None:
    # Six echoes finish in one turn of the loop; together they are about twice the limit.
    values = [chr(ord("a") + i) * 300_000 for i in range(6)]
    results = _results(small_client, [Action(kind="echo", payload={"value": v}) for v in values])
    assert [r.value for r in results] == values


def test_results_of_a_remote_worker_that_overflow_one_message_all_arrive(small_client: Client) -> None:
    results = _results(small_client, [Action(kind="test.text", payload={"n": 300_000 + i}) for i in range(8)])
    assert [len(r.value) for r in results] == [300_000 + i for i in range(8)]
    assert {r.worker for r in results} == {"remote"}


def test_a_remote_worker_takes_the_orchestrators_limit_whatever_its_flag_says(small_client: Client) -> None:
    # 700 KB reach the worker only under the orchestrator's limit, not its own flag's (a dropped
    # Dispatch used to hold the action until the worker was declared lost, taking its other work along).
    line = "y" * 700_000
    (touched,) = _results(
        small_client, [Action(kind="test.touch", payload={"path": os.devnull, "line": line})]
    )
    assert touched.ok and touched.worker == "remote" and touched.value == line  # and back, within LIMIT


def test_a_result_too_large_to_send_fails_alone(small_client: Client) -> None:
    actions = [Action(kind="echo", payload={"value": "before"})]
    actions += [Action(kind="test.text", payload={"n": 2 * LIMIT})]
    actions += [Action(kind="echo", payload={"value": "after"})]
    first, big, last = _results(small_client, actions)
    assert (first.value, last.value) == ("before", "after")
    assert not big.ok and big.error_type == "error" and big.worker == "remote"  # split by the worker
    assert "result cannot be sent" in big.message and f"limit of {LIMIT}" in big.message
    assert "return less" in big.message  # the fix, not only the cause
    assert small_client.call("test.text", {"n": 5}) == "xxxxx"  # the connection serves on


def test_submissions_over_the_limit_are_split_and_a_payload_too_large_is_rejected_alone(
    small_client: Client,
) -> None:
    # The padding rides in the value: echo refuses a key it does not take.
    padded = [Action(kind="echo", payload={"value": {"i": i, "pad": "p" * 300_000}}) for i in range(6)]
    huge = Action(kind="echo", payload={"value": {"i": "huge", "pad": "h" * 2 * LIMIT}})
    results = _results(small_client, [*padded[:3], huge, *padded[3:]])
    assert [r.value["i"] for r in results[:3] + results[4:]] == list(range(6))
    rejected = results[3]
    assert rejected.error_type == "rejected" and "cannot be sent" in rejected.message
    assert "max_body" in rejected.message
    assert small_client.call("echo", {"value": 1}) == 1


def test_the_direct_path_of_run_rejects_a_payload_too_large(small_client: Client) -> None:
    res = small_client.run("echo", {"value": "h" * 2 * LIMIT})  # no other thread: the caller sends
    assert res.error_type == "rejected" and "max_body" in res.message
    assert small_client.outstanding == 0
    assert small_client.call("echo", {"value": 2}) == 2


def test_encode_within_halves_until_each_part_fits_and_keeps_the_order() -> None:
    actions = [
        Action(kind="echo", id=f"a{i}", payload={"pad": "p" * (100 if i != 4 else 5000)}) for i in range(9)
    ]
    frames, refused = wire.encode_within(Submit(actions=actions), "actions", 1000)
    assert [a.id for a, _ in refused] == ["a4"] and "packs to" in refused[0][1]
    sent = [a.id for data in frames for a in wire.decode(data).actions]  # type: ignore[attr-defined]
    assert sent == [f"a{i}" for i in range(9) if i != 4]
    assert all(wire.body_size(data) <= 1000 for data in frames)
    one, none = wire.encode_within(Submit(actions=actions[:3]), "actions", 1000)
    assert len(one) == 1 and none == []  # the usual case: one message


def test_a_result_that_does_not_encode_goes_as_a_failure() -> None:
    results = [
        Result(action_id="ok", ok=True, value="fine"),
        Result(action_id="bad", ok=True, value="a\ud800"),
    ]
    frames = wire.results_frames(Results(results=results), LIMIT)
    sent = [r for data in frames for r in wire.decode(data).results]  # type: ignore[attr-defined]
    good, bad = sorted(sent, key=lambda r: r.action_id != "ok")
    assert good.value == "fine" and not bad.ok and "does not encode" in bad.message
