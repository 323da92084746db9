"""Action kinds: the tools and reward models that actions name, and the decorators that register them.

A kind's code runs where the resources are (the orchestrator and its workers), which import it from
plugin modules; clients only ever send a kind's name and arguments that validate against its schema.
"""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
import os
import re
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tangram_env.errors import AlreadyRegisteredError, UnknownNameError, did_you_mean
from tangram_env.protocol import Action, Demand, Elastic, Resources

Role = Literal["tool", "reward_model"]


@dataclass
class ActionContext:
    """What a running action knows about its grant. Tools that declare a ``ctx`` parameter get one.

    ``parallelism`` is the number of units the scheduler granted (``min_par..max_par``), ``cores`` the
    CPU ids it may use, ``deadline`` a :func:`time.monotonic` instant, ``sandbox`` the sandbox it runs
    in (see :mod:`tangram_env.sandbox`) when its kind uses one.
    """

    action: Action
    parallelism: int = 1
    cores: tuple[int, ...] = ()
    deadline: float = float("inf")
    sandbox: Any = None
    device: str = "cpu"
    api_key: str | None = None  # name of the API key the scheduler granted (tools that declare ``api=``)

    def remaining(self) -> float:
        """Seconds left before the action's time limit."""
        return max(0.0, self.deadline - time.monotonic())

    def api_secret(self) -> str | None:
        """The secret of the granted API key, read from this worker's environment (None: no key granted).

        Key ``team-a`` reads ``TANGRAM_API_KEY_TEAM_A``: secrets live on the workers, only names travel.
        """
        if self.api_key is None:
            return None
        return api_secret(self.api_key)


def api_secret_variable(key: str) -> str:
    """The environment variable that holds API key ``key``'s secret on a worker."""
    return "TANGRAM_API_KEY_" + re.sub(r"[^A-Za-z0-9]", "_", key).upper()


def api_secret(key: str) -> str:
    """The secret of API key ``key`` on this worker (raises KeyError naming the variable to set)."""
    var = api_secret_variable(key)
    try:
        return os.environ[var]
    except KeyError:
        raise KeyError(f"API key {key!r} has no secret on this worker: set {var}") from None


def _without_null(prop: dict[str, Any]) -> dict[str, Any]:
    """An optional argument's schema as its one type (``anyOf [T, null]`` becomes ``T``): function-calling
    clients (OpenAI's strict mode aside) want one ``type`` per property, and leaving it out means None.
    """
    options = prop.get("anyOf")
    if not isinstance(options, list):
        return prop
    kept = [o for o in options if o.get("type") != "null"]
    if len(kept) != 1 or len(kept) == len(options):
        return prop
    merged = {k: v for k, v in prop.items() if k not in ("anyOf", "default")}
    return {**kept[0], **merged}


