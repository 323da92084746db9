"""The environment registry: ``register``, ``spec``, ``make``, ``make_vec``, shaped like gymnasium's own.

Specs are gymnasium's :class:`~gymnasium.envs.registration.EnvSpec`; every env registered here is also
registered with gymnasium under the ``tangram/`` namespace, so ``gymnasium.make("tangram/code")`` works
once ``tangram_env`` is imported (or as ``gymnasium.make("tangram_env:tangram/code")``).
"""

from __future__ import annotations

import importlib
import operator
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

import gymnasium
from gymnasium.envs.registration import EnvSpec

from tangram_env.errors import AlreadyRegisteredError, UnknownNameError, did_you_mean

NAMESPACE = "tangram"

#: Env id -> spec, for every env registered with Tangram.
registry: dict[str, EnvSpec] = {}


def register(
    id: str,
    entry_point: str | Callable[..., gymnasium.Env[Any, Any]],
    *,
    max_episode_steps: int | None = None,
    override: bool = False,
    nondeterministic: bool = True,
    **defaults: Any,
) -> EnvSpec:
    """Register env ``id``: ``entry_point`` is ``"module:Class"`` or a callable; ``defaults`` are the
    keyword arguments ``make`` passes unless the caller overrides them.
    """
    if id.startswith(f"{NAMESPACE}/"):
        id = id[len(NAMESPACE) + 1 :]
    if not id or ":" in id or id.startswith("__"):  # it names an attribute of tangram_env.vector_entry
        raise ValueError(f"env id {id!r}: an id is not empty, has no ':' and does not start with '__'")
    if "/" in id:  # gymnasium's error named "tangram/" + id, an id nobody wrote
        raise ValueError(
            f"env id {id!r}: every Tangram env is registered in gymnasium's {NAMESPACE!r} namespace "
            f"(gymnasium.make('{NAMESPACE}/<id>')), and a gymnasium id has one namespace: give an id "
            f"without '/', such as {id.replace('/', '-')!r}"
        )
    old = registry.get(id)
    if old is not None and not override and old.entry_point != entry_point:
        raise AlreadyRegisteredError(f"env {id!r} is already registered with entry point {old.entry_point!r}")
    spec = EnvSpec(
        id=id,
        entry_point=entry_point,
        max_episode_steps=max_episode_steps,
        kwargs=dict(defaults),
        nondeterministic=nondeterministic,
        disable_env_checker=True,
    )
    registry[id] = spec
    full = f"{NAMESPACE}/{id}"
    if full in gymnasium.registry:
        del gymnasium.registry[full]
    gymnasium.register(
        full,
        entry_point=entry_point,
        max_episode_steps=max_episode_steps,
        kwargs=dict(defaults),
        nondeterministic=nondeterministic,
        # gymnasium.make_vec("tangram/<id>", n) builds Tangram's own vector env: one client, batched steps.
        vector_entry_point=f"tangram_env.vector_entry:{id}",
    )
    return spec


def spec(id: str) -> EnvSpec:
    """The spec of env ``id`` (with or without the ``tangram/`` prefix), with a hint if it is unknown."""
    key = id[len(NAMESPACE) + 1 :] if id.startswith(f"{NAMESPACE}/") else id
    try:
        return registry[key]
    except KeyError:
        extra = did_you_mean(key, registry)
        raise UnknownNameError(
            f"no env registered as {id!r}{extra} (registered: {', '.join(sorted(registry))})"
        ) from None


def _load(entry_point: Any) -> Callable[..., Any]:
    if callable(entry_point):
        return entry_point
    module, _, attr = entry_point.partition(":")
    return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return,unused-ignore]


def make(id: str, *, max_episode_steps: int | None = None, **kwargs: Any) -> Any:
    """A new env ``id``: the spec's defaults updated with ``kwargs``.

    ``max_episode_steps`` (here, or in the spec) truncates an episode after that many steps; the env's
    ``address``/``client`` keyword arguments pick the orchestrator (default: ``TANGRAM_ADDRESS``, else
    an embedded one).
    """
    env_spec = spec(id)
    limit = max_episode_steps if max_episode_steps is not None else env_spec.max_episode_steps
    params = {**env_spec.kwargs, **kwargs}
    if limit is not None:
        params["max_episode_steps"] = limit
    if env_spec.entry_point is None:
        raise UnknownNameError(f"env {id!r} has no entry point")
    env = _load(env_spec.entry_point)(**params)
    env.spec = EnvSpec(
        id=f"{NAMESPACE}/{env_spec.id}",
        entry_point=env_spec.entry_point,
        max_episode_steps=limit,
        kwargs={k: v for k, v in params.items() if k not in ("client", "max_episode_steps")},
        nondeterministic=env_spec.nondeterministic,
        disable_env_checker=True,
    )
    return env


def make_vec(id: str, num_envs: int = 1, **kwargs: Any) -> Any:
    """A :class:`~tangram_env.vector.TangramVectorEnv` of ``num_envs`` copies of env ``id`` whose
    steps submit every env's actions at once and gather results as they complete.

    ``invalid_reward`` defaults to ``"flag"`` here: a step whose reward could not be determined gives
    that env a NaN reward, ``info["reward_valid"][i] = False`` and ``info["reward_error"][i]``.
    """
    from gymnasium.vector import AutoresetMode

    from tangram_env.client import Client
    from tangram_env.vector import TangramVectorEnv

    # Checked before any env (or an embedded orchestrator for them) is made.
    try:
        count = operator.index(num_envs)  # an int, or numpy's
    except TypeError:
        count = 0
    if count < 1 or isinstance(num_envs, bool):
        raise ValueError(f"make_vec({id!r}, num_envs={num_envs!r}): num_envs must be a whole number >= 1")
    mode = TangramVectorEnv.check_autoreset_mode(kwargs.pop("autoreset_mode", AutoresetMode.NEXT_STEP))
    kwargs.setdefault("invalid_reward", "flag")  # one env's missing reward must not stop the batch
    client = kwargs.pop("client", None)
    owns_client = client is None
    if client is None:
        client = Client(kwargs.pop("address", None))
    try:
        envs = [make(id, client=client, **kwargs) for _ in range(count)]
        return TangramVectorEnv(envs, client=client, owns_client=owns_client, autoreset_mode=mode)
    except BaseException:
        if owns_client:
            client.close()
        raise


def pprint_registry() -> str:
    """The registered env ids, one per line."""
    return "\n".join(sorted(registry))


#: Entry-point group where packages declare their envs (``id = "module:Class"``); Tangram's own too.
ENTRY_POINT_GROUP = "tangram_env.envs"


def register_entry_point_envs() -> None:
    """Register every env an installed package declares (nothing is imported until ``make``)."""
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        register(ep.name, ep.value, override=True)
