"""A reward model that fails is never a reward: custom envs get that from ``tangram_env.graded``."""

from __future__ import annotations

import math
import pickle

import pytest
from gymnasium.vector import AutoresetMode

import tangram_env
from tangram_env import ActionRejected, RewardUnavailable
from tangram_env.chat import ChatTextEnv, call_arguments
from tangram_env.vector import TangramVectorEnv
from tests.conftest import ServerProcess
from tests.plugins import JudgedEnv


def test_a_failing_reward_model_raises_in_a_single_env(server: ServerProcess) -> None:
    env = JudgedEnv(address=server.address)
    try:
        env.reset()
        assert env.step("good")[1:3] == (1.0, True)
        env.reset()
        assert env.step("bad")[1] == 0.0  # a judgement
        env.reset()
        with pytest.raises(RewardUnavailable, match="the reward model failed") as caught:
            env.step("crash")
        assert caught.value.cause == "model_error" and caught.value.action_id
        again = pickle.loads(pickle.dumps(caught.value))
        assert str(again) == str(caught.value) and again.cause == "model_error"
    finally:
        env.close()


def test_a_vector_env_masks_the_env_whose_reward_model_failed(server: ServerProcess) -> None:
    client = tangram_env.Client(server.address)
    envs = [JudgedEnv(client=client, invalid_reward="flag") for _ in range(3)]
    vec = TangramVectorEnv(envs, client=client, owns_client=True)
    try:
        vec.reset(seed=0)
        _, rewards, terminated, truncated, infos = vec.step(["good", "crash", "bad"])
        assert rewards[0] == 1.0 and math.isnan(rewards[1]) and rewards[2] == 0.0
        assert list(infos["reward_valid"]) == [True, False, True]
        assert "the reward model failed" in infos["reward_error"][1]
        assert list(terminated) == [True, False, True] and list(truncated) == [False, True, False]
    finally:
        vec.close()


class ChatJudgedEnv(ChatTextEnv, JudgedEnv):
    """:class:`JudgedEnv` in chat mode: the ``say`` tool's ``text`` is the judged action."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self._use_chat(True)

    def _chat_text(self, turn):  # type: ignore[no-untyped-def]
        return str(call_arguments(turn.tool_calls[0]).get("text", "")) if turn.tool_calls else turn.text


def test_a_flagged_step_of_a_chat_env_gives_chat_messages(server: ServerProcess) -> None:
    # It used to give the last observation as raw text, outside the env's observation space.
    client = tangram_env.Client(server.address)
    envs = [ChatJudgedEnv(client=client, invalid_reward="flag") for _ in range(2)]
    vec = TangramVectorEnv(envs, client=client, owns_client=True)
    call = {"id": "c1", "type": "function", "function": {"name": "say", "arguments": '{"text": "crash"}'}}
    say = {"role": "assistant", "content": "", "tool_calls": [call]}
    try:
        vec.reset(seed=0)
        obs, rewards, _, truncated, infos = vec.step([say, "good"])
        assert math.isnan(rewards[0]) and truncated[0] and rewards[1] == 1.0
        assert list(infos["reward_valid"]) == [False, True]
        assert all(env.observation_space.contains(o) for env, o in zip(envs, obs, strict=True))
        (answer,) = obs[0]  # the call still gets its answer, as a chat trainer's conversation needs
        assert answer["role"] == "tool" and answer["tool_call_id"] == "c1"
        assert "the reward model failed" in answer["content"]
        assert obs[1] == [{"role": "user", "content": "done"}]
    finally:
        vec.close()


class PatientJudgedEnv(JudgedEnv):
    """:class:`JudgedEnv` whose action "wait" ends no episode (and asks no judge)."""

    def _step(self, action):  # type: ignore[no-untyped-def]
        if action == "wait":
            return "waiting", 0.25, False, False, {}
        return (yield from super()._step(action))


def test_same_step_autoreset_keeps_the_mask_of_the_steps_that_ended(server: ServerProcess) -> None:
    # The env that ended got the reset's info at the top level, with no reward_valid: the mask dropped
    # every reward of a step that ended its episode (and vanished when every env ended).
    client = tangram_env.Client(server.address)
    envs = [PatientJudgedEnv(client=client, invalid_reward="flag") for _ in range(3)]
    vec = TangramVectorEnv(envs, client=client, owns_client=True, autoreset_mode=AutoresetMode.SAME_STEP)
    try:
        vec.reset(seed=0)
        obs, rewards, terminated, truncated, infos = vec.step(["good", "crash", "wait"])
        assert list(obs) == ["say it", "say it", "waiting"]  # the ended envs were reset in the same step
        assert rewards[0] == 1.0 and math.isnan(rewards[1]) and rewards[2] == 0.25
        assert list(infos["reward_valid"]) == [True, False, True]
        assert list(rewards[infos["reward_valid"]]) == [1.0, 0.25]
        assert list(infos["_reward_error"]) == [False, True, False]
        assert "the reward model failed" in infos["reward_error"][1]
        assert infos["reward_error_cause"][1] == "model_error"
        assert list(infos["final_info"]["reward_valid"]) == [True, False, False]  # still there too
        _, rewards, terminated, _, infos = vec.step(["good", "bad", "good"])  # every env ends
        assert list(terminated) == [True, True, True] and list(rewards) == [1.0, 0.0, 1.0]
        assert list(infos["reward_valid"]) == [True, True, True] and "reward_error" not in infos
    finally:
        vec.close()


class MisconfiguredJudgedEnv(JudgedEnv):
    """Asks the judge with a payload it refuses: every grading is rejected, whatever the answer."""

    def _step(self, action):  # type: ignore[no-untyped-def]
        (result,) = yield [tangram_env.Action(kind="test.judge", payload={"items": action})]
        (score,) = tangram_env.graded(result, "the reward model")
        return "done", score, True, False, {}


def test_a_rejected_grading_is_the_callers_error_not_a_missing_reward(server: ServerProcess) -> None:
    # A request the orchestrator refuses fails every step alike: it was RewardUnavailable (or, in a
    # vector env, a NaN sample masked out, step after step), so the mistake never surfaced.
    env = MisconfiguredJudgedEnv(address=server.address, invalid_reward="flag")
    try:
        env.reset()
        with pytest.raises(ActionRejected, match="the reward model was rejected: bad_payload") as caught:
            env.step("good")
        assert not isinstance(caught.value, RewardUnavailable) and caught.value.error_type == "rejected"
    finally:
        env.close()
    client = tangram_env.Client(server.address)
    envs = [MisconfiguredJudgedEnv(client=client, invalid_reward="flag") for _ in range(2)]
    vec = TangramVectorEnv(envs, client=client, owns_client=True)
    try:
        vec.reset(seed=0)
        with pytest.raises(ActionRejected, match="bad_payload"):
            vec.step(["good", "good"])
    finally:
        vec.close()
