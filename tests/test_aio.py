"""The asyncio API: AsyncClient, await env.areset()/astep(), the async vector env, against a real server."""

from __future__ import annotations

import asyncio
import threading
import time

import gymnasium
import numpy as np
import pytest

import tangram_env
from tangram_env import Action, AsyncClient
from tangram_env.errors import ActionError, AlreadyPendingCallError, ClosedEnvError, LoopInUseError
from tests.plugins import EchoEnv

tangram_env.register("test-echo", "tests.plugins:EchoEnv")


def test_async_client_runs_many_actions_concurrently_on_one_thread(server) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with AsyncClient(server.address) as client:
            values = await asyncio.gather(*(client.call("echo", {"value": i}) for i in range(500)))
            assert values == list(range(500))
            # Sleeps overlap: 20 x 0.3 s in well under 20 x 0.3 s.
            t0 = time.monotonic()
            await asyncio.gather(*(client.call("sleep", {"seconds": 0.3}) for _ in range(20)))
            assert time.monotonic() - t0 < 4.0
            failed = await client.run("test.raise", {"message": "no"})
            assert not failed.ok and failed.error_type == "error"
            with pytest.raises(ActionError, match="no"):
                await client.call("test.raise", {"message": "no"})
            assert await client.ping()
            assert "echo" in await client.kinds()

    asyncio.run(main())


def test_a_cancelled_await_cancels_the_action_and_the_client_goes_on(server) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with AsyncClient(server.address) as client:
            slow = asyncio.ensure_future(client.call("sleep", {"seconds": 30}))
            await asyncio.sleep(0.2)
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            assert await client.call("echo", {"value": "after"}) == "after"

    asyncio.run(main())


def test_a_closed_async_client_fails_clearly(server) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        client = AsyncClient(server.address)
        await client.aclose()
        with pytest.raises(ClosedEnvError):
            await client.call("echo", {"value": 1})

    asyncio.run(main())


def test_env_astep_matches_step_and_shares_the_generator(server) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        envs = [EchoEnv(tag=f"e{i}", rounds=2, address=server.address) for i in range(32)]
        try:
            await asyncio.gather(*(env.areset(seed=i) for i, env in enumerate(envs)))
            for t in range(1, 4):
                outs = await asyncio.gather(*(env.astep(t) for env in envs))
                for obs, reward, terminated, truncated, info in outs:
                    assert (obs, reward, terminated, truncated) == (t, 1.0, False, False)
                    assert len(info["actions"]) == 2 and all(a["ok"] for a in info["actions"])  # two rounds
            assert all(not env.mismatches for env in envs)
            # The sync API on the same env, between async calls, sees the same state.
            assert envs[0].step(4)[0] == 4
        finally:
            for env in envs:
                env.close()

    asyncio.run(main())


def test_two_concurrent_asteps_on_one_env_are_refused(server) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        env = EchoEnv(address=server.address)
        try:
            await env.areset()
            first = asyncio.ensure_future(env.astep(1))
            await asyncio.sleep(0)
            with pytest.raises(AlreadyPendingCallError):
                await env.astep(2)
            assert (await first)[1] == 1.0
            assert (await env.astep(2))[0] == 2  # the refusal left the env usable
        finally:
            env.close()

    asyncio.run(main())


def test_a_sync_reset_while_an_astep_runs_is_refused(server) -> None:  # type: ignore[no-untyped-def]
    # It was accepted: the running step then finished into the new episode, counted as its step.
    async def main() -> None:
        env = EchoEnv(address=server.address, sleep_s=0.3)
        try:
            await env.areset()
            running = asyncio.ensure_future(env.astep(1))
            await asyncio.sleep(0.05)
            with pytest.raises(AlreadyPendingCallError, match="step call is already pending"):
                env.reset()
            assert (await running)[1] == 1.0 and env.elapsed_steps == 1
            await env.areset()
            assert env.elapsed_steps == 0
        finally:
            env.close()

    asyncio.run(main())


