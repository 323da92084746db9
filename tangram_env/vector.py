"""``TangramVectorEnv``: many TangramEnvs stepped together through one client.

A step submits every env's actions at once and advances each env as soon as its own results are in
(an env whose step needs several rounds of actions does not wait for the others' rounds). Autoreset
follows gymnasium's next-step mode by default (the step after an episode ends resets that env), or its
same-step mode (the step that ends an episode also resets the env, and returns the reset's observation
with the last one in ``info["final_obs"]`` and the step's info in ``info["final_info"]``; the step's
``reward_valid``, and ``reward_error`` where it was flagged, stay at the top level too, so that
``infos["reward_valid"]`` is a mask over the batch in either mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import numpy as np
from gymnasium.error import ResetNeeded
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array

from tangram_env.env import Driver, TangramEnv
from tangram_env.errors import ClosedEnvError
from tangram_env.protocol import Result
from tangram_env.rewards import REWARD_INFO_KEYS

log = logging.getLogger(__name__)


#: A lockstep batch with no action done for this long asks the orchestrator whether new sessions wait
#: for memory that nothing is running to free, and says so in the trainer's log.
STALL_CHECK_S = 30.0


def drive_all(client: Any, drivers: Sequence[Driver[Any]]) -> None:
    """Run every driver to completion, submitting all outstanding actions together."""
    owner: dict[Future[Result], tuple[int, int]] = {}
    slots: list[list[Result | None]] = [[] for _ in drivers]

    def submit(indices: Sequence[int]) -> None:
        batch = [(i, j, a) for i in indices for j, a in enumerate(drivers[i].actions)]
        for i in indices:
            slots[i] = [None] * len(drivers[i].actions)
        for (i, j, _), fut in zip(batch, client.submit([a for _, _, a in batch]), strict=True):
            owner[fut] = (i, j)

    submit([i for i, d in enumerate(drivers) if not d.done])
    while owner:
        done, _ = wait(list(owner), timeout=STALL_CHECK_S, return_when=FIRST_COMPLETED)
        if not done:
            _warn_if_starved(client, len({i for i, _ in owner.values()}))
            continue
        advanced = []
        for fut in done:
            i, j = owner.pop(fut)
            slots[i][j] = fut.result()
            if all(r is not None for r in slots[i]):
                drivers[i].feed([r for r in slots[i] if r is not None])
                if not drivers[i].done:
                    advanced.append(i)
        if advanced:
            submit(advanced)


def _warn_if_starved(client: Any, waiting: int) -> None:
    """The batch waits on ``waiting`` envs and nothing finished for a while: if the orchestrator runs
    nothing while new sessions wait, the batch's own idle sandboxes may be what holds their memory,
    and it closes none until the batch is done (a lockstep deadlock): say so where the trainer looks.
    """
    try:
        figures = client.stats(timeout_s=5.0)
    except Exception:  # the orchestrator's silence is the client's to report, and it does
        return
    memory = figures.get("sandbox_memory", {})
    if figures.get("running") == 0 and memory.get("new_sessions_waiting"):
        log.warning(
            "this vector env waits on %d envs, and the orchestrator runs nothing: %s. If the batch's "
            "other envs hold those sandboxes (they close none until the batch is done), it never "
            "finishes: use fewer envs per vector env, lower the image's reserve_mb, or give the "
            "orchestrator more memory",
            waiting,
            memory.get("why", "new sandbox sessions wait for memory"),
        )


class TangramVectorEnv(VectorEnv):
    """A vector of TangramEnvs sharing one client; see :func:`tangram_env.make_vec`."""

    metadata: dict[str, Any] = {"autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(
        self,
        envs: Sequence[TangramEnv[Any, Any]],
        *,
        client: Any,
        owns_client: bool = False,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
    ) -> None:
        if not envs:
            raise ValueError("a vector env needs at least one env")
        self.autoreset_mode = self.check_autoreset_mode(autoreset_mode)
        self.envs = list(envs)
        self.client = client
        self._owns_client = owns_client
        self.num_envs = len(self.envs)
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.spec = self.envs[0].spec
        self.render_mode = self.envs[0].render_mode
        self.metadata = {
            **self.metadata,
            "autoreset_mode": self.autoreset_mode,
            "render_modes": self.envs[0].metadata.get("render_modes", []),
        }
        self._closed = False
        # Why the last reset or step raised, until a reset succeeds: the envs it left mid-episode
        # cannot go on (their transitions never reached the trainer), nor be reset silently.
        self._failed: str | None = None

    @staticmethod
    def check_autoreset_mode(mode: AutoresetMode | str) -> AutoresetMode:
        """``mode`` if this vector env offers it (next-step or same-step), else ValueError saying why."""
        mode = AutoresetMode(mode)
        if mode is AutoresetMode.DISABLED:
            raise ValueError(
                "Tangram's vector env autoresets in gymnasium's next-step or same-step mode, not disabled: "
                "it takes no reset(options={'reset_mask': ...}) to reset ended envs by hand"
            )
        return mode

    def _batch_obs(self, obs: list[Any]) -> Any:
        out: Any = create_empty_array(self.single_observation_space, self.num_envs)
        return concatenate(self.single_observation_space, obs, out)

    def reset(
        self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset every env (``seed`` an int gives env ``i`` the seed ``seed + i``)."""
        seeds = self._check_seeds(seed)  # a bad call raises before any env is touched
        with self._failing():
            drivers = self._begin_resets(seed, seeds, options)
            drive_all(self.client, drivers)
        self._failed = None
        return self._batch_resets([d.value for d in drivers])

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every env; an env whose episode ended last step is reset instead (reward 0), or, in
        same-step mode, one whose episode ends now is reset after its step.
        """
        actions = self._check_actions(actions)  # a bad call raises before any env is touched
        with self._failing():
            drivers, resetting = self._begin_steps(actions)
            drive_all(self.client, drivers)
        return self._batch_steps([_as_step(d.value, r) for d, r in zip(drivers, resetting, strict=True)])

    # --- asyncio API -------------------------------------------------------------------------------
    async def areset(
        self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """:meth:`reset` for asyncio code (every env's reset runs concurrently on the event loop)."""
        seeds = self._check_seeds(seed)
        with self._failing():
            drivers = self._begin_resets(seed, seeds, options)
            aclient = self._aclient()
            values = await asyncio.gather(*(d.arun(aclient) for d in drivers))
        self._failed = None
        return self._batch_resets(values)

    async def astep_as_completed(
        self, actions: Any
    ) -> AsyncIterator[tuple[int, tuple[Any, float, bool, bool, dict[str, Any]]]]:
        """Step every env and yield ``(i, (obs, reward, terminated, truncated, info))`` per env as each
        finishes, fastest first. An env whose episode ended on its last step is reset instead (reward
        0, the reset's observation and info), as in :meth:`step`. Leaving the loop early cancels the
        steps still running (once the generator is closed: ``contextlib.aclosing``); the next step
        resets those envs instead.
        """
        actions = self._check_actions(actions)
        with self._failing():
            drivers, resetting = self._begin_steps(actions)
        aclient = self._aclient()

        async def one(i: int) -> tuple[int, Any]:
            return i, await drivers[i].arun(aclient)

        tasks = [asyncio.ensure_future(one(i)) for i in range(self.num_envs)]
        try:
            for next_done in asyncio.as_completed(tasks):
                with self._failing():
                    i, value = await next_done
                yield i, _as_step(value, resetting[i])
        finally:
            for task in tasks:
                task.cancel()

    async def astep(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """:meth:`step` for asyncio code: the envs' steps run concurrently on the event loop."""
        outs: list[Any] = [None] * self.num_envs
        async for i, out in self.astep_as_completed(actions):
            outs[i] = out
        return self._batch_steps(outs)

    # --- shared by the sync and asyncio API ---------------------------------------------------------
    # The checks of a call's arguments run outside ``_failing``: a caller's mistake raises and leaves
    # every running episode as it was (only a reset or step that touched the envs can strand them).
    def _check_seeds(self, seed: int | list[int | None] | None) -> list[int | None]:
        self._check_open()
        if isinstance(seed, int):
            return [seed + i for i in range(self.num_envs)]
        seeds: list[int | None] = list(seed) if seed else [None] * self.num_envs
        if len(seeds) != self.num_envs:
            raise ValueError(f"expected {self.num_envs} seeds, got {len(seeds)}")
        return seeds

    def _check_actions(self, actions: Any) -> list[Any]:
        self._check_open()
        if self._failed is not None:
            raise ResetNeeded(
                f"the last reset or step of this vector env raised ({self._failed}); the episodes it "
                "left unfinished cannot go on: call reset()"
            )
        actions = list(actions)
        if len(actions) != self.num_envs:
            raise ValueError(f"expected {self.num_envs} actions, got {len(actions)}")
        return actions

    def _begin_resets(
        self, seed: int | list[int | None] | None, seeds: list[int | None], options: dict[str, Any] | None
    ) -> list[Any]:
        super().reset(seed=seed if isinstance(seed, int) else None)  # the vector env's own np_random
        return [env.begin_reset(seed=s, options=options) for env, s in zip(self.envs, seeds, strict=True)]

    def _batch_resets(self, values: Sequence[Any]) -> tuple[Any, dict[str, Any]]:
        infos: dict[str, Any] = {}
        for i, (_, info) in enumerate(values):
            infos = self._add_info(infos, info, i)
        return self._batch_obs([obs for obs, _ in values]), infos

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        """Remember that what runs inside raised (see ``_failed``)."""
        try:
            yield
        except ResetNeeded:
            raise  # the refusal to go on: the first failure stays the reason
        except BaseException as exc:
            self._failed = f"{type(exc).__name__}: {exc}"
            raise

    def _begin_steps(self, actions: list[Any]) -> tuple[list[Any], np.ndarray]:
        """Each env's step, or its reset where its episode ended last step (next-step autoreset)."""
        # Its episode ended last step, or its last step never finished (a loop left early, a cancel).
        resetting = np.array([env.needs_reset for env in self.envs], dtype=np.bool_)
        same_step = self.autoreset_mode is AutoresetMode.SAME_STEP
        drivers = [
            env.begin_reset()
            if resetting[i]
            else (_StepThenReset(env, actions[i]) if same_step else env.begin_step(actions[i]))
            for i, env in enumerate(self.envs)
        ]
        return drivers, resetting

    def _batch_steps(
        self, outs: Sequence[Any]
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        rewards = np.array([o[1] for o in outs], dtype=np.float64)
        terminations = np.array([o[2] for o in outs], dtype=np.bool_)
        truncations = np.array([o[3] for o in outs], dtype=np.bool_)
        infos: dict[str, Any] = {}
        for i, out in enumerate(outs):
            infos = self._add_info(infos, out[4], i)
        return self._batch_obs([o[0] for o in outs]), rewards, terminations, truncations, infos

    def _aclient(self) -> Any:
        return self.envs[0].aclient  # the envs share one connection, so one asyncio client too

    def render(self) -> tuple[Any, ...] | None:
        """Every env's rendering (``render_mode`` set), as ``SyncVectorEnv`` gives it."""
        return None if self.render_mode is None else self.call("render")

    # --- gymnasium's attribute access (as SyncVectorEnv has it) ------------------------------------
    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call method ``name`` of every env (or read the attribute, if it is not callable)."""
        out = []
        for env in self.envs:
            attr = env.get_wrapper_attr(name)
            out.append(attr(*args, **kwargs) if callable(attr) else attr)
        return tuple(out)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Attribute ``name`` of every env."""
        return tuple(env.get_wrapper_attr(name) for env in self.envs)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """Set attribute ``name`` of every env: one value each (list or tuple), or one value for all."""
        if not isinstance(values, (list, tuple)):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(f"expected {self.num_envs} values for {name!r}, got {len(values)}")
        for env, value in zip(self.envs, values, strict=True):
            env.set_wrapper_attr(name, value)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedEnvError("this vector env is closed")

    def close_extras(self, **kwargs: Any) -> None:
        """Close every env, then the shared client if this vector env made it."""
        if self._closed:
            return
        self._closed = True
        for env in self.envs:
            env.close()
        if self._owns_client:
            self.client.close()


class _StepThenReset:
    """An env's step and, if it ends the episode, the env's reset: one driver, as drivers go (gymnasium's
    same-step autoreset). Its value is the step's, with the reset's observation in place of the last
    one, which goes to ``info["final_obs"]``, and the reset's info beside the step's ``final_info``.
    The step's reward entries (``reward_valid``, ...) stay beside them: the reward is the step's.
    """

    def __init__(self, env: TangramEnv[Any, Any], action: Any) -> None:
        self.env = env
        self._step: Driver[Any] = env.begin_step(action)
        self._reset: Driver[Any] | None = None
        self._reset_if_ended()

    def _reset_if_ended(self) -> None:
        step = self._step.value
        if self._reset is None and step is not None and (step[2] or step[3]):
            self._reset = self.env.begin_reset()

    @property
    def _now(self) -> Driver[Any]:
        return self._reset if self._reset is not None else self._step

    @property
    def actions(self) -> list[Any]:
        return self._now.actions

    @property
    def done(self) -> bool:
        return self._now.done

    def feed(self, results: list[Result]) -> None:
        self._now.feed(results)
        self._reset_if_ended()

    @property
    def value(self) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        assert self._step.value is not None, "read once done"
        obs, reward, terminated, truncated, info = self._step.value
        if self._reset is None:
            return obs, reward, terminated, truncated, info
        assert self._reset.value is not None, "read once done"
        new_obs, new_info = self._reset.value
        # The reward is this step's, so its validity is too: without it the batch's reward_valid mask
        # would drop every reward of a step that ended its episode.
        rewarded = {key: info[key] for key in REWARD_INFO_KEYS if key in info}
        new_info = {**new_info, **rewarded, "final_obs": obs, "final_info": info}
        return new_obs, reward, terminated, truncated, new_info

    async def arun(self, client: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        await self._step.arun(client)
        self._reset_if_ended()
        if self._reset is not None:
            await self._reset.arun(client)
        return self.value


def _as_step(value: Any, was_reset: bool) -> tuple[Any, float, bool, bool, dict[str, Any]]:
    """A step's outcome; an autoreset's ``(obs, info)`` as a step of reward 0 that goes on. Its 0 is no
    missing reward: ``reward_valid`` is True, so the batch's mask is always there and never mistakes an
    autoreset for an infrastructure failure.
    """
    if was_reset:
        obs, info = value
        return obs, 0.0, False, False, {**info, "reward_valid": True}
    return value
