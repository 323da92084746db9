"""Sandbox sessions as a public API: each call an action with the session's affinity, in a real sandbox."""

from __future__ import annotations

import asyncio
import time

import pytest

import tangram_env.client
from tangram_env import AsyncClient, Client
from tangram_env.errors import ActionError, ClosedEnvError
from tangram_env.session import AsyncSandboxSession, SandboxSession
from tests.conftest import ServerProcess


def test_sync_session_keeps_files_between_calls_and_reports_commands(client: Client) -> None:
    with client.sandbox() as box:
        box.write_file("pkg/data.bin", bytes(range(256)))
        assert box.read_file("pkg/data.bin") == bytes(range(256))
        out = box.bash("ls pkg && wc -c < pkg/data.bin && echo oops >&2 && exit 3")
        assert out.exit_code == 3 and not out.ok
        assert out.stdout.split() == ["data.bin", "256"] and out.stderr.strip() == "oops"
        slow = box.bash("sleep 5", timeout_s=1)
        assert slow.killed_by == "timeout" and not slow.ok
        with pytest.raises(ActionError, match=r"missing\.txt"):
            box.read_file("missing.txt")
        assert box.bash("cat pkg/data.bin | wc -c").stdout.strip() == "256"  # still usable
    with pytest.raises(ClosedEnvError):
        box.bash("true")


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def test_a_sparse_file_too_large_to_read_is_refused_before_it_is_read(server, client: Client) -> None:  # type: ignore[no-untyped-def]
    # 1 GiB on no disk: read_file used to read it all into the orchestrator, then refuse it.
    before = _peak_rss_mb(server.process.pid)
    with client.sandbox() as box:
        assert box.bash("truncate -s 1000M sparse.bin").ok
        with pytest.raises(ActionError, match=r"sparse\.bin holds 1048576000 bytes, more than 4194304"):
            box.read_file("sparse.bin")
    assert _peak_rss_mb(server.process.pid) - before < 200


def test_another_client_cannot_use_a_session_whose_id_it_learnt(server, client: Client) -> None:  # type: ignore[no-untyped-def]
    with client.sandbox() as box, Client(server.address) as other:
        box.write_file("secret.txt", "mine")
        intruder = SandboxSession(other, session_id=box.session_id)
        with pytest.raises(ActionError, match="belongs to another client"):
            intruder.bash("cat secret.txt")
        intruder.close()  # ignored: not its session
        assert box.read_file("secret.txt") == b"mine"

        async def twin_reads() -> bytes:  # an AsyncClient made from the session's client may use it
            twin = AsyncClient(client=client)
            try:
                return await AsyncSandboxSession(twin, session_id=box.session_id).read_file("secret.txt")
            finally:
                await twin.aclose()

        assert asyncio.run(twin_reads()) == b"mine"


def test_sessions_are_separate_sandboxes(client: Client) -> None:
    with client.sandbox() as a, client.sandbox() as b:
        a.write_file("who", "a")
        b.write_file("who", "b")
        assert (a.read_file("who"), b.read_file("who")) == (b"a", b"b")


def test_async_sessions_run_concurrently(server) -> None:  # type: ignore[no-untyped-def]
    async def agent(client: AsyncClient, n: int) -> str:
        async with client.sandbox(image="default") as box:
            await box.write_file("n.txt", str(n))
            out = await box.bash("python3 -c 'print(int(open(\"n.txt\").read()) ** 2)'", timeout_s=30)
            assert out.ok, out
            return out.stdout.strip()

    async def main() -> list[str]:
        async with AsyncClient(server.address) as client:
            return list(await asyncio.gather(*(agent(client, n) for n in range(6))))

    assert asyncio.run(main()) == [str(n * n) for n in range(6)]


def _agent_of_workspace(marker: str) -> int | None:
    """Host pid of the exec agent whose sandbox's workspace holds the file ``marker``."""
    import os

    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if not (argv and argv[0].endswith(b"python3") and b"The exec agent" in b"".join(argv)):
            continue
        with open(f"/proc/{entry}/status") as f:  # the agent's bubblewrap (pid 1 of its namespace)
            parent = next(int(line.split()[1]) for line in f if line.startswith("PPid:"))
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            bwrap = f.read().split(b"\0")
        work = bwrap[bwrap.index(b"/workspace") - 1].decode() if b"/workspace" in bwrap else ""
        if work and os.path.exists(os.path.join(work, marker)):
            return int(entry)
    return None


