"""SkyRL-gym's BaseTextEnv over Tangram envs, made through skyrl_gym.make as SkyRL's generator makes them."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from typing import Any

import pytest

pytest.importorskip("skyrl_gym", reason="skyrl-gym is not installed (pip install 'tangram-env[skyrl]')")

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv

import tangram_env
from tangram_env.adapters.skyrl import TangramTextEnv, register
from tangram_env.envs.swe_bench import SweBenchInstance
from tests.envs.test_code_env import RIGHT

tangram_env.register("test-session-judged", "tests.plugins:SessionJudgedEnv", override=True)


def test_code_env_through_skyrl_gym(server: Any) -> None:
    register()
    register()  # idempotent
    env = skyrl_gym.make(
        "tangram",
        env_config={"env_id": "code", "address": server.address, "env_kwargs": {"max_turns": 2}},
        extras={"reset_options": {"task_id": "run-length-encode"}},
    )
    try:
        assert isinstance(env, BaseTextEnv) and isinstance(env, TangramTextEnv) and env.max_turns == 2
        prompt, info = env.init([{"role": "system", "content": "Be brief."}])
        assert prompt[0]["role"] == "system" and "run_length_encode" in prompt[1]["content"]
        assert info["task_id"] == "run-length-encode"
        out = env.step("def run_length_encode(text):\n    return text\n")
        assert out["done"] is False and out["reward"] < 1.0 and out["observations"][0]["role"] == "user"
        near_miss = out["reward"]
        out = env.step(RIGHT)
        assert out["done"] is True and out["observations"] == []
        # Solving on the second turn is worth what solving at once is, never more (each step used to pay
        # its whole score), whether SkyRL sums the step rewards or takes the last.
        assert near_miss + out["reward"] == pytest.approx(1.0)
        assert out["metadata"]["passed"] == out["metadata"]["total"]
        assert env.get_metrics()["turns"] == 2
    finally:
        env.close()


def test_swe_bench_chat_env_through_skyrl(offline_subset: list[SweBenchInstance], swe_server: Any) -> None:
    inst = offline_subset[0]
    env = TangramTextEnv(
        env_config={"env_id": "swe-bench", "address": swe_server.address,
                    "env_kwargs": {"instances": offline_subset, "max_turns": 4}},
        extras={"reset_options": {"instance_id": inst.instance_id}},
    )  # fmt: skip
    try:
        prompt, _ = env.init([])
        assert inst.problem_statement.strip() in prompt[0]["content"]
        fix = f"git apply <<'TANGRAM_PATCH_END'\n{inst.patch}TANGRAM_PATCH_END\n"
        out = env.step(json.dumps({"name": "bash", "arguments": {"command": fix}}))
        assert not out["done"] and "exit code: 0" in out["observations"][0]["content"]
        out = env.step('<tool_call>{"name": "submit", "arguments": {}}</tool_call>')
        assert out["done"] and out["reward"] == 1.0 and out["metadata"]["resolved"] is True
    finally:
        env.close()


def _live_sessions(server: Any) -> int:
    with tangram_env.Client(server.address) as client:
        return int(client.stats()["sandbox_memory"]["live_sessions"])


def test_a_step_that_fails_ends_the_episodes_session(server: Any) -> None:
    # SkyRL's loop drops a trajectory whose step raised without closing its env: the sandbox session
    # stayed open (its client heartbeating it) until the server's session_idle_s, an hour.
    config = {"env_id": "test-session-judged", "address": server.address}
    before = _live_sessions(server)  # other tests' (the server is shared)
    env = TangramTextEnv(env_config=config, extras={"seed": 0})
    env.init([])
    with pytest.raises(tangram_env.RewardUnavailable):
        env.step("crash")  # the reward model fails: an infrastructure failure, never a reward
    assert _live_sessions(server) == before

    async def cancelled() -> None:
        other = TangramTextEnv(env_config=config, extras={"seed": 0})
        other.init([])
        assert (await other.astep("good"))["reward"] == 1.0
        other.init([])
        stepping = asyncio.ensure_future(other.astep("good"))
        await asyncio.sleep(0)
        stepping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stepping

    asyncio.run(cancelled())
    assert _live_sessions(server) == before


def test_a_dropped_env_ends_its_session(server: Any) -> None:
    env = TangramTextEnv(
        env_config={"env_id": "test-session-judged", "address": server.address}, extras={"seed": 0}
    )
    before = _live_sessions(server)  # other tests' (the server is shared)
    env.init([])
    assert env.step("good")["done"]  # its session open until the env is closed, and the env forgotten
    assert _live_sessions(server) == before + 1
    del env
    gc.collect()
    deadline = time.monotonic() + 10
    while _live_sessions(server) > before:
        assert time.monotonic() < deadline, "the dropped env's session is still open"
        time.sleep(0.2)


def test_skyrls_max_turns_is_the_episodes_and_flagged_rewards_are_refused(server: Any) -> None:
    config = {"env_id": "code", "address": server.address}
    env = TangramTextEnv(
        env_config=config, extras={"max_turns": 1, "reset_options": {"task_id": "run-length-encode"}}
    )
    try:
        assert env.max_turns == env.env.unwrapped.max_turns == 1  # the code env's own default is 3
        env.init([])
        out = env.step("def run_length_encode(text):\n    return text\n")
        assert out["done"] is True  # graded within SkyRL's turns: its reward is not cut off
    finally:
        env.close()
    with pytest.raises(ValueError, match="disagree"):
        TangramTextEnv(env_config={**config, "env_kwargs": {"max_turns": 3}}, extras={"max_turns": 1})
    with pytest.raises(ValueError, match="NaN"):
        TangramTextEnv(env_config={**config, "env_kwargs": {"invalid_reward": "flag"}}, extras={})


def test_env_config_must_name_the_env() -> None:
    with pytest.raises(ValueError, match="env_id"):
        TangramTextEnv(env_config={}, extras={})


NEAR_MISS = "def run_length_encode(text):\n    return text\n"


def _episode(server: Any, answers: list[str], **config: Any) -> list[float]:
    env = TangramTextEnv(
        env_config={"env_id": "code", "address": server.address, **config},
        extras={"reset_options": {"task_id": "run-length-encode"}, "max_turns": 2},
    )
    try:
        env.init([])
        return [env.step(answer)["reward"] for answer in answers]
    finally:
        env.close()


def test_the_step_that_ends_the_episode_pays_its_whole_return(server: Any) -> None:
    # SkyRL's generator sums step rewards on its token-level path but takes only the last step's with
    # custom_chat_template: paying each step what the score gained made an episode solved on its
    # second turn worth its second step's gain there, not 1.0.
    solved = _episode(server, [NEAR_MISS, RIGHT])
    assert solved == [0.0, 1.0] and sum(solved) == solved[-1] == 1.0  # both of SkyRL's rules agree
    cut = _episode(server, [NEAR_MISS, NEAR_MISS])  # truncated at max_turns: its return on that step
    assert cut[0] == 0.0 and 0.0 < cut[1] < 1.0
    gains = _episode(server, [NEAR_MISS, RIGHT], step_rewards="gains")  # the token-level path's option
    assert gains[0] == pytest.approx(cut[1]) and sum(gains) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="step_rewards"):
        TangramTextEnv(env_config={"env_id": "code", "step_rewards": "sum"}, extras={})


def test_a_row_must_give_its_task(server: Any) -> None:
    # A row with neither a seed nor reset_options got a random task per trajectory: the samples of one
    # row (a GRPO group, compared with each other) got different tasks.
    register()
    config = {"env_id": "code", "address": server.address}
    for extras in ({"max_turns": 1}, {"seed": None, "reset_options": {}, "max_turns": 1}):
        with pytest.raises(ValueError, match=r"neither 'seed' nor 'reset_options'.*GRPO group"):
            skyrl_gym.make("tangram", env_config=config, extras=extras)
    tasks = []
    for _ in range(3):  # a seed: every sample of the row gets the same task
        env = skyrl_gym.make("tangram", env_config=config, extras={"seed": 7, "max_turns": 1})
        try:
            tasks.append(env.init([])[1]["task_id"])
        finally:
            env.close()
    assert len(set(tasks)) == 1
