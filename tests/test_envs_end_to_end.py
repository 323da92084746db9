"""Envs against a real orchestrator: many clients at once, async steps, vector envs, embedded mode."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import gymnasium
import numpy as np
import pytest

import tangram_env
from tangram_env import AlreadyPendingCallError, Client, ClosedEnvError, NoAsyncCallError
from tests.conftest import wait_for
from tests.plugins import EchoEnv

tangram_env.register("test-echo", "tests.plugins:EchoEnv")


def test_eight_envs_in_eight_threads_get_their_own_results(server) -> None:  # type: ignore[no-untyped-def]
    errors: list[BaseException] = []
    counts: dict[str, int] = {}

    def run(tag: str) -> None:
        try:
            env = EchoEnv(tag=tag, fork=tag.endswith(("0", "1")), address=server.address)
            env.reset(seed=0)
            steps = 0
            for i in range(200):
                _, reward, terminated, truncated, info = env.step(i % 10)
                assert reward == 1.0 and info["tag"] == tag, env.mismatches
                steps += 1
                if terminated or truncated:
                    env.reset()
            counts[tag] = steps
            assert env.mismatches == []
            env.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(f"env{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors, errors
    assert counts == {f"env{i}": 200 for i in range(8)}


def test_async_step_and_typed_errors(server) -> None:  # type: ignore[no-untyped-def]
    env = EchoEnv(tag="a", rounds=3, address=server.address)
    with pytest.raises(NoAsyncCallError):
        env.step_wait()
    env.reset_async(seed=1)
    obs, _info = env.reset_wait()
    assert obs == 0
    env.step_async(4)
    with pytest.raises(AlreadyPendingCallError):
        env.step_async(4)
    _, reward, *_ = env.step_wait(timeout=10)
    assert reward == 1.0
    env.close()
    with pytest.raises(ClosedEnvError):
        env.step(1)


def test_vector_env_submits_together_and_autoresets(server) -> None:  # type: ignore[no-untyped-def]
    venv = tangram_env.make_vec("test-echo", num_envs=4, address=server.address, rounds=2)
    obs, infos = venv.reset(seed=0)
    assert list(obs) == [0, 0, 0, 0]
    truncations = np.zeros(4, dtype=bool)
    for _step in range(5):
        obs, rewards, terminations, truncations, infos = venv.step(np.arange(4))
        assert rewards.tolist() == [1.0] * 4
    assert truncations.all()  # EchoEnv truncates at step 5
    obs, rewards, _terminations, truncations, infos = venv.step(np.arange(4))  # next-step autoreset
    assert list(obs) == [0, 0, 0, 0] and rewards.tolist() == [0.0] * 4 and not truncations.any()
    assert infos["reward_valid"].all()  # the mask is there, and an autoreset is no failure
    venv.close()


def test_max_episode_steps_truncates(server) -> None:  # type: ignore[no-untyped-def]
    env = tangram_env.make("test-echo", address=server.address, max_episode_steps=2)
    env.reset()
    assert env.step(0)[3] is False
    assert env.step(0)[3] is True
    env.close()


def test_a_step_after_the_episode_ended_is_refused_until_reset(server) -> None:  # type: ignore[no-untyped-def]
    # A step past the end would be run and rewarded again: a policy could try answers until one paid.
    env = tangram_env.make("test-echo", address=server.address, max_episode_steps=2)
    env.reset()
    env.step(0)
    assert env.step(0)[3] is True
    with pytest.raises(gymnasium.error.ResetNeeded, match="episode has ended"):
        env.step(0)
    env.reset()
    assert env.step(0)[3] is False
    env.close()


def test_embedded_orchestrator_starts_and_is_reaped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANGRAM_ADDRESS", raising=False)
    from tangram_env import embedded

    client = Client()  # no address anywhere: an embedded orchestrator starts for this process
    server = embedded._current
    assert server is not None and server.process.poll() is None
    # tests.plugins registered tools in this process; the embedded server imported that module too.
    assert client.call("test.touch", {"path": "/dev/null", "line": "x"}) == "x"
    client.close()
    assert server.process.wait(timeout=15) is not None  # the last client closing stops it
    assert embedded._current is None


def test_a_reset_or_step_cut_short_must_be_followed_by_a_reset(server) -> None:  # type: ignore[no-untyped-def]
    # Each used to leave the env steppable: on the previous episode after a cancelled reset (graded
    # and paid again), or a turn further on after a cancelled step.
    env = EchoEnv(tag="cut", sleep_s=0.5, address=server.address)

    async def main() -> None:
        await env.areset()
        await env.astep(1)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(env.areset(), 0.1)
        assert env.needs_reset
        with pytest.raises(gymnasium.error.ResetNeeded, match="last reset did not finish"):
            await env.astep(1)
        await env.areset()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(env.astep(1), 0.1)
        with pytest.raises(gymnasium.error.ResetNeeded, match="last step did not finish"):
            await env.astep(1)
        await env.areset()
        assert (await env.astep(1))[0] == 1  # its first step again

    try:
        asyncio.run(main())
    finally:
        env.close()


def test_closing_an_env_under_a_running_step_fails_the_step(server) -> None:  # type: ignore[no-untyped-def]
    with Client(server.address) as client:  # shared: closing the env ends its session, not the client
        env = EchoEnv(tag="closed", sleep_s=0.5, client=client)
        env.reset()
        env.step_async(1)
        env.close()  # its actions' results are no longer the task's: no reward from them
        with pytest.raises(ClosedEnvError, match="closed while this call ran"):
            env.step_wait(timeout=10)


def test_closing_an_env_from_another_thread_wakes_its_sync_step_at_once(server) -> None:  # type: ignore[no-untyped-def]
    # An astep woke at once; a sync step waited for its actions to end (3 s in an audit's run).
    with Client(server.address) as client:
        env = EchoEnv(tag="closed", client=client)
        env.reset()
        env.sleep_s, env.fork = 5.0, True  # its step now runs a 5 s sleep
        threading.Timer(0.3, env.close).start()
        t0 = time.monotonic()
        with pytest.raises(ClosedEnvError, match="closed while this call ran"):
            env.step(1)
        assert time.monotonic() - t0 < 3.0


def test_a_vector_env_resets_an_env_whose_step_was_cut_short(server) -> None:  # type: ignore[no-untyped-def]
    envs = tangram_env.make_vec("test-echo", 2, address=server.address)

    async def main() -> None:
        await envs.areset()
        envs.envs[1].sleep_s = 0.5
        envs.envs[1].fork = True
        async with contextlib.aclosing(envs.astep_as_completed([1, 1])) as steps:
            async for i, _ in steps:
                assert i == 0
                break  # env 1's step is cancelled
        assert envs.envs[1].needs_reset
        obs, rewards, terminated, truncated, _ = await envs.astep([2, 2])
        assert list(obs) == [2, 0]  # env 0 took its second step; env 1 was reset (obs 0, reward 0)
        assert list(rewards) == [1.0, 0.0]

    try:
        asyncio.run(main())
    finally:
        envs.close()


def test_a_vector_step_that_raised_needs_a_reset_before_the_next(server) -> None:  # type: ignore[no-untyped-def]
    # The envs the failed step left mid-episode used to be reset silently at the next step, with no
    # terminated or truncated flag: a trainer joined two episodes into one trajectory.
    envs = tangram_env.make_vec("test-echo", 2, address=server.address)
    try:
        envs.reset()
        working = envs.envs[1]._step

        def failing(action):  # type: ignore[no-untyped-def]
            yield from working(action)
            raise RuntimeError("env 1 failed after its action ran")

        envs.envs[1]._step = failing
        with pytest.raises(RuntimeError, match="env 1 failed"):
            envs.step([1, 1])
        envs.envs[1]._step = working
        with pytest.raises(gymnasium.error.ResetNeeded, match="env 1 failed"):
            envs.step([2, 2])
        with pytest.raises(gymnasium.error.ResetNeeded):  # still, whatever the actions
            asyncio.run(envs.astep([2, 2]))
        envs.reset()
        obs, rewards, *_ = envs.step([3, 3])
        assert list(obs) == [1, 1] and list(rewards) == [1.0, 1.0]  # first steps of new episodes
    finally:
        envs.close()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda envs: envs.step([1]), "expected 2 actions, got 1"),
        (lambda envs: asyncio.run(envs.astep([1, 1, 1])), "expected 2 actions, got 3"),
        (lambda envs: envs.reset(seed=[3]), "expected 2 seeds, got 1"),
        (lambda envs: asyncio.run(envs.areset(seed=[1, 2, 3])), "expected 2 seeds, got 3"),
    ],
    ids=["step", "astep", "reset", "areset"],
)
def test_a_bad_argument_to_a_vector_call_leaves_the_episodes_running(server, call, message) -> None:  # type: ignore[no-untyped-def]
    # A wrong number of actions or seeds raised inside the guard that marks the vector env failed:
    # the next, correct step raised ResetNeeded and every running episode was lost.
    envs = tangram_env.make_vec("test-echo", 2, address=server.address)
    try:
        envs.reset(seed=0)
        envs.step([1, 1])
        with pytest.raises(ValueError, match=message):
            call(envs)
        obs, rewards, *_ = envs.step([2, 2])
        assert list(obs) == [2, 2] and list(rewards) == [1.0, 1.0]  # the episodes' second steps
        assert [env.elapsed_steps for env in envs.envs] == [2, 2]
    finally:
        envs.close()


def test_same_step_autoreset_matches_gymnasiums_own_vector_env(server) -> None:  # type: ignore[no-untyped-def]
    # Trainers written for same-step autoreset (the final observation in info) were refused.
    from gymnasium.vector import AutoresetMode, SyncVectorEnv

    ours = tangram_env.make_vec(
        "test-echo", 2, address=server.address, autoreset_mode=AutoresetMode.SAME_STEP
    )
    theirs = SyncVectorEnv(
        [lambda: tangram_env.make("test-echo", address=server.address)] * 2,
        autoreset_mode=AutoresetMode.SAME_STEP,
    )
    try:
        assert ours.metadata["autoreset_mode"] is AutoresetMode.SAME_STEP
        ours.reset(seed=0)
        theirs.reset(seed=0)
        ended = 0
        for step in range(12):  # EchoEnv truncates at step 5: two episodes each, and part of a third
            actions = [step + 1, step + 2]
            mine, gyms = ours.step(actions), theirs.step(actions)
            for a, b in zip(mine[:4], gyms[:4], strict=True):
                assert a.tolist() == b.tolist(), (step, mine, gyms)
            # Ours keeps the steps' reward mask at the top level even where every env was reset.
            mask = {"reward_valid", "_reward_valid"}
            assert set(mine[4]) - mask == set(gyms[4]) - mask
            assert list(mine[4]["reward_valid"]) == [True, True]
            if "final_obs" in gyms[4]:
                ended += 1
                assert mine[4]["_final_obs"].tolist() == gyms[4]["_final_obs"].tolist()
                assert list(mine[4]["final_obs"]) == list(gyms[4]["final_obs"]) == [5, 5]  # its step count
                assert list(mine[0]) == [0, 0]  # the new episodes' first observations
        assert ended == 2
    finally:
        ours.close()
        theirs.close()


def test_a_vector_env_seeds_its_own_rng_and_refuses_disabled_autoreset(server) -> None:  # type: ignore[no-untyped-def]
    from gymnasium.vector import AutoresetMode

    with pytest.raises(ValueError, match="next-step or same-step mode, not disabled"):
        tangram_env.make_vec("test-echo", 2, address=server.address, autoreset_mode=AutoresetMode.DISABLED)
    envs = tangram_env.make_vec("test-echo", 2, address=server.address)
    try:
        envs.reset(seed=7)
        assert envs.np_random_seed == 7  # as gymnasium's VectorEnv.reset seeds it
        assert envs.render() is None and envs.metadata["autoreset_mode"] is AutoresetMode.NEXT_STEP
    finally:
        envs.close()


def test_a_reset_supersedes_a_step_nobody_waited_for(server) -> None:  # type: ignore[no-untyped-def]
    env = EchoEnv(tag="superseded", sleep_s=0.2, address=server.address)
    try:
        env.reset()
        env.step_async(1)
        with pytest.raises(AlreadyPendingCallError):
            env.step(1)  # the pending step would interleave with this one
        env.reset()  # a new episode: the abandoned step is no longer waited for
        assert env.step(1)[0] == 1
        with pytest.raises(NoAsyncCallError):
            env.step_wait()
    finally:
        env.close()


def test_a_lockstep_batch_that_starves_itself_of_sandbox_memory_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Room for two live sandboxes and a command (512 MiB idle, 1 GiB to run bash), three envs stepped
    # together: two run and sit idle holding theirs until the batch is done, the third waits for their
    # memory. It hung with no word to the trainer (the server's log said it, every 30 s).
    from tests.conftest import ServerProcess

    tangram_env.register("test-session-judged", "tests.plugins:SessionJudgedEnv", override=True)
    monkeypatch.setattr(tangram_env.vector, "STALL_CHECK_S", 0.5)
    srv = ServerProcess("--sandbox", "none", "--mem-mb", "2300", "--sandbox-spec", "reserve_mb=512")
    try:
        vec = tangram_env.make_vec("test-session-judged", 3, address=srv.address)

        def step() -> None:
            with contextlib.suppress(ClosedEnvError):  # closed below, under the step that cannot finish
                vec.step(["a"] * 3)

        stepping = threading.Thread(target=step)
        try:
            vec.reset(seed=0)
            with caplog.at_level("WARNING", logger="tangram_env.vector"):
                stepping.start()
                wait_for(lambda: any("waits on 1 envs" in r.getMessage() for r in caplog.records), 30, "it")
            said = next(r.getMessage() for r in caplog.records if "waits on 1 envs" in r.getMessage())
            assert "the orchestrator runs nothing: 1 new sandbox sessions wait for cores or memory" in said
            assert "fewer envs per vector env" in said
        finally:
            vec.close()
            if stepping.ident is not None:  # started
                stepping.join(30)
    finally:
        srv.stop()  # whatever failed above: no orchestrator outlives the test