def test_a_session_whose_sandbox_dies_fails_its_next_commands_until_it_ends(client: Client) -> None:
    # The command that finds the agent dead fails as sandbox_died (never as the command's own
    # result). The session's files went with the sandbox, so its later commands fail too: they used
    # to run in a fresh, empty sandbox, and a trajectory was graded on a state its agent never made.
    import os
    import signal
    import uuid

    marker = f"marker-{uuid.uuid4().hex}"
    with client.sandbox() as box:
        box.write_file(marker, "x")
        assert box.bash("true").ok  # a cold sandbox starts its agent at its first command
        agent = _agent_of_workspace(marker)
        if agent is None:
            pytest.skip("this host gives sandboxes no exec agent")
        os.kill(agent, signal.SIGKILL)
        for _ in range(2):
            with pytest.raises(ActionError, match=r"lost its sandbox|broken") as failed:
                box.bash(f"ls {marker}")
            assert failed.value.error_type == "sandbox_died"
    with client.sandbox(session_id=box.session_id) as again:  # the id, once ended, starts afresh
        assert again.bash("echo again").stdout.strip() == "again"


def test_a_session_idle_past_session_idle_s_is_ended_and_says_so(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A live client's forgotten session used to hold its sandbox's memory until the client closed.
    config = tmp_path / "settings.json"
    config.write_text('{"session_idle_s": 1.5}')
    srv = ServerProcess("--config", str(config))
    try:
        with Client(srv.address) as client:
            with client.sandbox() as busy, client.sandbox() as idle:
                idle.write_file("work.txt", "gone")
                busy.write_file("work.txt", "kept")
                for _ in range(8):  # 4 s, one command every half second
                    assert busy.bash("cat work.txt").stdout == "kept"
                    time.sleep(0.5)
                with pytest.raises(ActionError, match="session_idle_s") as failed:
                    idle.read_file("work.txt")
                assert failed.value.error_type == "sandbox_died"  # never an empty sandbox's answer
            with client.sandbox(session_id=idle.session_id) as again:  # once ended, the id starts afresh
                assert again.bash("ls").stdout == ""
    finally:
        srv.stop()


def test_a_session_outlives_its_client_thinking_longer_than_the_silence_limit(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The orchestrator ends the sessions of a client silent for client_timeout_s: with nothing
    # outstanding the client used to send nothing, and the sandbox came back empty.
    # A session whose first command the caller's thread answered itself (the direct path: a warm
    # sandbox answers within milliseconds) got no heartbeats either: the parked IO thread never
    # heard of it. A long direct wait makes every command here take that path.
    monkeypatch.setattr(tangram_env.client, "_DIRECT_WAIT_S", 5.0)
    config = tmp_path / "settings.json"
    config.write_text('{"client_timeout_s": 3}')
    srv = ServerProcess("--config", str(config))
    try:
        with Client(srv.address) as client, client.sandbox() as box:
            box.write_file("work.txt", "kept")
            time.sleep(7)  # the policy thinks
            assert box.read_file("work.txt") == b"kept"

        async def think() -> bytes:
            async with AsyncClient(srv.address) as aclient, aclient.sandbox() as abox:
                await abox.write_file("work.txt", "kept")
                await asyncio.sleep(7)
                return await abox.read_file("work.txt")

        assert asyncio.run(think()) == b"kept"

        # An AsyncClient made from a sync client, its loop ended between batches (asyncio.run per
        # batch): the sync client heartbeats for the sessions it opened.
        with Client(srv.address) as client:
            twin = AsyncClient(client=client)

            async def write() -> str:
                box = AsyncSandboxSession(twin)
                await box.write_file("work.txt", "kept")
                return box.session_id

            async def read(session_id: str) -> bytes:
                return await AsyncSandboxSession(twin, session_id=session_id).read_file("work.txt")

            session_id = asyncio.run(write())
            time.sleep(7)  # no loop runs: the twin is silent
            assert asyncio.run(read(session_id)) == b"kept"
            twin.close_sessions([session_id])
            assert session_id not in client._core.sessions  # its heartbeats for it stop
    finally:
        srv.stop()


def test_an_unknown_sandbox_option_names_the_options(client: Client) -> None:
    with pytest.raises(
        TypeError, match=r"unknown sandbox option 'imgae'; did you mean 'image'\?: the options are"
    ):
        client.sandbox(imgae="default")
    with pytest.raises(TypeError, match=r"limits .* come from the orchestrator's sandbox settings"):
        client.sandbox(mem_mb=10)


def test_a_wait_that_times_out_says_for_which_action_and_that_it_goes_on(client: Client) -> None:
    # It was a bare TimeoutError(): no word of which call, or of the action still running.
    with pytest.raises(
        TimeoutError, match=r"no result for 'test.judge' \(id .+\) within 1e-06s; the action goes on"
    ):
        client.score("test.judge", ["good"], timeout=1e-6)
    assert client.score("test.judge", ["good"], timeout=60) == [1.0]
