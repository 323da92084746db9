"""A reward model that fails is never a reward: custom envs get that from ``tangram_env.graded``."""

from __future__ import annotations

import math
import pickle

import pytest

import tangram_env
from tangram_env import RewardUnavailable
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