@dataclass(frozen=True)
class KindSpec:
    """A registered action kind (a tool or a reward model): what runs, with what resources."""

    name: str
    role: Role
    target: Callable[..., Any]
    args_model: type[BaseModel] | None
    demand: Resources
    elastic: Elastic
    timeout_s: float
    description: str = ""
    module: str = ""
    takes_ctx: bool = False
    #: "process": a child process per action; "inline": on the orchestrator's loop (only for
    #: trivial built-ins that cannot block); "sandbox": in a sandbox of ``image``.
    placement: Literal["process", "inline", "sandbox"] = "process"
    image: str | None = None
    #: Its sandbox (an action without a session) is closed after use, never reset and lent again: for a
    #: kind that puts in it what agents must not see (a grader's hidden tests).
    retire_sandbox: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    #: External API each call uses once (a quota in the server's settings limits it); None: none.
    api: str | None = None
    #: The argument keys the kind accepts when it refuses others (its model left ``extra`` unset);
    #: None: the model's own ``extra`` decides. Derived from ``args_model``.
    accepted_keys: frozenset[str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_spec(self)
        object.__setattr__(self, "accepted_keys", _accepted_keys(self.args_model))

    def validate_payload(self, payload: dict[str, Any]) -> BaseModel | dict[str, Any]:
        """The payload as the kind's argument model (raises :class:`pydantic.ValidationError`, or
        :class:`UnknownArgumentsError` for keys the model does not know).
        """
        if self.args_model is None:
            return payload
        accepted = self.accepted_keys
        if accepted is not None and not accepted.issuperset(payload):
            raise UnknownArgumentsError(self._unknown_keys(payload, accepted))
        return self.args_model.model_validate(payload)

    def _unknown_keys(self, payload: dict[str, Any], accepted: frozenset[str]) -> str:
        unknown = [f"{k!r}{_closest(str(k), accepted)}" for k in payload if k not in accepted]
        model = self.args_model.__name__ if self.args_model is not None else "?"
        return (
            f"arguments of {self.name!r} are invalid: unknown key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(unknown)}; it accepts {', '.join(map(repr, sorted(accepted))) or 'no keys'} "
            f"(to drop unknown keys instead, set model_config = ConfigDict(extra='ignore') on {model})"
        )

    def json_schema(self) -> dict[str, Any]:
        """The kind in the function-calling format LLM agents read (``{"type": "function", ...}``)."""
        if self.args_model is not None:
            params = self.args_model.model_json_schema()
            params.pop("title", None)
            for name, prop in params.get("properties", {}).items():
                params["properties"][name] = _without_null(prop)
        else:
            params = {"type": "object", "properties": {}}
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": params},
        }

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary for listings."""
        return {
            "name": self.name,
            "role": self.role,
            "demand": self.demand.as_dict(),
            "elastic": self.elastic.model_dump(),
            "timeout_s": self.timeout_s,
            "placement": self.placement,
            "module": self.module,
            "description": self.description,
            **({"api": self.api} if self.api else {}),
            "schema": self.json_schema(),
            **({"options": self.options} if self.options else {}),
        }


def _closest(key: str, known: frozenset[str]) -> str:
    hint = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else ""


class UnknownArgumentsError(ValueError):
    """An action's payload has keys its kind's argument model does not define."""


#: The longest kind name an action can carry (``Action.kind``).
MAX_NAME_LENGTH = 128
_PLACEMENTS = ("process", "inline", "sandbox")


def _check_spec(spec: KindSpec) -> None:
    """Refuse, at registration, a spec no action could ever run with (a ValueError naming the field)."""
    what = f"{spec.role} {spec.name!r}"
    if not isinstance(spec.name, str) or not spec.name:
        raise ValueError(f"{spec.role} name {spec.name!r} is invalid: pass a non-empty string as name=")
    if len(spec.name) > MAX_NAME_LENGTH:
        raise ValueError(
            f"{spec.role} name {spec.name[:40]!r}... is {len(spec.name)} characters long: an action's kind "
            f"holds at most {MAX_NAME_LENGTH}; pass a shorter name="
        )
    # A grant cannot carry a limit of 0, a negative one or inf: the first action would fail to start.
    _check_number(what, "timeout_s", spec.timeout_s, "seconds", 0.0, math.inf, positive=True)
    demand = spec.demand
    for field_name, value, unit, most in (
        ("cpu", demand.cpu, "cores", 1e6),
        ("mem_mb", demand.mem_mb, "MiB", 2**40),
        ("gpu", demand.gpu, "GPUs", 1e5),
        ("gpu_mem_mb", demand.gpu_mem_mb, "MiB", 2**40),
    ):  # the bounds an action's demand has on the wire (protocol.Resources)
        _check_number(what, field_name, value, unit, 0.0, most)
    if spec.placement not in _PLACEMENTS:
        choices = ", ".join(map(repr, _PLACEMENTS))
        raise ValueError(f"{what}: placement={spec.placement!r} is invalid: pass one of {choices}")
    if "max_batch" in spec.options:
        batch = spec.options["max_batch"]
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"{what}: max_batch={batch!r} is invalid: pass a whole number of items >= 1")
    if "max_wait_ms" in spec.options:
        _check_number(what, "max_wait_ms", spec.options["max_wait_ms"], "milliseconds", 0.0, math.inf)


def _check_number(
    what: str, name: str, value: Any, unit: str, least: float, most: float, positive: bool = False
) -> None:
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy's too
    if real and math.isfinite(value) and (value > least if positive else value >= least) and value <= most:
        return
    bound = f"> {least:g}" if positive else f">= {least:g}"
    upper = "" if math.isinf(most) else f" and <= {int(most)}"
    raise ValueError(f"{what}: {name}={value!r} is invalid: pass a finite number of {unit} {bound}{upper}")


def _elastic(what: str, min_par: Any, max_par: Any) -> Elastic:
    """The kind's elasticity, or a ValueError naming the kind and the fix."""
    for name, value in (("min_par", min_par), ("max_par", max_par)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{what}: {name}={value!r} is invalid: pass a whole number of units >= 1")
    if max_par < min_par:
        raise ValueError(f"{what}: max_par={max_par} is below min_par={min_par}: pass max_par >= min_par")
    return Elastic(min_par=min_par, max_par=max_par)


def _accepted_keys(model: type[BaseModel] | None) -> frozenset[str] | None:
    """The keys a model that left ``extra`` unset accepts (pydantic would drop the rest silently, so a
    misspelt argument would just vanish); None: the model chose, or its aliases are not plain names.
    """
    if model is None or "extra" in model.model_config:
        return None
    keys: set[str] = set()
    for name, info in model.model_fields.items():
        keys.add(name)
        for alias in (info.alias, info.validation_alias):
            if isinstance(alias, str):
                keys.add(alias)
            elif alias is not None:  # AliasChoices / AliasPath: leave it to the model
                return None
    return frozenset(keys)


class KindRegistry:
    """Name -> :class:`KindSpec`. One per process; the orchestrator's is filled by its plugins."""

    def __init__(self) -> None:
        self._specs: dict[str, KindSpec] = {}
        #: Plugins that failed to import here -> why (an unknown kind's error names them).
        self.failed_plugins: dict[str, str] = {}

    def add(self, spec: KindSpec) -> KindSpec:
        """Register ``spec``; re-registering the same target (a module reloaded) replaces it."""
        old = self._specs.get(spec.name)
        if old is not None and _qualname(old.target) != _qualname(spec.target):
            raise AlreadyRegisteredError(
                f"{spec.role} {spec.name!r} is already registered by {_qualname(old.target)}"
            )
        self._specs[spec.name] = spec
        return spec

    def get(self, name: str) -> KindSpec:
        """The spec named ``name``, or :class:`UnknownNameError` with the closest names."""
        try:
            return self._specs[name]
        except KeyError:
            extra = did_you_mean(name, self._specs)
            if self.failed_plugins:  # the kind may be one of theirs: say which and why
                failed = "; ".join(f"{p} ({why})" for p, why in sorted(self.failed_plugins.items()))
                extra += (
                    f"; plugins that failed to import on this server, whose kinds are missing: {failed} "
                    "(install what they need, then restart the server)"
                )
            raise UnknownNameError(f"no tool or reward model named {name!r}{extra}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> typing.Iterator[KindSpec]:
        return iter(list(self._specs.values()))

    def __len__(self) -> int:
        return len(self._specs)

    def remove(self, name: str) -> None:
        """Forget ``name`` (tests and interactive sessions)."""
        self._specs.pop(name, None)

    def user_modules(self) -> list[str]:
        """Modules outside tangram_env that registered kinds: what an embedded server must import."""
        return sorted(
            {s.module for s in self._specs.values() if s.module and not s.module.startswith("tangram_env")}
        )


#: The process-wide registry of action kinds.
kind_registry = KindRegistry()


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _args_model(fn: Callable[..., Any]) -> tuple[type[BaseModel] | None, bool]:
    """The pydantic model of ``fn``'s first parameter, and whether it takes a ``ctx`` parameter."""
    params = list(inspect.signature(fn).parameters.values())
    hints = typing.get_type_hints(fn)
    takes_ctx = any(p.name == "ctx" for p in params)
    args = [p for p in params if p.name != "ctx" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not args:
        return None, takes_ctx
    for extra in args[1:]:  # it is only ever called with its arguments (and ctx=)
        if extra.default is inspect.Parameter.empty:
            raise TypeError(
                f"tool {fn.__qualname__} has a second required parameter {extra.name!r}: a tool takes its "
                "arguments model (and optionally ctx); move it into the model or give it a default"
            )
    model = hints.get(args[0].name)
    if not (inspect.isclass(model) and issubclass(model, BaseModel)):
        raise TypeError(
            f"the first parameter of tool {fn.__qualname__} must be annotated with a pydantic model, "
            f"got {model!r}"
        )
    return model, takes_ctx


def tool(
    name: str | None = None,
    *,
    cpu: float = 1.0,
    mem_mb: int = 256,
    gpu: float = 0.0,
    gpu_mem_mb: int = 0,
    timeout_s: float = 60.0,
    min_par: int = 1,
    max_par: int = 1,
    description: str | None = None,
    placement: Literal["process", "inline", "sandbox"] = "process",
    image: str | None = None,
    api: str | None = None,
    retire_sandbox: bool = False,
    registry: KindRegistry | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a function as a tool: an action kind whose arguments are a pydantic model.

    The function takes the validated arguments (and, optionally, ``ctx: ActionContext``) and returns
    anything msgpack can carry, with string dict keys (a pydantic model is dumped to a dict)::

        class Add(BaseModel):
            a: int
            b: int

        @tangram_env.tool(name="add", cpu=0.5, timeout_s=5)
        def add(args: Add) -> int:
            return args.a + args.b

    ``api="web-search"`` declares that each call uses one request of that external API: the scheduler
    starts it only when one of the API's keys has quota, and ``ctx.api_key`` names the key to use.
    ``retire_sandbox=True`` (``placement="sandbox"``): the sandbox an action without a session ran in
    is closed afterwards, never reset and lent to another action, for a tool that puts in it what
    agents must not see.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        model, takes_ctx = _args_model(fn)
        kind_name = fn.__name__ if name is None else name  # name="" is refused, not replaced
        (kind_registry if registry is None else registry).add(
            KindSpec(
                name=kind_name,
                role="tool",
                target=fn,
                args_model=model,
                demand=Demand(cpu=cpu, mem_mb=mem_mb, gpu=gpu, gpu_mem_mb=gpu_mem_mb),
                elastic=_elastic(f"tool {kind_name!r}", min_par, max_par),
                timeout_s=timeout_s,
                description=description if description is not None else inspect.getdoc(fn) or "",
                module=fn.__module__,
                takes_ctx=takes_ctx,
                placement=placement,
                image=image,
                api=api,
                retire_sandbox=retire_sandbox,
            )
        )
        return fn

    return decorate


class ScoreArgs(BaseModel):
    """Arguments of every reward-model action: the items to score (the model defines their shape)."""

    model_config = ConfigDict(extra="forbid")  # a misspelt key would otherwise be dropped silently

    items: list[Any]


def reward_model(
    name: str | None = None,
    *,
    cpu: float = 0.0,
    mem_mb: int = 64,
    gpu: float = 0.0,
    gpu_mem_mb: int = 0,
    max_batch: int = 32,
    max_wait_ms: float = 5.0,
    timeout_s: float = 120.0,
    max_par: int = 1,
    description: str | None = None,
    registry: KindRegistry | None = None,
) -> Callable[[Any], Any]:
    """Register a reward model: a function ``score(items) -> list[float]``, or a class with ``load(device)``
    and ``score(batch) -> list[float]`` (see :class:`RewardModel`: one instance per replica, built and
    loaded onto a device on demand, built afresh each time it is loaded again).

    Its actions take ``{"items": [...]}`` and return one float per item, in order. The model is called
    with batches of up to ``max_batch`` items, which may mix several actions' items; a batch waits at
    most ``max_wait_ms`` for more. ``gpu=0`` runs it on the worker's host lane, with no device.
    ``max_par`` above 1 lets one action's items split across replicas. Without ``name``, a class's
    ``name`` attribute, else the target's ``__name__``, names the kind. See ``docs/reward-models.md``.
    """

    def decorate(target: Any) -> Any:
        kind_name = name if name is not None else getattr(target, "name", None) or target.__name__
        _check_scorer(target)
        (kind_registry if registry is None else registry).add(
            KindSpec(
                name=kind_name,
                role="reward_model",
                target=target,
                args_model=ScoreArgs,
                demand=Demand(cpu=cpu, mem_mb=mem_mb, gpu=gpu, gpu_mem_mb=gpu_mem_mb),
                elastic=_elastic(f"reward_model {kind_name!r}", 1, max_par),
                timeout_s=timeout_s,
                description=description if description is not None else inspect.getdoc(target) or "",
                module=target.__module__,
                options={
                    "max_batch": max_batch,
                    "max_wait_ms": max_wait_ms,
                    "is_class": inspect.isclass(target),
                },
            )
        )
        return target

    return decorate


def _check_scorer(target: Any) -> None:
    """A reward model is a ``score(items)`` function or a class with its own ``score(batch)`` method,
    called synchronously on a device's thread (a coroutine function would return a coroutine, never
    scores), and a class's ``memory_mb`` is a finite number of MiB, at least 0.
    """
    if inspect.isclass(target):
        # (A RewardModel subclass that keeps the base's score fails on its first batch, saying so.)
        score = getattr(target, "score", None)
        if not callable(score):
            raise TypeError(
                f"reward model class {target.__qualname__} has no score method: define "
                "score(self, batch) -> list[float] (see tangram_env.RewardModel)"
            )
        memory = getattr(target, "memory_mb", 0)
        if isinstance(memory, bool) or not isinstance(memory, int | float) or not 0 <= memory < math.inf:
            raise ValueError(
                f"reward model class {target.__qualname__}: memory_mb={memory!r} is invalid: give the MiB "
                "one replica holds on its device as a finite number >= 0 (load() may set it from what it "
                "measured)"
            )
    elif not callable(target):
        raise TypeError(
            f"a reward model is a function score(items) -> list[float] or a class with score(batch), "
            f"got {target!r}"
        )
    else:
        score = target
    if inspect.iscoroutinefunction(score):
        raise TypeError(
            f"reward model {getattr(target, '__qualname__', target)!r}: score is a coroutine function; "
            "reward models are called synchronously on their device's thread: make it a plain function "
            "(run any async client with asyncio.run inside it)"
        )


def tools(role: Role | None = None) -> list[dict[str, Any]]:
    """The registered tools and reward models of this process (``role`` filters), each described with
    its demand and its function-calling JSON schema.
    """
    return [s.describe() for s in kind_registry if role is None or s.role == role]


class RewardModel:
    """Base class for class-based reward models (a plain class with the same methods works too).

    A GPU worker builds one instance per replica (with no arguments), calls :meth:`load` with the
    device it may use (``"cuda:0"``, ``"cpu"``), then :meth:`score` with batches of items, and
    :meth:`unload` when it drops the replica: evicted to make room for another model, an idle extra
    replica retired, after running out of memory, or when the worker closes. A model loaded again
    gets a new instance::

        @tangram_env.reward_model(name="length", gpu=0.1, max_batch=64)
        class LengthReward(tangram_env.RewardModel):
            memory_mb = 64

            def load(self, device: str) -> None:
                self.net = build_net().to(device).eval()

            def score(self, batch: list[Any]) -> list[float]:
                return self.net(encode(batch)).tolist()

    ``memory_mb`` is the device memory one replica holds (what the worker books against the device's
    budget); 0 means the kind's ``gpu_mem_mb``. A model may update it in :meth:`load` once it knows
    its real size; on a CUDA device, the memory torch allocated during :meth:`load` replaces it when
    that is more than zero. ``requires`` names importable modules it needs; a worker that lacks one
    does not offer the model.
    """

    memory_mb: int = 0
    requires: tuple[str, ...] = ()

    def load(self, device: str) -> None:
        """Put the model's weights on ``device`` (called once per replica before any :meth:`score`)."""

    def score(self, batch: list[Any]) -> list[float]:
        """One finite float per item of ``batch``, in order."""
        raise NotImplementedError

    def unload(self) -> None:
        """Free what :meth:`load` took on the device (the worker drops the instance afterwards)."""
