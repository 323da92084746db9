"""verl on Tangram: ``BaseTool`` classes whose calls are steps of a Tangram env, for verl's tool agent loop.

A verl tool config (``actor_rollout_ref.rollout.multi_turn.tool_config_path``) lists one tool per
function the model may call; for the ``swe-bench`` env that is one entry per tool of ``env.tools``::

    tools:
      - class_name: tangram_env.adapters.verl.TangramEnvTool
        config: {type: native, env_id: swe-bench, tool_name: bash, env_kwargs: {max_turns: 30}}
      - class_name: tangram_env.adapters.verl.TangramEnvTool
        config: {type: native, env_id: swe-bench, tool_name: submit}

Leave ``tool_schema`` out of the entries: each tool takes its schema from the env's OpenAI ``tools``.
Every tool call of one trajectory (verl's ``AgentData``: not its ``request_id`` alone, which repeats
from batch to batch under ``full_determinism``) is a step of that trajectory's episode, made in chat
mode (``chat=True``). The episode is reset on the trajectory's first call with the data row's
``tools_kwargs.<tool>.create_kwargs`` (``seed``, ``options``: the env's reset options, such as
``{"instance_id": ...}``) of any of the env's tools, whichever the model calls first; tools whose
``create_kwargs`` disagree are refused, and so is a row that gives none (the env would draw a task
per trajectory, and the samples of one row would get different tasks). The step's reward is the
tool reward; the episode closes when the env says it is done, and otherwise when verl drops the
trajectory's ``AgentData`` (its loop returned: the model answered in text, or hit verl's turn or
length limit); a thread of the adapter closes those, off the event loop. The steps run on the
event loop of verl's agent loop worker through Tangram's asyncio API: no thread per trajectory.

What the reward function reads: the trajectory's ``extra_fields`` (verl passes them on with the
sample) hold ``tangram_reward`` (the episode's return so far: the sum of its step rewards, which is
also the sum of verl's ``tool_rewards`` for it), ``reward_valid`` and, once the env said
done, ``tangram_done``: later calls of that trajectory run nothing and earn 0.0 (a new episode of the
same task would let a model try answers until one paid). verl's loop turns
any exception of a tool into text for the model, so a call that raises (an infrastructure failure of
Tangram, a typed :class:`~tangram_env.errors.TangramError`), is cancelled or times out closes the
episode and its sandbox at once, sets ``reward_valid`` to False and ``tangram_error`` to what
happened: mask those samples instead of training on a 0. The trajectory's later calls run nothing.
``invalid_reward="flag"`` is refused: that marking is the adapter's way of flagging.

Install with ``pip install "tangram-env[verl]"``; verl installs without a GPU, but its trainer needs one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

import tangram_env
from tangram_env.aio import AsyncClient

log = logging.getLogger(__name__)


@dataclass
class _Episode:
    env: Any
    task: dict[str, Any]  # the create_kwargs it was reset with
    reward: float = 0.0  # its return so far: an env may pay a step what it gained (the code env does)
    done: bool = False


#: Open episodes by (env id, trajectory key), shared by the tools of one env.
_episodes: dict[tuple[str, str], _Episode] = {}
#: A lock per open episode (on the event loop that made it: a trainer may run a loop per batch).
_turn_locks: dict[tuple[str, str], tuple[asyncio.AbstractEventLoop, asyncio.Lock]] = {}
#: The env id of every TangramEnvTool made in this process, by tool name: which of a data row's
#: ``tools_kwargs`` speak for an env's episode.
_tool_envs: dict[str, str] = {}


def _turn_lock(key: tuple[str, str]) -> asyncio.Lock:
    loop = asyncio.get_running_loop()
    held = _turn_locks.get(key)
    if held is None or held[0] is not loop:
        held = _turn_locks[key] = (loop, asyncio.Lock())
    return held[1]


def _trajectory(agent_data: Any, instance_id: str) -> str:
    """A key of the trajectory, unique in the process.

    Not verl's ``request_id`` alone: with ``rollout.full_determinism`` it is ``det-{priority}`` and
    repeats in every batch, so a new trajectory would go on with an old one's episode and task. verl
    makes one ``AgentData`` per trajectory and hands that same object to each of its tool calls; when
    verl drops it (the trajectory ended), the trajectory's open episodes close.
    """
    if agent_data is None:
        return instance_id  # no trajectory to share: an episode per tool instance, closed on release
    key = getattr(agent_data, "_tangram_trajectory", None)
    if key is None:
        key = f"{getattr(agent_data, 'request_id', '')}/{uuid.uuid4().hex}"
        agent_data._tangram_trajectory = key
        _start_reaper()  # here, not in the finalizer: that one may run inside gc, amid any lock
        try:
            # The callback holds the key only: a reference to agent_data would keep it alive forever.
            weakref.finalize(agent_data, _ended.put, key).atexit = False
        except TypeError:  # not weakly referable: close_episodes() is all that is left
            log.warning(
                "%s is not weakly referable, so its episodes outlive it: call close_episodes() after "
                "each batch",
                type(agent_data).__name__,
            )
    return str(key)


#: Trajectories whose AgentData verl dropped, for the reaper thread to close their episodes. A
#: finalizer runs on whatever thread dropped the last reference, maybe an event loop's, maybe inside
#: gc while that thread holds a lock that closing takes: it only queues the key (SimpleQueue.put is
#: reentrant), and the env closes on the reaper thread, never blocking a loop.
_ended: queue.SimpleQueue[str] = queue.SimpleQueue()
_reaper: threading.Thread | None = None
_reaper_lock = threading.Lock()


def _start_reaper() -> None:
    global _reaper
    with _reaper_lock:
        if _reaper is None or not _reaper.is_alive():  # not yet, or not in this forked child
            _reaper = threading.Thread(target=_reap, name="tangram-verl-reaper", daemon=True)
            _reaper.start()


def _reap() -> None:
    while True:
        trajectory = _ended.get()
        # Its turn locks too: a trajectory whose first call failed has a lock and no episode.
        for key in {k for k in [*_episodes, *_turn_locks] if k[1] == trajectory}:
            try:
                TangramEnvTool._forget(key)
            except Exception:  # the env's own close failed: the others, and later ones, still close
                log.exception("could not close the episode of ended trajectory %s", trajectory)


_clients: dict[str | None, AsyncClient] = {}


def _client(address: str | None) -> AsyncClient:
    client = _clients.get(address)
    if client is None or client.sync._closed:
        client = _clients[address] = AsyncClient(address)
    return client


def env_tool_schema(env_id: str, tool_name: str | None = None, **env_kwargs: Any) -> OpenAIFunctionToolSchema:
    """The verl schema of one tool of env ``env_id`` (default: its first tool)."""
    env = tangram_env.make(env_id, chat=True, **env_kwargs)
    try:
        tools = env.unwrapped.tools
    finally:
        env.close()
    names = [t["function"]["name"] for t in tools]
    name = tool_name or names[0]
    if name not in names:
        raise ValueError(f"env {env_id!r} has no tool {name!r} (its tools: {', '.join(names)})")
    return OpenAIFunctionToolSchema.model_validate(tools[names.index(name)])


class TangramEnvTool(BaseTool):
    """A verl tool whose calls are steps of a Tangram env; see the module docstring.

    ``config``: ``env_id`` (required), ``tool_name`` (default: the env's first tool), ``env_kwargs``
    (passed to :func:`tangram_env.make`), ``address`` (default: ``TANGRAM_ADDRESS``, else embedded).
    """

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None = None) -> None:
        if "env_id" not in config:
            raise ValueError("TangramEnvTool needs config['env_id'], the Tangram env whose tool it is")
        self.env_id = str(config["env_id"])
        self.env_kwargs = dict(config.get("env_kwargs") or {})
        if self.env_kwargs.get("invalid_reward", "raise") != "raise":
            raise ValueError(
                f"env_kwargs invalid_reward={self.env_kwargs['invalid_reward']!r}: a flagged step's NaN "
                "would reach verl as a tool reward, and the adapter already marks a sample whose reward "
                'could not be determined (extra_fields["reward_valid"] = False); leave invalid_reward out'
            )
        self.address = config.get("address")
        schema = tool_schema or env_tool_schema(self.env_id, config.get("tool_name"), **self.env_kwargs)
        super().__init__(config, schema)
        _tool_envs[self.name] = self.env_id
        self._create_kwargs: dict[str, dict[str, Any]] = {}
        # Instances stepped without an AgentData (older verl rollouts): what an AgentData's extra_fields
        # would hold for them, read by calc_reward; release ends their episodes and forgets them.
        self._unbound: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """Note the data row's ``create_kwargs`` for the call that follows: ``create(create_kwargs=...)``
        as verl's ToolAgentLoop calls it, or ``create(request_id, **create_kwargs)`` as older rollouts do.
        """
        instance_id = instance_id or uuid.uuid4().hex
        task = kwargs.get("create_kwargs", kwargs)
        self._create_kwargs[instance_id] = dict(task or {})
        return instance_id, ToolResponse()

    def _task(self, instance_id: str, agent_data: Any) -> dict[str, Any]:
        """The episode's create_kwargs: those the data row gives any tool of this env, whichever the model
        calls first (a row may carry the task under one tool only); a ValueError if they disagree.
        """
        given: dict[str, dict[str, Any]] = {}
        for name, kwargs in (getattr(agent_data, "tools_kwargs", None) or {}).items():
            task = kwargs.get("create_kwargs") if isinstance(kwargs, dict) else None
            if task and _tool_envs.get(name) == self.env_id:  # another env's tool has its own task
                given[name] = dict(task)
        if self._create_kwargs.get(instance_id):
            given.setdefault(self.name, self._create_kwargs[instance_id])
        tasks: list[dict[str, Any]] = []
        for task in given.values():
            if task not in tasks:
                tasks.append(task)
        if len(tasks) > 1:
            raise ValueError(
                f"the data row's tools_kwargs give the tools of env {self.env_id!r} different create_kwargs "
                f"({given}), but a trajectory has one episode: give them all the same create_kwargs, or "
                "give them to one tool only"
            )
        if not tasks:
            # Reset with neither, the env draws a task per trajectory: the samples of one row (a GRPO
            # group) would get different tasks, each compared with the others as if they shared one.
            raise ValueError(
                f"the data row gives no tool of env {self.env_id!r} create_kwargs, so each trajectory "
                "would get a task drawn at random: give the row's tools_kwargs.<tool>.create_kwargs its "
                "task in 'options' (for example {'task_id': ...} for code, {'instance_id': ...} for "
                "swe-bench) or a 'seed' (the same for all of the row's samples)"
            )
        return tasks[0]

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        """One step of the trajectory's episode with this tool call; the tool's answer and the step reward.

        A call that fails, is cancelled or times out closes the episode at once (its sandbox too) and
        marks the sample invalid: the episode cannot go on, and verl keeps no handle to close it later.
        """
        agent_data = kwargs.get("agent_data")
        fields = self._fields(instance_id, agent_data, bind=True)
        key = (self.env_id, _trajectory(agent_data, instance_id))
        async with _turn_lock(key):  # verl may run a turn's calls at once: one episode takes them in turn
            if fields.get("tangram_done"):
                # Not a new episode of the same task: answers would be tried until one paid.
                text = "The episode has ended; this call was not run."
                return ToolResponse(text=text), 0.0, {"turn": None, "done": True}
            if fields.get("reward_valid") is False:
                text = "An earlier call failed, so the episode cannot go on; this call was not run."
                return ToolResponse(text=text), 0.0, {"turn": None, "done": True}
            episode = _episodes.get(key)
            try:
                task = self._task(instance_id, agent_data)
                if episode is not None and episode.task != task:  # not this trajectory's task: start afresh
                    self._forget(key)
                    episode = None
                if episode is None:
                    episode = _episodes[key] = await self._start(task)
                call = {
                    "id": f"call_{instance_id}",
                    "type": "function",
                    "function": {"name": self.name, "arguments": json.dumps(parameters)},
                }
                obs, reward, terminated, truncated, info = await episode.env.astep(
                    {"role": "assistant", "tool_calls": [call]}
                )
            except BaseException as exc:  # failed, cancelled or timed out: no reward to trust
                if episode is not None:
                    self._forget(key)
                if isinstance(exc, asyncio.CancelledError):
                    why = "CancelledError: the call was cancelled (or timed out) before its step finished"
                else:
                    why = f"{type(exc).__name__}: {exc}"
                    log.exception("Tangram could not run %s for trajectory %s", self.name, key[1])
                fields.update(reward_valid=False, tangram_error=why)
                raise
            episode.reward += float(reward)
            episode.done = bool(terminated or truncated)
            fields.setdefault("reward_valid", True)
            fields["tangram_reward"] = episode.reward
            if episode.done:
                fields["tangram_done"] = True
                self._forget(key)
        text = "\n".join(m["content"] for m in obs)
        metrics = {"turn": info.get("turn"), "done": episode.done}
        return ToolResponse(text=text), float(reward), metrics

    @staticmethod
    def _forget(key: tuple[str, str]) -> None:
        """Close the episode (its sandbox session ends) and forget it."""
        _turn_locks.pop(key, None)
        episode = _episodes.pop(key, None)
        if episode is not None:
            episode.env.close()

    async def _start(self, task: dict[str, Any]) -> _Episode:
        env = tangram_env.make(self.env_id, chat=True, client=_client(self.address), **self.env_kwargs)
        try:
            await env.areset(seed=task.get("seed"), options=task.get("options"))
        except BaseException:  # failed or cancelled: nobody else would close it, nor free its sandbox
            env.close()
            raise
        return _Episode(env, task)

    def _fields(self, instance_id: str, agent_data: Any, bind: bool = False) -> dict[str, Any]:
        """The trajectory's ``extra_fields``; without an AgentData, the tool instance's own (``bind``:
        made if need be).
        """
        if agent_data is not None:
            fields: dict[str, Any] = agent_data.extra_fields
            return fields
        if bind:
            return self._unbound.setdefault(instance_id, {})
        return self._unbound.get(instance_id, {})

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The return so far of the trajectory's episode, ended or not (0.0 if it has not stepped).

        Raises :class:`~tangram_env.errors.RewardUnavailable` if a call of it failed: older verl
        rollouts take this as the sample's tool reward, and an infrastructure failure is no reward.
        """
        agent_data = kwargs.get("agent_data")
        fields = self._fields(instance_id, agent_data)
        if fields.get("reward_valid") is False:
            raise tangram_env.RewardUnavailable(
                f"a call of this trajectory failed: {fields.get('tangram_error')}", cause="tangram"
            )
        episode = _episodes.get((self.env_id, _trajectory(agent_data, instance_id)))
        if episode is not None:
            return episode.reward
        return float(fields.get("tangram_reward", 0.0))  # ended, or never stepped

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Forget the call's ``create_kwargs``; an episode stepped without an ``AgentData`` ends here.

        A trajectory's episode (calls with ``agent_data``) lives on until the env says done or verl
        drops the ``AgentData``. Without one, the episode is this tool instance's: a caller that makes
        one per trajectory (older verl rollouts) releases it when the trajectory ends, and nothing
        could step it again.
        """
        self._create_kwargs.pop(instance_id, None)
        if self._unbound.pop(instance_id, None) is not None:
            self._forget((self.env_id, instance_id))


def close_episodes() -> int:
    """Close every episode still open now; how many. Not needed with verl's ToolAgentLoop, whose ended
    trajectories close theirs when their ``AgentData`` is dropped; for callers that keep it alive.
    """
    closed = 0
    for key in list(_episodes):
        _turn_locks.pop(key, None)
        episode = _episodes.pop(key, None)  # one at a time: an episode opened meanwhile is not lost
        if episode is not None:
            episode.env.close()
            closed += 1
    return closed
