"""The ``code`` env in chat mode: a submission as an OpenAI tool call or as the assistant's text."""

from __future__ import annotations

import json

import pytest

import tangram_env
from tangram_env.chat import ChatAction, ChatMessages, check_tools, read_action
from tests.envs.test_code_env import RIGHT


def test_chat_mode_answers_tool_calls_with_tool_messages(server) -> None:  # type: ignore[no-untyped-def]
    env = tangram_env.make("code", address=server.address, max_turns=3, chat=True)
    try:
        assert env.observation_space == ChatMessages() and env.action_space == ChatAction()
        obs, _ = env.reset(options={"task_id": "run-length-encode"})
        assert env.observation_space.contains(obs) and "run_length_encode" in obs[0]["content"]
        wrong = {"role": "assistant", "content": "def run_length_encode(text):\n    return text\n"}
        obs, reward, terminated, _, _ = env.step(wrong)  # text: the source itself
        assert obs[0]["role"] == "user" and reward < 1.0 and not terminated
        # Only what is new: the task stated again in every turn filled the context window.
        assert (
            obs[0]["content"].startswith("# Feedback on submission 1") and "# Task:" not in obs[0]["content"]
        )
        first = reward
        call = {
            "id": "call_9",
            "type": "function",
            "function": {"name": "submit_solution", "arguments": json.dumps({"source": RIGHT})},
        }
        obs, reward, terminated, _, info = env.step(
            {"role": "assistant", "content": None, "tool_calls": [call]}
        )
        assert obs == [{"role": "tool", "tool_call_id": "call_9", "content": obs[0]["content"]}]
        assert first + reward == pytest.approx(1.0) and terminated and info["passed"] == info["total"]
    finally:
        env.close()


def test_tool_lists_are_checked() -> None:
    good = {"type": "function", "function": {"name": "run-tests_2", "parameters": {"type": "object"}}}
    assert check_tools([good]) == [good]
    for bad, why in [
        ({"type": "function", "function": {"name": "code.run_tests"}}, "must match"),
        ({"type": "function", "function": {"name": "x" * 65}}, "must match"),
        ({"function": {"name": "f"}}, "type"),
        ({"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}, "type object"),
    ]:
        with pytest.raises(ValueError, match=why):
            check_tools([bad])
    with pytest.raises(ValueError, match="used twice"):
        check_tools([good, good])
    with pytest.raises(TypeError, match="chat action"):
        read_action(3)


def test_a_chat_vector_env_batches_message_lists(server) -> None:  # type: ignore[no-untyped-def]
    vec = tangram_env.make_vec("code", num_envs=2, address=server.address, max_turns=1, chat=True)
    try:
        obs, _ = vec.reset(seed=0, options={"task_id": "run-length-encode"})
        assert len(obs) == 2 and all(ChatMessages().contains(o) for o in obs)
        call = {
            "id": "c",
            "type": "function",
            "function": {"name": "submit_solution", "arguments": json.dumps({"source": RIGHT})},
        }
        obs, rewards, terminations, _, _ = vec.step(
            [{"role": "assistant", "tool_calls": [call]}, "def nope(): pass"]
        )
        assert rewards[0] == 1.0 and rewards[1] == 0.0 and terminations[0]
        assert obs[0][0]["role"] == "tool" and obs[1][0]["role"] == "user"
    finally:
        vec.close()
