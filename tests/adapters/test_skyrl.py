"""SkyRL-gym's BaseTextEnv over Tangram envs, made through skyrl_gym.make as SkyRL's generator makes them."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("skyrl_gym", reason="skyrl-gym is not installed (pip install 'tangram-env[skyrl]')")

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv

from tangram_env.adapters.skyrl import TangramTextEnv, register
from tangram_env.envs.swe_bench import SweBenchInstance
from tests.envs.test_code_env import RIGHT


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
        # SkyRL sums a trajectory's step rewards: solving on the second turn is worth what solving at
        # once is, never more (each step used to pay its whole score).
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


def test_env_config_must_name_the_env() -> None:
    with pytest.raises(ValueError, match="env_id"):
        TangramTextEnv(env_config={}, extras={})
