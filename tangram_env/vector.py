"""``TangramVectorEnv``: many TangramEnvs stepped together through one client.

A step submits every env's actions at once and advances each env as soon as its own results are in
(an env whose step needs several rounds of actions does not wait for the others' rounds). Autoreset
follows gymnasium's default next-step mode: the step after an episode ends resets that env.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import numpy as np
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
        self._autoreset = np.zeros(self.num_envs, dtype=np.bool_)
        self._closed = False

    def _batch_obs(self, obs: list[Any]) -> Any:
        out: Any = create_empty_array(self.single_observation_space, self.num_envs)
        return concatenate(self.single_observation_space, obs, out)

    def reset(
        self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset every env (``seed`` an int gives env ``i`` the seed ``seed + i``)."""
        self._check_open()
        seeds = (
            [seed + i for i in range(self.num_envs)]
            if isinstance(seed, int)
            else (seed or [None] * self.num_envs)
        )
        if len(seeds) != self.num_envs:
            raise ValueError(f"expected {self.num_envs} seeds, got {len(seeds)}")
        drivers = [env.begin_reset(seed=s, options=options) for env, s in zip(self.envs, seeds, strict=True)]
        drive_all(self.client, drivers)
        infos: dict[str, Any] = {}
        obs = []
        for i, d in enumerate(drivers):
            o, info = d.value  # type: ignore[misc]
            obs.append(o)
            infos = self._add_info(infos, info, i)
        self._autoreset[:] = False
        return self._batch_obs(obs), infos

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every env; an env whose episode ended last step is reset instead (reward 0)."""
        self._check_open()
        actions = list(actions)
        if len(actions) != self.num_envs:
            raise ValueError(f"expected {self.num_envs} actions, got {len(actions)}")
        drivers = [
            env.begin_reset() if self._autoreset[i] else env.begin_step(actions[i])
            for i, env in enumerate(self.envs)
        ]
        drive_all(self.client, drivers)
        obs = []
        rewards = np.zeros(self.num_envs, dtype=np.float64)
        terminations = np.zeros(self.num_envs, dtype=np.bool_)
        truncations = np.zeros(self.num_envs, dtype=np.bool_)
        infos: dict[str, Any] = {}
        for i, d in enumerate(drivers):
            if self._autoreset[i]:
                o, info = d.value  # type: ignore[misc]
            else:
                o, rewards[i], terminations[i], truncations[i], info = d.value  # type: ignore[misc]
            obs.append(o)
            infos = self._add_info(infos, info, i)
        self._autoreset = np.logical_or(terminations, truncations)
        return self._batch_obs(obs), rewards, terminations, truncations, infos

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