def test_an_astep_whose_loop_was_closed_under_it_leaves_the_env_usable(server) -> None:  # type: ignore[no-untyped-def]
    # A trainer waits on a batch with a deadline and closes the loop: the call never ends, and the env
    # refused every later call with AlreadyPendingCallError, for good.
    env = EchoEnv(address=server.address, sleep_s=1.0)
    loop = asyncio.new_event_loop()
    try:
        env.reset()
        task = loop.create_task(env.astep(1))
        loop.run_until_complete(asyncio.wait([task], timeout=0.2))
        loop.close()
        with pytest.raises(gymnasium.error.ResetNeeded, match="step"):  # the step never finished
            env.step(2)
        env.reset()
        assert env.step(2)[1] == 1.0
        assert asyncio.run(env.astep(3))[0] == 2
    finally:
        env.close()


def test_env_accepts_an_async_client_and_shares_its_connection(server) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with AsyncClient(server.address) as client:
            env = EchoEnv(client=client)
            await env.areset()
            assert env.client is client.sync and env.aclient is client
            assert (await env.astep(3))[1] == 1.0
            env.close()
            assert await client.call("echo", {"value": 2}) == 2  # the env did not own it

    asyncio.run(main())


def test_vector_astep_yields_envs_as_they_finish_and_autoresets(server) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        vec = tangram_env.make_vec("test-echo", num_envs=4, address=server.address)
        try:
            obs, _ = await vec.areset(seed=0)
            assert list(obs) == [0, 0, 0, 0]
            order = []
            async for i, (o, reward, _term, _trunc, _info) in vec.astep_as_completed([1, 1, 1, 1]):
                order.append(i)
                assert (o, reward) == (1, 1.0)
            assert sorted(order) == [0, 1, 2, 3]
            for _ in range(4):  # EchoEnv truncates at step 5
                obs, rewards, terminations, truncations, _ = await vec.astep([1, 1, 1, 1])
            assert truncations.all() and not terminations.any()
            obs, rewards, _, truncations, _ = await vec.astep([1, 1, 1, 1])  # the autoreset step
            assert list(obs) == [0, 0, 0, 0] and not rewards.any() and not truncations.any()
            with pytest.raises(ValueError, match="expected 4 actions"):
                await vec.astep([1])
        finally:
            vec.close()

    asyncio.run(main())


def test_vector_astep_autoresets_in_the_same_step(server) -> None:  # type: ignore[no-untyped-def]
    from gymnasium.vector import AutoresetMode

    async def main() -> None:
        vec = tangram_env.make_vec("test-echo", num_envs=2, address=server.address, autoreset_mode="SameStep")
        try:
            await vec.areset(seed=0)
            for step in range(1, 5):  # EchoEnv observes its step count, and truncates at step 5
                obs, rewards, _, truncations, infos = await vec.astep([1, 1])
                assert list(obs) == [step, step] and "final_obs" not in infos
            obs, rewards, _, truncations, infos = await vec.astep([1, 1])
            assert truncations.all() and rewards.tolist() == [1.0, 1.0]
            assert list(obs) == [0, 0] and list(infos["final_obs"]) == [5, 5]  # reset in the same step
            assert vec.metadata["autoreset_mode"] is AutoresetMode.SAME_STEP
            obs, rewards, _, truncations, _ = await vec.astep([1, 1])  # the new episodes' first steps
            assert list(obs) == [1, 1] and rewards.tolist() == [1.0, 1.0] and not truncations.any()
        finally:
            vec.close()

    asyncio.run(main())


def test_sessions_a_slow_action_does_not_hold_up_a_fast_one(server) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with AsyncClient(server.address) as client:
            slow = asyncio.ensure_future(client.call("sleep", {"seconds": 2.0}))
            t0 = time.monotonic()
            assert await client.call("echo", {"value": "fast"}) == "fast"
            assert time.monotonic() - t0 < 1.5 and not slow.done()
            await slow

    asyncio.run(main())


