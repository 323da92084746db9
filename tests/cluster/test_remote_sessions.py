"""Sandbox sessions whose sandboxes live on a remote worker end there too: closed by their client, or
ended by the orchestrator (``session_idle_s``)."""

from __future__ import annotations

import time

import pytest

from tangram_env import Action, Client
from tangram_env.errors import ActionError
from tests.cluster.procs import Processes, child_env, start_orchestrator, start_worker, wait_for


def _sandboxes(client: Client) -> dict[str, object]:
    figures = client.stats()["workers"]["remote"].get("figures") or {}
    return figures.get("sandboxes", {})  # type: ignore[no-any-return]


@pytest.mark.timeout(120)
def test_sessions_on_a_remote_worker_are_reset_when_they_end(procs: Processes) -> None:
    # The orchestrator used to end only its own pool's sessions: a remote worker kept every session's
    # sandbox (its files, processes and memory) until it stopped, and made a cold one per episode.
    env = child_env(TANGRAM_SERVER_SESSION_IDLE_S="1.5s")
    _, address = start_orchestrator(procs, "tcp://127.0.0.1:0", env=env)
    start_worker(procs, address, "remote", cpus=2, extra=["--mem-mb", "4096"])
    with Client(address) as client:
        wait_for(lambda: "remote" in client.stats()["workers"], 30, "the worker to join")
        for episode in range(3):
            with client.sandbox() as box:
                box.write_file(f"episode-{episode}", "x")
                out = box.bash("ls")
                assert out.stdout.split() == [f"episode-{episode}"]  # none of the earlier files
        figures = wait_for(
            lambda: (f := _sandboxes(client)) and f["sessions"] == 0 and f["resets"] == 3 and f, 15, "resets"
        )
        assert figures["created"] == 1 and figures["warm_hits"] == 2  # one sandbox served the three

        with client.sandbox() as idle:
            idle.write_file("work.txt", "gone")
            time.sleep(4)  # past session_idle_s, the client alive
            with pytest.raises(ActionError, match="session_idle_s") as failed:
                idle.read_file("work.txt")
            assert failed.value.error_type == "sandbox_died"


@pytest.mark.timeout(120)
def test_a_remote_workers_warm_sandboxes_are_closed_once_idle(procs: Processes) -> None:
    # Only the orchestrator ran its pool's upkeep: a remote worker kept every sandbox given back warm
    # (up to 64 per image, their memory and processes) for as long as it ran.
    _, address = start_orchestrator(procs, "tcp://127.0.0.1:0")
    start_worker(
        procs, address, "remote", cpus=2, extra=["--mem-mb", "4096"], env={"TANGRAM_SERVER_WARM_IDLE_S": "1s"}
    )
    with Client(address) as client:
        wait_for(lambda: "remote" in client.stats()["workers"], 30, "the worker to join")
        with client.sandbox() as box:
            assert box.bash("echo used").stdout == "used\n"
        figures = wait_for(lambda: (f := _sandboxes(client)) and f.get("shrunk") == 1 and f, 20, "the close")
        assert figures["resets"] == 1 and figures["images"]["default"]["warm"] == 0, figures


@pytest.mark.timeout(120)
def test_a_session_whose_worker_dies_fails_instead_of_going_on_elsewhere(procs: Processes) -> None:
    # Its commands used to be requeued onto another worker and run in an empty sandbox there: the
    # agent's files seemed to vanish, and a grader could read the empty tree as the agent's work.
    env = child_env(TANGRAM_SERVER_WORKER_TIMEOUT_S="2s")
    _, address = start_orchestrator(procs, "tcp://127.0.0.1:0", env=env)
    doomed = start_worker(procs, address, "doomed", cpus=2, extra=["--mem-mb", "4096"])
    with Client(address) as client:
        box = client.sandbox()
        wait_for(lambda: "doomed" in client.stats()["workers"], 30, "the worker to join")
        box.write_file("state.txt", "the agent's work")
        start_worker(procs, address, "spare", cpus=2, extra=["--mem-mb", "4096"])
        wait_for(lambda: "spare" in client.stats()["workers"], 30, "the spare worker to join")
        doomed.kill()
        wait_for(lambda: "doomed" not in client.stats()["workers"], 30, "the dead worker to be dropped")
        for _ in range(2):
            with pytest.raises(ActionError, match="worker doomed was lost") as failed:
                box.bash("cat state.txt")
            assert failed.value.error_type == "sandbox_died"
        box.close()
        with client.sandbox(session_id=box.session_id) as again:  # ended, the id starts afresh
            assert again.bash("ls").stdout == ""


@pytest.mark.timeout(120)
def test_a_command_cancelled_on_a_remote_worker_is_killed_there(procs: Processes) -> None:
    # Cancel reached only queued actions: the command ran on, on the worker, until its time limit.
    _, address = start_orchestrator(procs, "tcp://127.0.0.1:0")
    start_worker(procs, address, "remote", cpus=2, extra=["--mem-mb", "4096"])
    with Client(address) as client:
        wait_for(lambda: "remote" in client.stats()["workers"], 30, "the worker to join")
        slow = Action(kind="bash", payload={"command": "sleep 29.3"}, affinity="remote-cancel")
        (fut,) = client.submit([slow])
        wait_for(lambda: client.stats()["running"] == 1, 30, "the command to start")
        time.sleep(0.5)
        t0 = time.monotonic()
        client.cancel([slow.id])
        result = fut.result(15)
        assert result.error_type == "cancelled" and result.worker == "remote", result
        assert time.monotonic() - t0 < 5.0
        after = client.run("bash", {"command": "echo next"}, affinity="remote-cancel", timeout=30)
        assert after.ok and after.value["stdout"] == "next\n", after
        client.close_sessions(["remote-cancel"])
