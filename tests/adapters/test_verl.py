"""verl BaseTools over Tangram envs, called the way verl's ToolAgentLoop calls them (create, execute with
the trajectory's AgentData, release), with verl's own classes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("verl.tools.base_tool", reason="verl is not installed (pip install 'tangram-env[verl]')")

from verl.experimental.agent_loop.tool_agent_loop import AgentData
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema

from tangram_env.adapters.verl import TangramEnvTool, close_episodes, env_tool_schema
from tangram_env.envs.swe_bench import SweBenchInstance
from tests.envs.test_code_env import RIGHT


def agent_data(request_id: str) -> AgentData:
    return AgentData(
        messages=[], image_data=[], video_data=[], audio_data=None, mm_processor_kwargs=None,
        metrics={}, request_id=request_id, tools_kwargs={},
    )  # fmt: skip


async def call(tool: BaseTool, data: AgentData, args: dict[str, Any], create_kwargs: dict[str, Any]) -> Any:
    """One tool call as verl 0.9's ToolAgentLoop makes it."""
    instance_id, _ = await tool.create(create_kwargs=create_kwargs)
    try:
        return await tool.execute(instance_id, args, agent_data=data)
    finally:
        await tool.release(instance_id)


def test_code_env_tool_grades_submissions_per_trajectory(server: Any) -> None:
    config = {"type": "native", "env_id": "code", "address": server.address, "env_kwargs": {"max_turns": 2}}
    tool = TangramEnvTool(config, None)
    assert isinstance(tool.tool_schema, OpenAIFunctionToolSchema) and tool.name == "submit_solution"
    create = {"options": {"task_id": "run-length-encode"}}

    async def main() -> None:
        a, b = agent_data("traj-a"), agent_data("traj-b")
        # Two trajectories at once on one event loop; each has its own episode.
        (ra, score_a, _), (rb, score_b, mb) = await asyncio.gather(
            call(tool, a, {"source": "def run_length_encode(text):\n    return text\n"}, create),
            call(tool, b, {"source": RIGHT}, create),
        )
        assert score_a < 1.0 and "tests passed" in ra.text
        assert (
            score_b == 1.0
            and mb["done"]
            and b.extra_fields == {"reward_valid": True, "tangram_reward": 1.0, "tangram_done": True}
        )
        # Trajectory a goes on in the same episode: its second turn pays what the score gained.
        _, score_a2, ma = await call(tool, a, {"source": RIGHT}, create)
        assert score_a2 == pytest.approx(1.0 - score_a) and ma == {"turn": 2, "done": True}
        assert a.extra_fields["tangram_reward"] == pytest.approx(1.0)  # the return: the last score

    asyncio.run(main())
    assert close_episodes() == 0  # both episodes ended and closed themselves


def test_calls_after_the_episode_ended_run_nothing_and_earn_nothing(server: Any) -> None:
    config = {"type": "native", "env_id": "code", "address": server.address, "env_kwargs": {"max_turns": 1}}
    tool = TangramEnvTool(config, None)
    create = {"options": {"task_id": "run-length-encode"}}

    async def main() -> None:
        data = agent_data("one-turn")
        _, wrong, first = await call(
            tool, data, {"source": "def run_length_encode(text):\n    return text\n"}, create
        )
        assert wrong < 1.0 and first["done"]
        # Before: a fresh episode of the same task graded the second answer, and the trajectory read 1.0.
        response, reward, metrics = await call(tool, data, {"source": RIGHT}, create)
        assert reward == 0.0 and metrics["done"] and "episode has ended" in (response.text or "")
        assert data.extra_fields["tangram_reward"] == wrong

    asyncio.run(main())
    assert close_episodes() == 0


def test_swe_bench_tools_share_the_trajectorys_episode(
    offline_subset: list[SweBenchInstance], swe_server: Any
) -> None:
    inst = offline_subset[0]
    base = {"type": "native", "env_id": "swe-bench", "address": swe_server.address,
            "env_kwargs": {"instances": offline_subset, "max_turns": 5}}  # fmt: skip
    bash = TangramEnvTool({**base, "tool_name": "bash"}, None)
    submit = TangramEnvTool({**base, "tool_name": "submit"}, None)
    create = {"options": {"instance_id": inst.instance_id}}

    async def main() -> None:
        data = agent_data("swe-1")
        fix = f"git apply <<'TANGRAM_PATCH_END'\n{inst.patch}TANGRAM_PATCH_END\n"
        response, reward, _ = await call(bash, data, {"command": fix}, create)
        assert "exit code: 0" in response.text and reward == 0.0
        response, reward, metrics = await call(submit, data, {}, create)
        assert "Resolved: yes" in response.text and reward == 1.0 and metrics["done"]

    asyncio.run(main())


def test_a_failure_of_tangram_marks_the_reward_invalid(server: Any) -> None:
    tool = TangramEnvTool({"env_id": "code", "address": server.address}, None)

    async def main() -> AgentData:
        data = agent_data("bad")
        with pytest.raises(KeyError, match="no-such-task"):
            await call(tool, data, {"source": RIGHT}, {"options": {"task_id": "no-such-task"}})
        return data

    data = asyncio.run(main())
    assert data.extra_fields["reward_valid"] is False and "no-such-task" in data.extra_fields["tangram_error"]


def test_schemas_come_from_the_env() -> None:
    with pytest.raises(ValueError, match="no tool 'bash'"):
        env_tool_schema("code", "bash")
    with pytest.raises(ValueError, match="env_id"):
        TangramEnvTool({}, None)


def test_a_turns_calls_made_at_once_take_their_turns_in_the_trajectorys_episode(server: Any) -> None:
    # verl's max_parallel_calls > 1 gathers a turn's calls: the second one used to fail with
    # AlreadyPendingCallError and mask the whole sample as a Tangram failure.
    config = {"type": "native", "env_id": "code", "address": server.address, "env_kwargs": {"max_turns": 3}}
    tool = TangramEnvTool(config, None)
    create = {"options": {"task_id": "run-length-encode"}}
    wrong = {"source": "def run_length_encode(text):\n    return text\n"}

    async def main() -> None:
        data = agent_data("parallel")
        first, second = await asyncio.gather(call(tool, data, wrong, create), call(tool, data, wrong, create))
        assert sorted([first[2]["turn"], second[2]["turn"]]) == [1, 2]
        assert data.extra_fields["reward_valid"] is True and "tangram_error" not in data.extra_fields
        _, reward, metrics = await call(tool, data, {"source": RIGHT}, create)
        assert reward == pytest.approx(1.0 - first[1]) and metrics == {"turn": 3, "done": True}
        instance_id, _ = await tool.create(create_kwargs=create)
        # The episode's return, read after it closed.
        assert await tool.calc_reward(instance_id, agent_data=data) == pytest.approx(1.0)

    asyncio.run(main())
    assert close_episodes() == 0