def test_gymnasium_make_vec_returns_tangrams_vector_env(server) -> None:  # type: ignore[no-untyped-def]
    vec = gymnasium.make_vec("tangram/test-echo", num_envs=3, address=server.address, tag="g")
    try:
        assert isinstance(vec, tangram_env.TangramVectorEnv) and vec.num_envs == 3
        assert len({id(env.client) for env in vec.envs}) == 1  # one connection for all
        vec.reset(seed=1)
        _, rewards, *_ = vec.step(np.array([1, 2, 3]))
        assert rewards.tolist() == [1.0, 1.0, 1.0]
        assert vec.get_attr("tag") == ("g", "g", "g")
        vec.set_attr("tag", ["x", "y", "z"])
        assert vec.get_attr("tag") == ("x", "y", "z")
        vec.set_attr("rounds", 2)
        assert vec.call("get_wrapper_attr", "tag") == ("x", "y", "z")  # a method is called
        assert vec.call("t") == (1, 1, 1)  # a plain attribute is read
        with pytest.raises(ValueError, match="expected 3 values"):
            vec.set_attr("tag", ["only one"])
    finally:
        vec.close()


def test_async_client_batches_a_turns_submissions(server) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with AsyncClient(server.address) as client:
            futures = [client.submit([Action(kind="echo", payload={"value": i})])[0] for i in range(50)]
            assert client.outstanding >= 50  # queued for the end of this turn of the loop
            results = await asyncio.gather(*futures)
            assert [r.value for r in results] == list(range(50))

    asyncio.run(main())


def test_one_async_client_serves_loop_after_loop(server) -> None:  # type: ignore[no-untyped-def]
    client = AsyncClient(server.address)
    try:
        for n in range(3):  # each asyncio.run is a new event loop

            async def main(n: int = n) -> list[int]:
                return list(
                    await asyncio.gather(*(client.call("echo", {"value": n * 10 + i}) for i in range(5)))
                )

            assert asyncio.run(main()) == [n * 10 + i for i in range(5)]
    finally:
        client.close()


def test_async_actions_go_on_the_loops_own_socket_not_the_sync_clients(server) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with AsyncClient(server.address) as client:
            slow = asyncio.ensure_future(client.call("sleep", {"seconds": 0.5}))
            await asyncio.sleep(0.1)
            assert client.outstanding == 1 and client.sync.outstanding == 0
            # The sync client's IO thread can be blocked outright: the loop still gets its results.
            with client.sync._sock_lock:
                assert await client.call("echo", {"value": "direct"}) == "direct"
                await slow
            assert client.identity != client.sync.identity

    asyncio.run(main())


def test_a_second_running_loop_on_another_thread_gets_a_clear_error(server) -> None:  # type: ignore[no-untyped-def]
    client = AsyncClient(server.address)
    started = threading.Event()
    errors: list[BaseException] = []

    async def other_loop() -> None:
        started.wait(10)
        try:
            await client.call("echo", {"value": 1})
        except BaseException as exc:
            errors.append(exc)

    async def main() -> None:
        slow = asyncio.ensure_future(client.call("sleep", {"seconds": 0.5}))
        await asyncio.sleep(0.05)
        started.set()
        thread = threading.Thread(target=asyncio.run, args=(other_loop(),))
        thread.start()
        await asyncio.to_thread(thread.join, 10)
        await slow  # the loop that owns the socket is not disturbed

    try:
        asyncio.run(main())
    finally:
        client.close()
    assert len(errors) == 1 and isinstance(errors[0], LoopInUseError)
    assert "one AsyncClient per event loop" in str(errors[0])


