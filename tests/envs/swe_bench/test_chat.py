"""Chat-native swe-bench: messages out, OpenAI tool calls in, the asyncio API, through a real orchestrator."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tangram_env.chat import ChatMessages
from tangram_env.envs.swe_bench import SweBenchEnv, SweBenchInstance


def tool_call(call_id: str, name: str, **arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def test_a_chat_episode_with_openai_tool_calls_solves_an_instance(
    offline_subset: list[SweBenchInstance], swe_server: Any
) -> None:
    inst = offline_subset[0]
    env = SweBenchEnv(instances=offline_subset, address=swe_server.address, max_turns=5, chat=True)

    async def episode() -> None:
        obs, info = await env.areset(options={"instance_id": inst.instance_id})
        assert ChatMessages().contains(obs) and obs[0]["role"] == "user"
        assert inst.problem_statement.strip() in obs[0]["content"] and "JSON call" not in obs[0]["content"]
        fix = f"git apply <<'TANGRAM_PATCH_END'\n{inst.patch}TANGRAM_PATCH_END\n"
        message = {
            "role": "assistant",
            "content": "Applying.",
            "tool_calls": [tool_call("c1", "bash", command=fix)],
        }
        obs, reward, terminated, _, _ = await env.astep(message)
        assert obs == [{"role": "tool", "tool_call_id": "c1", "content": obs[0]["content"]}]
        assert "exit code: 0" in obs[0]["content"] and (reward, terminated) == (0.0, False)
        # Two calls in one turn: each id gets an answer, and the answer says one call per turn.
        obs, *_ = await env.astep([tool_call("c2", "view", path="."), tool_call("c3", "bash", command="ls")])
        assert [m["tool_call_id"] for m in obs] == ["c2", "c3"] and "exactly one tool call" in obs[0][
            "content"
        ]
        # Plain text with no call: a user message saying what was wrong.
        obs, *_ = await env.astep({"role": "assistant", "content": "I think I am done"})
        assert obs[0]["role"] == "user" and "no tool call found" in obs[0]["content"]
        obs, reward, terminated, truncated, info = await env.astep([tool_call("c4", "submit")])
        assert (reward, terminated, truncated) == (1.0, True, False), obs
        assert obs[0]["tool_call_id"] == "c4" and "Resolved: yes" in obs[0]["content"]

    try:
        asyncio.run(episode())
    finally:
        env.close()


@pytest.mark.parametrize("chat", [False, True])
def test_env_tools_are_a_valid_openai_tools_list(offline_subset: list[SweBenchInstance], chat: bool) -> None:
    types = pytest.importorskip(
        "openai.types.chat", reason="the openai package comes with the adapters' extras"
    )
    from pydantic import TypeAdapter

    env = SweBenchEnv(instances=offline_subset, chat=chat)
    adapter = TypeAdapter(list[types.ChatCompletionToolParam])
    assert adapter.validate_python(env.tools) == env.tools
    assert [t["function"]["name"] for t in env.tools] == ["bash", "view", "str_replace", "create", "submit"]
    env.close()
