"""``TangramVectorEnv``: many TangramEnvs stepped together through one client.

A step submits every env's actions at once and advances each env as soon as its own results are in
(an env whose step needs several rounds of actions does not wait for the others' rounds). Autoreset
follows gymnasium's default next-step mode: the step after an episode ends resets that env.
"""

from __future__ import annotations

import asyncio
import contextlib
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
        done, _ = wait(list(owner), return_when=FIRST_COMPLETED)
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


class TangramVectorEnv(VectorEnv):
    """A vector of TangramEnvs sharing one client; see :func:`tangram_env.make_vec`."""

    metadata: dict[str, Any] = {"autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(
        self, envs: Sequence[TangramEnv[Any, Any]], *, client: Any, owns_client: bool = False
    ) -> None:
        if not envs:
            raise ValueError("a vector env needs at least one env")
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
        self.metadata = {**self.metadata, "render_modes": self.envs[0].metadata.get("render_modes", [])}
        self._closed = False
        # Why the last reset or step raised, until a reset succeeds: the envs it left mid-episode
        # cannot go on (their transitions never reached the trainer), nor be reset silently.
        self._failed: str | None = None

    def _batch_obs(self, obs: list[Any]) -> Any:
        out: Any = create_empty_array(self.single_observation_space, self.num_envs)
        return concatenate(self.single_observation_space, obs, out)

    def reset(
        self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset every env (``seed`` an int gives env ``i`` the seed ``seed + i``)."""
        with self._failing():
            drivers = self._begin_resets(seed, options)
            drive_all(self.client, drivers)
        self._failed = None
        return self._batch_resets([d.value for d in drivers])

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every env; an env whose episode ended last step is reset instead (reward 0)."""
        with self._failing():
            drivers, resetting = self._begin_steps(actions)
            drive_all(self.client, drivers)
        return self._batch_steps([_as_step(d.value, r) for d, r in zip(drivers, resetting, strict=True)])

    # --- asyncio API -------------------------------------------------------------------------------
    async def areset(
        self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """:meth:`reset` for asyncio code (every env's reset runs concurrently on the event loop)."""
        with self._failing():
            drivers = self._begin_resets(seed, options)
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
    def _begin_resets(self, seed: int | list[int | None] | None, options: dict[str, Any] | None) -> list[Any]:
        self._check_open()
        super().reset(seed=seed if isinstance(seed, int) else None)  # the vector env's own np_random
        seeds = (
            [seed + i for i in range(self.num_envs)]
            if isinstance(seed, int)
            else (seed or [None] * self.num_envs)
        )
        if len(seeds) != self.num_envs:
            raise ValueError(f"expected {self.num_envs} seeds, got {len(seeds)}")
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

    def _begin_steps(self, actions: Any) -> tuple[list[Any], np.ndarray]:
        """Each env's step, or its reset where its episode ended last step (next-step autoreset)."""
        self._check_open()
        if self._failed is not None:
            raise ResetNeeded(
                f"the last reset or step of this vector env raised ({self._failed}); the episodes it "
                "left unfinished cannot go on: call reset()"
            )
        actions = list(actions)
        if len(actions) != self.num_envs:
            raise ValueError(f"expected {self.num_envs} actions, got {len(actions)}")
        # Its episode ended last step, or its last step never finished (a loop left early, a cancel).
        resetting = np.array([env.needs_reset for env in self.envs], dtype=np.bool_)
        drivers = [
            env.begin_reset() if resetting[i] else env.begin_step(actions[i])
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


def _as_step(value: Any, was_reset: bool) -> tuple[Any, float, bool, bool, dict[str, Any]]:
    """A step's outcome; an autoreset's ``(obs, info)`` as a step of reward 0 that goes on."""
    if was_reset:
        obs, info = value
        return obs, 0.0, False, False, info
    return value