def test_envs_on_one_sync_client_step_from_event_loops_on_several_threads(server) -> None:  # type: ignore[no-untyped-def]
    with tangram_env.Client(server.address) as shared:
        envs = [[EchoEnv(tag=f"t{t}e{i}", client=shared) for i in range(8)] for t in range(3)]

        async def rollouts(mine: list[EchoEnv]) -> list[float]:
            await asyncio.gather(*(env.areset() for env in mine))
            rewards = []
            for step in range(1, 4):
                outs = await asyncio.gather(*(env.astep(step) for env in mine))
                rewards += [out[1] for out in outs]
            return rewards

        results: list[list[float]] = []
        threads = [
            threading.Thread(target=lambda m=m: results.append(asyncio.run(rollouts(m)))) for m in envs
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert results == [[1.0] * 24] * 3
        assert len({id(env.aclient) for env in envs[0]}) == 1  # a thread's envs share its twin
        for group in envs:
            for env in group:
                env.close()
    assert all(twin._closed for twin in tangram_env.aio._TWINS.get(shared, {}).values())


def _sessions(client: tangram_env.Client) -> int:
    figures = client.stats()["workers"]
    return sum(int(w.get("figures", {}).get("sandboxes", {}).get("sessions", 0)) for w in figures.values())


def test_a_session_opened_on_a_loop_keeps_its_sandbox_across_loops_and_ends_after_it(server) -> None:  # type: ignore[no-untyped-def]
    with tangram_env.Client(server.address) as sync:
        client = AsyncClient(client=sync)
        box = client.sandbox()
        before = _sessions(sync)

        async def write() -> None:
            await box.write_file("kept.txt", "from the first loop")

        async def read() -> bytes:
            return await box.read_file("kept.txt")

        asyncio.run(write())
        assert asyncio.run(read()) == b"from the first loop"  # a second loop, the same socket and sandbox
        assert _sessions(sync) == before + 1
        box._end()  # no loop runs now: the session still ends, through the socket that opened it
        deadline = time.monotonic() + 10
        while _sessions(sync) > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _sessions(sync) == before
        client.close()


class TouchEnv(tangram_env.TangramEnv[str, str]):
    """Each step appends its action to a file through ``test.touch``: a run the test can see."""

    def __init__(self, path: str, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.path = path
        self.observation_space = gymnasium.spaces.Text(16, min_length=0)
        self.action_space = gymnasium.spaces.Text(64, min_length=0)

    def _reset(self, *, seed, options):  # type: ignore[no-untyped-def]
        return "go", {}
        yield []

    def _step(self, action):  # type: ignore[no-untyped-def]
        (result,) = yield [Action(kind="test.touch", payload={"path": self.path, "line": action})]
        return tangram_env.graded(result, "the touch"), 1.0, False, False, {}


def test_closing_an_env_cancels_the_actions_its_astep_awaits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The astep's action used to stay queued, run after the close for nobody, and its caller learned of
    # the close only then (seconds later, behind whatever held the cores).
    from tests.conftest import ServerProcess

    path = tmp_path / "touched.txt"
    srv = ServerProcess("--cpus", "1")

    async def main() -> None:
        async with AsyncClient(srv.address) as client:
            hogs = [asyncio.ensure_future(client.run("sleep", {"seconds": 2})) for _ in range(10)]
            await asyncio.sleep(0.5)  # the one core is full: the step's action waits in the queue
            env = TouchEnv(str(path), client=client)
            await env.areset()
            stepping = asyncio.ensure_future(env.astep("ran after the close"))
            await asyncio.sleep(0.3)
            start = time.monotonic()
            env.close()
            with pytest.raises(ClosedEnvError, match="closed while this call ran"):
                await stepping
            assert time.monotonic() - start < 1.0  # at once, not when the hogs are done
            await asyncio.gather(*hogs)
            await asyncio.sleep(1.0)  # time enough for a queued action to have run
            assert not path.exists()

    try:
        asyncio.run(main())
    finally:
        srv.stop()


def test_an_async_call_refused_before_it_starts_leaves_the_episode_as_it_was(server) -> None:  # type: ignore[no-untyped-def]
    # A closed client, or one another thread's loop drives, used to be found only after the step had
    # begun: the episode was over (needs_reset) and the env's generator one turn on, for nothing sent.
    async def on_a_closed_client() -> None:
        client = AsyncClient(server.address)
        env = EchoEnv(client=client)
        try:
            await env.areset()
            await client.aclose()
            with pytest.raises(ClosedEnvError, match="client is closed"):
                await env.astep(1)
            assert not env.needs_reset and env.t == 0
        finally:
            env.close()

    asyncio.run(on_a_closed_client())

    client = AsyncClient(server.address)
    env = EchoEnv(client=client)
    env.reset()
    started, stop = threading.Event(), threading.Event()

    async def holder() -> None:  # the client's loop, running on another thread
        await client.call("echo", {"value": 1})
        started.set()
        while not stop.is_set():
            await asyncio.sleep(0.02)

    thread = threading.Thread(target=asyncio.run, args=(holder(),))
    thread.start()
    try:
        assert started.wait(10)

        async def from_a_second_loop() -> None:
            with pytest.raises(LoopInUseError):
                await env.astep(1)
            assert not env.needs_reset and env.t == 0

        asyncio.run(from_a_second_loop())
    finally:
        stop.set()
        thread.join(10)
        env.close()
        client.close()
