"""verl BaseTools over Tangram envs, called the way verl's ToolAgentLoop calls them (create, execute with
the trajectory's AgentData, release), with verl's own classes."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from typing import Any

import pytest

pytest.importorskip("verl.tools.base_tool", reason="verl is not installed (pip install 'tangram-env[verl]')")

from verl.experimental.agent_loop.tool_agent_loop import AgentData
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema

import tangram_env
from tangram_env.adapters.verl import TangramEnvTool, close_episodes, env_tool_schema
from tangram_env.chat import ChatTextEnv, ChatTurn, call_arguments, call_name, check_tools
from tangram_env.env import AnyText
from tangram_env.envs.swe_bench import SweBenchInstance
from tests.conftest import wait_for
from tests.envs.test_code_env import RIGHT


def agent_data(request_id: str, tools_kwargs: dict[str, Any] | None = None) -> AgentData:
    return AgentData(
        messages=[], image_data=[], video_data=[], audio_data=None, mm_processor_kwargs=None,
        metrics={}, request_id=request_id, tools_kwargs=tools_kwargs or {},
    )  # fmt: skip


def _tool(name: str, **properties: Any) -> dict[str, Any]:
    params = {"type": "object", "properties": properties, "required": list(properties)}
    return {"type": "function", "function": {"name": name, "description": name, "parameters": params}}


class TwoToolEnv(ChatTextEnv, tangram_env.TangramEnv[str, str]):
    """A chat env with two tools: ``wait`` (a ``sleep`` action; a negative time fails the step, as an
    infrastructure failure) and ``answer`` (1.0 if it is the reset's ``target``; ends the episode).
    """

    made: list[TwoToolEnv] = []

    def __init__(self, *, chat: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.observation_space = AnyText(max_length=1000, min_length=0, charset="abc")
        self.action_space = AnyText(max_length=1000, min_length=0, charset="abc")
        self.tools = check_tools(
            [_tool("wait", seconds={"type": "number"}), _tool("answer", value={"type": "string"})]
        )
        self.target, self.closed = "", False
        self._use_chat(chat)
        TwoToolEnv.made.append(self)

    def _chat_text(self, turn: ChatTurn) -> str:
        (call,) = turn.tool_calls
        return f"{call_name(call)} {next(iter(call_arguments(call).values()))}"

    def _reset(self, *, seed, options):  # type: ignore[no-untyped-def]
        self.target = str((options or {}).get("target", ""))
        return f"answer {self.target or 'anything'}", {}
        yield []

    def _step(self, action):  # type: ignore[no-untyped-def]
        tool, arg = action.split(" ", 1)
        if tool == "answer":
            return "bye", float(arg == self.target), True, False, {"turn": 1}
        if float(arg) < 0:
            raise tangram_env.RewardUnavailable("the grader failed", cause="test")
        (result,) = yield [tangram_env.Action(kind="sleep", payload={"seconds": float(arg)})]
        tangram_env.graded(result, "the wait")
        return "waited", 0.0, False, False, {"turn": 1}

    def _close(self) -> None:
        self.closed = True


tangram_env.register("test-two-tools", TwoToolEnv, override=True)


def two_tools(server: Any, **env_kwargs: Any) -> dict[str, TangramEnvTool]:
    config = {
        "type": "native",
        "env_id": "test-two-tools",
        "address": server.address,
        "env_kwargs": env_kwargs,
    }
    return {name: TangramEnvTool({**config, "tool_name": name}, None) for name in ("wait", "answer")}


async def call_as_verl(
    tools: dict[str, TangramEnvTool], data: AgentData, name: str, args: dict[str, Any]
) -> Any:
    """A call as ToolAgentLoop._call_tool makes it: its create_kwargs from the row's tools_kwargs."""
    return await call(tools[name], data, args, data.tools_kwargs.get(name, {}).get("create_kwargs", {}))


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


def test_a_trajectory_never_goes_on_with_an_earlier_trajectorys_episode(server: Any) -> None:
    # With verl's full_determinism every batch names its trajectories det-0, det-1, ...: the second
    # batch's det-0 used to step the first one's open episode, graded on the first one's task.
    tools = two_tools(server)

    async def first_batch() -> AgentData:  # stops at verl's turn limit, its episode still open
        data = agent_data("det-0", {"answer": {"create_kwargs": {"options": {"target": "a"}}}})
        assert (await call_as_verl(tools, data, "wait", {"seconds": 0}))[1] == 0.0
        return data

    async def second_batch() -> AgentData:
        data = agent_data("det-0", {"answer": {"create_kwargs": {"options": {"target": "b"}}}})
        _, reward, metrics = await call_as_verl(tools, data, "answer", {"value": "b"})
        assert reward == 1.0 and metrics == {"turn": 1, "done": True}
        return data

    first = asyncio.run(first_batch())  # held: its episode stays open while the second batch runs
    assert asyncio.run(second_batch()).extra_fields["tangram_reward"] == 1.0
    assert close_episodes() == 1 and first.extra_fields["reward_valid"]  # the first batch's


def test_the_task_comes_from_whichever_tool_of_the_env_the_row_gives_it_to(server: Any) -> None:
    # The episode used to be reset with the create_kwargs of the tool the model happened to call first.
    tools = two_tools(server)

    async def main() -> None:
        data = agent_data("t", {"answer": {"create_kwargs": {"options": {"target": "7"}}}})
        await call_as_verl(tools, data, "wait", {"seconds": 0})  # first, with no create_kwargs of its own
        _, reward, _ = await call_as_verl(tools, data, "answer", {"value": "7"})
        assert reward == 1.0 and data.extra_fields["reward_valid"] is True
        both = {name: {"create_kwargs": {"options": {"target": name}}} for name in tools}
        data = agent_data("two tasks", both)
        with pytest.raises(ValueError, match="different create_kwargs"):
            await call_as_verl(tools, data, "wait", {"seconds": 0})
        assert data.extra_fields["reward_valid"] is False

    asyncio.run(main())
    assert close_episodes() == 0


def test_a_call_that_fails_or_is_cut_short_closes_its_episode_at_once(server: Any) -> None:
    # Such an episode used to stay open, holding its sandbox until close_episodes() or the server's
    # idle expiry, and a cut-short call left the sample's reward_valid True.
    tools = two_tools(server)
    TwoToolEnv.made.clear()

    async def main() -> None:
        failed = agent_data("fails", {"answer": {"create_kwargs": {"seed": 0}}})
        await call_as_verl(tools, failed, "wait", {"seconds": 0})
        with pytest.raises(tangram_env.RewardUnavailable, match="the grader failed"):
            await call_as_verl(tools, failed, "wait", {"seconds": -1})
        assert failed.extra_fields["reward_valid"] is False and TwoToolEnv.made[-1].closed
        cut = agent_data("cut short", {"answer": {"create_kwargs": {"seed": 0}}})
        await call_as_verl(tools, cut, "wait", {"seconds": 0})
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(call_as_verl(tools, cut, "wait", {"seconds": 30}), 0.5)
        assert cut.extra_fields["reward_valid"] is False and "cancelled" in cut.extra_fields["tangram_error"]
        assert TwoToolEnv.made[-1].closed
        # Later calls run nothing: a new episode of the same task would let answers be tried again.
        response, reward, _ = await call_as_verl(tools, cut, "answer", {"value": ""})
        assert reward == 0.0 and "not run" in (response.text or "") and len(TwoToolEnv.made) == 2

    asyncio.run(main())
    assert close_episodes() == 0


def test_the_flag_policy_is_refused(server: Any) -> None:
    # Accepted before, a flagged step reached verl as a NaN tool reward with reward_valid True.
    with pytest.raises(ValueError, match="invalid_reward='flag'"):
        two_tools(server, invalid_reward="flag")


class ShellEnv(ChatTextEnv, tangram_env.TangramEnv[str, str]):
    """A chat env with one tool, ``sh``, run in the episode's sandbox session (as swe-bench's ``bash``
    is): an open episode holds a sandbox. It never says done.
    """

    def __init__(self, *, chat: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.observation_space = AnyText(max_length=10_000, min_length=0, charset="abc")
        self.action_space = AnyText(max_length=10_000, min_length=0, charset="abc")
        self.tools = check_tools([_tool("sh", cmd={"type": "string"})])
        self._use_chat(chat)

    def _chat_text(self, turn: ChatTurn) -> str:
        return str(call_arguments(turn.tool_calls[0])["cmd"])

    def _reset(self, *, seed, options):  # type: ignore[no-untyped-def]
        return "go", {}
        yield []

    def _step(self, action):  # type: ignore[no-untyped-def]
        (ran,) = yield [
            tangram_env.Action(kind="bash", payload={"command": action}, affinity=self.session_id)
        ]
        tangram_env.graded(ran, "the sandbox")
        return str(ran.value.get("stdout", "")), 0.0, False, False, {"turn": 1}


tangram_env.register("test-shell", ShellEnv, override=True)


def _live_sessions(server: Any) -> int:
    with tangram_env.Client(server.address) as client:
        return int(client.stats()["sandbox_memory"]["live_sessions"])


def _settled_sessions(server: Any) -> int:
    """The server's live sessions once earlier tests' closing has reached it (the server is shared)."""
    seen: list[int] = []

    def steady() -> bool:
        seen.append(_live_sessions(server))
        return len(seen) >= 3 and len(set(seen[-3:])) == 1

    wait_for(steady, 15, "the server's live sandbox sessions to settle")
    return seen[-1]


def _sessions_back_to(server: Any, before: int) -> None:
    wait_for(
        lambda: _live_sessions(server) <= before, 15, "the ended trajectories' sandbox sessions to close"
    )


def shell_tool(server: Any) -> TangramEnvTool:
    return TangramEnvTool({"type": "native", "env_id": "test-shell", "address": server.address}, None)


async def one_call_then_text(tool: TangramEnvTool, n: int) -> AgentData:
    """A trajectory as ToolAgentLoop.run makes it: one tool call, then the model answers in text."""
    data = agent_data(f"req-{n}")
    response, reward, metrics = await call(tool, data, {"cmd": "echo hi > f; cat f"}, {"seed": n})
    assert response.text.strip() == "hi" and reward == 0.0 and not metrics["done"]
    return data


def test_an_episode_closes_when_verl_drops_the_trajectorys_agent_data(server: Any) -> None:
    # An episode the env never said done for (the common case: the model answers in text) stayed open,
    # its sandbox session heartbeated, until close_episodes(), which nothing in verl calls.
    tool = shell_tool(server)
    before = _settled_sessions(server)
    dropped: list[weakref.ref[AgentData]] = []

    async def main() -> None:
        running = [await one_call_then_text(tool, n) for n in range(5)]
        dropped.extend(weakref.ref(data) for data in running)
        assert _live_sessions(server) == before + 5  # open while their AgentData live
        running.clear()  # ToolAgentLoop.run returned: nothing refers to the trajectories' AgentData

    asyncio.run(main())
    gc.collect()
    assert all(ref() is None for ref in dropped), "the adapter keeps a trajectory's AgentData alive"
    _sessions_back_to(server, before)
    assert close_episodes() == 0


def test_a_trajectory_dropped_on_any_thread_closes_its_episode_off_the_event_loop(server: Any) -> None:
    # verl's agent loop worker may run its event loop on a thread of its own, and a finalizer runs on
    # whichever thread drops the last reference: here the loop's thread, then the main thread.
    tool = shell_tool(server)
    before = _settled_sessions(server)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=60)

    async def dropped_on_the_loop() -> None:
        # Each AgentData dies on the loop's thread as its trajectory returns.
        await asyncio.gather(*(one_call_then_text(tool, n) for n in range(3)))

    try:
        on_loop(dropped_on_the_loop())
        _sessions_back_to(server, before)
        data = on_loop(one_call_then_text(tool, 9))  # dropped here, with the loop still running
        assert _live_sessions(server) == before + 1
        del data
        gc.collect()
        _sessions_back_to(server, before)
        assert on_loop(asyncio.sleep(0, result="ok")) == "ok"  # the loop was never blocked for good
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
    assert close_episodes() == 0


def test_an_episode_stepped_without_agent_data_ends_when_its_tool_instance_is_released(server: Any) -> None:
    # A caller that passes no AgentData (older verl rollouts: one create per trajectory, release at its
    # end) had its episode keyed by the instance, which release left open for good.
    tool = shell_tool(server)
    before = _settled_sessions(server)

    async def main() -> None:
        instance_id, _ = await tool.create("old-style", seed=0)  # their create_kwargs spread
        for _ in range(2):  # both calls are steps of one episode
            _, _, metrics = await tool.execute(instance_id, {"cmd": "echo x >> f; wc -l < f"})
        assert metrics["turn"] == 1 and _live_sessions(server) == before + 1
        await tool.release(instance_id)

    asyncio.run(main())
    _sessions_back_to(server, before)
    assert close_episodes() == 0


def test_a_row_with_no_task_is_refused_not_given_one_at_random(server: Any) -> None:
    # Reset with no seed or options, each sample of the row drew its own task (an audit's four samples
    # of one row got four), each compared with the others in its GRPO group as if they shared one.
    tools = two_tools(server)
    TwoToolEnv.made.clear()

    async def main() -> AgentData:
        data = agent_data("no task")
        with pytest.raises(ValueError, match="no tool of env 'test-two-tools' create_kwargs"):
            await call_as_verl(tools, data, "answer", {"value": ""})
        return data

    data = asyncio.run(main())
    assert data.extra_fields["reward_valid"] is False and TwoToolEnv.made == []  # no episode was begun
    assert close_episodes() == 0


def test_older_verl_rollouts_get_their_task_and_their_return(server: Any) -> None:
    # They call create(request_id, **create_kwargs), execute and calc_reward without an AgentData, and
    # take calc_reward as the tool reward. The task was dropped (an audit's correct fix was graded on
    # another instance), and calc_reward read 0.0 once the episode had ended.
    tools = two_tools(server)

    async def trajectory(request_id: str, value: str) -> float:
        answer = tools["answer"]
        instance_id, _ = await answer.create(request_id, options={"target": "7"})
        try:
            _, reward, metrics = await answer.execute(instance_id, {"value": value})
            assert metrics["done"] and reward == float(value == "7")
            again, reward, _ = await answer.execute(instance_id, {"value": "7"})  # ended: runs nothing
            assert reward == 0.0 and "not run" in (again.text or "")
            return await answer.calc_reward(instance_id)
        finally:
            await answer.release(instance_id)

    async def failing() -> None:
        wait = tools["wait"]
        instance_id, _ = await wait.create("fails", seed=0)
        with pytest.raises(tangram_env.RewardUnavailable, match="the grader failed"):
            await wait.execute(instance_id, {"seconds": -1})
        with pytest.raises(tangram_env.RewardUnavailable, match="a call of this trajectory failed"):
            await wait.calc_reward(instance_id)  # never a 0.0 for what Tangram could not grade
        await wait.release(instance_id)

    assert asyncio.run(trajectory("right", "7")) == 1.0
    assert asyncio.run(trajectory("wrong", "8")) == 0.0
    asyncio.run(failing())
    assert close_episodes() == 0
