"""SkyRL-gym on Tangram: a ``BaseTextEnv`` over any Tangram env.

    import skyrl_gym
    from tangram_env.adapters.skyrl import register

    register()                                           # skyrl_gym id "tangram"
    env = skyrl_gym.make("tangram", env_config={"env_id": "code"},
                         extras={"reset_options": {"task_id": "run-length-encode"}})
    prompt, info = env.init([])                          # the task, as chat messages
    out = env.step(llm_text)                             # observations, reward, done, metadata

``env_config`` (SkyRL's per-env-class configuration, a dict or an OmegaConf node): ``env_id`` (the
Tangram env), ``env_kwargs`` (passed to :func:`tangram_env.make`), ``address``, ``step_rewards``
(``"return"`` by default, or ``"gains"``; below). ``extras`` (per data row): ``reset_options`` and
``seed`` for the episode's reset, one of them required (below), and ``max_turns`` (SkyRL's generator
sets it), which the env's own ``max_turns`` follows. SkyRL's generator calls ``init`` and ``step`` from
its own threads; each step is one ``env.step`` of the Tangram env, whose actions the orchestrator
schedules (``astep``: the same for asyncio code).

Rewards: SkyRL's generator sums a trajectory's step rewards on its token-level path, but takes only
the last step's reward with ``custom_chat_template`` (retokenized chat). So by default
(``step_rewards="return"``) a step that does not end the episode pays 0.0 and the step that ends it
(terminated or truncated) pays the episode's whole return (the sum of the Tangram env's step
rewards): right under both rules. ``step_rewards="gains"`` passes each step's own reward through
(per-turn credit), which is right on the token-level path only. An infrastructure failure raises,
never a reward of 0 or NaN, and ends the episode's sandbox session; SkyRL's generator does not catch
it, so it fails the whole ``generate`` call (the batch).

The task: SkyRL samples a row several times (a GRPO group) and compares their rewards, so every
trajectory of a row must get the same task. A row whose ``extras`` give neither ``seed`` nor
``reset_options`` is refused with a ``ValueError``: the env would draw a task at random per trajectory.

Install with ``pip install "tangram-env[skyrl]"``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType

import tangram_env

#: The id under which :func:`register` makes the adapter known to ``skyrl_gym.make``.
SKYRL_ID = "tangram"
#: What a step pays SkyRL (``env_config["step_rewards"]``); see the module docstring.
STEP_REWARDS = ("return", "gains")


def as_messages(obs: Any) -> list[dict[str, Any]]:
    """A Tangram observation as chat messages (chat-mode envs already give them)."""
    if isinstance(obs, list) and all(isinstance(m, dict) and "role" in m for m in obs):
        return list(obs)
    return [{"role": "user", "content": obs if isinstance(obs, str) else str(obs)}]


class TangramTextEnv(BaseTextEnv):
    """A SkyRL-gym text env whose episode is an episode of a Tangram env; see the module docstring."""

    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        config = dict(env_config or {})
        if "env_id" not in config:
            raise ValueError('env_config needs "env_id": the Tangram env to run (for example "code")')
        extras = dict(extras or {})
        self.step_rewards = str(config.get("step_rewards", "return"))
        if self.step_rewards not in STEP_REWARDS:
            raise ValueError(
                f"env_config step_rewards={self.step_rewards!r}: use 'return' (the episode's return on the "
                "step that ends it, 0.0 before: right whether SkyRL sums step rewards or takes the last) or "
                "'gains' (each step's own reward: only for SkyRL's token-level path, which sums them)"
            )
        kwargs = dict(config.get("env_kwargs") or {})
        if kwargs.get("invalid_reward", "raise") != "raise":
            raise ValueError(
                f"env_kwargs invalid_reward={kwargs['invalid_reward']!r}: SkyRL sums a trajectory's "
                "rewards and a NaN makes its whole group's advantages NaN, so the adapter only raises "
                "(RewardUnavailable) when a step's reward cannot be determined; leave invalid_reward out"
            )
        turns = extras.get("max_turns")  # SkyRL's generator.max_turns: it stops the trajectory there
        if turns is not None and "max_turns" in kwargs and int(kwargs["max_turns"]) != int(turns):
            raise ValueError(
                f"SkyRL's max_turns ({turns}) and env_kwargs max_turns ({kwargs['max_turns']}) disagree: "
                "SkyRL would stop the trajectory before the env's episode ends and pays its reward; set one "
                "of them"
            )
        if extras.get("seed") is None and not extras.get("reset_options"):
            # Without either the env draws a task per trajectory: a GRPO group's samples would get
            # different tasks, each graded against the others as if they shared one.
            raise ValueError(
                f"the data row's extras give neither 'seed' nor 'reset_options', so env "
                f"{config['env_id']!r} would draw a random task for each trajectory and the samples "
                "of one row (a GRPO group) would get different tasks: give every row its task in "
                "'reset_options' (for example {'task_id': ...} for code, {'instance_id': ...} for "
                "swe-bench) or a 'seed' (the same for all of the row's samples)"
            )
        self.env = tangram_env.make(
            str(config["env_id"]), client=shared_client(config.get("address")), **kwargs
        )
        if turns is not None and hasattr(self.env.unwrapped, "max_turns"):
            self.env.unwrapped.max_turns = int(turns)
        self.reset_options = dict(extras.get("reset_options") or {}) or None
        self.seed = extras.get("seed")
        self.max_turns = int(getattr(self.env.unwrapped, "max_turns", 0) or config.get("max_turns", 1))
        self.last_info: dict[str, Any] = {}
        self.episode_return = 0.0

    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        """Reset the Tangram env; the data set's prompt (a system message, say) then the task."""
        obs, info = self.env.reset(seed=self.seed, options=self.reset_options)
        self.turns = 0
        self.episode_return = 0.0
        self.last_info = info
        return [*prompt, *as_messages(obs)], {k: v for k, v in info.items() if k != "actions"}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """One step of the Tangram env with the LLM's text; no observation once the episode is done.

        A step that raises ends the episode's session first: SkyRL's agent loop does not close the env
        of a step that raised (the error fails its whole ``generate`` call), and the sandbox would
        otherwise live until the server's ``session_idle_s``.
        """
        try:
            step = self.env.step(action)
        except BaseException:
            self.env.close()
            raise
        return self._output(step)

    async def astep(self, action: str) -> BaseTextEnvStepOutput:
        """:meth:`step` for asyncio code: the Tangram env's actions run without blocking the loop."""
        try:
            step = await self.env.astep(action)
        except BaseException:  # a failure, or a cancelled trajectory
            self.env.close()
            raise
        return self._output(step)

    def _output(self, step: Any) -> BaseTextEnvStepOutput:
        obs, reward, terminated, truncated, info = step
        self.turns += 1  # only a step that ran counts
        self.last_info = info
        done = bool(terminated or truncated)
        self.episode_return += float(reward)
        # SkyRL's retokenizing path reads only the last step's reward: by default that is the whole return.
        paid = self.episode_return if done else 0.0
        if self.step_rewards == "gains":
            paid = float(reward)
        return BaseTextEnvStepOutput(
            observations=[] if done else as_messages(obs),
            reward=paid,
            done=done,
            metadata={k: v for k, v in info.items() if k != "actions"},
            postprocessed_action=None,
        )

    def get_metrics(self) -> dict[str, Any]:
        """Numbers SkyRL averages over episodes: turns, and the env's own numeric info."""
        numeric = {
            k: v for k, v in self.last_info.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        return {"turns": self.turns, **numeric}

    def close(self) -> None:
        """Close the Tangram env (its sandbox session goes back to the pool)."""
        self.env.close()


_clients: dict[str | None, tangram_env.Client] = {}
_clients_lock = threading.Lock()


def shared_client(address: str | None) -> tangram_env.Client:
    """One connection per orchestrator for every env of this process (SkyRL makes an env per trajectory)."""
    with _clients_lock:
        client = _clients.get(address)
        if client is None or client._closed:
            client = _clients[address] = tangram_env.Client(address)
        return client


def register(id: str = SKYRL_ID) -> None:
    """Make :class:`TangramTextEnv` known to ``skyrl_gym.make`` as ``id`` (idempotent)."""
    from skyrl_gym.envs.registration import register as skyrl_register
    from skyrl_gym.envs.registration import registry

    if id not in registry:
        skyrl_register(id=id, entry_point=f"{__name__}:TangramTextEnv")
