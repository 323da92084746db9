"""A hosted reward model: its registered spec, its queue, its replicas, and the calls into user code.

User code is called only from here: building an instance, ``load(device)``, ``score(batch)`` (its
output checked: one finite float per item) and ``unload()``.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tangram_env.errors import TangramRuntimeError
from tangram_env.kinds import KindSpec
from tangram_env.server.gpu.batching import ModelQueue
from tangram_env.server.gpu.devices import free_device_cache

#: Priors before a model has been measured (seconds).
LOAD_S_PRIOR = 1.0
BATCH_S_PRIOR = 0.05
#: Weight of a new measurement in the running estimates.
EMA_WEIGHT = 0.3
#: Time constant of the arrival-rate estimate (seconds): older arrivals count less, exponentially.
RATE_TAU_S = 10.0


class RewardModelError(TangramRuntimeError):
    """A reward model misbehaved: it raised, or returned the wrong number of scores, or a non-finite one."""


@dataclass(eq=False)
class Replica:
    """One copy of a model on one device slot."""

    model: str
    slot: int
    memory_mb: float
    state: Literal["loading", "ready"] = "loading"
    instance: Any = None
    busy: bool = False
    last_used: float = 0.0
    load_started: float = 0.0
    loaded_at: float = 0.0
    load_s: float = 0.0

    @property
    def ready(self) -> bool:
        """Loaded and able to score."""
        return self.state == "ready"


@dataclass
class ModelStats:
    """Counters of one model since the runner started."""

    loads: int = 0
    load_failures: int = 0
    evictions: int = 0
    retirements: int = 0
    load_s: float = 0.0
    last_load_s: float = 0.0
    unload_s: float = 0.0
    batches: int = 0
    items: int = 0
    errors: int = 0
    ooms: int = 0
    score_s: float = 0.0
    max_batch_seen: int = 0


@dataclass(eq=False)
class ModelEntry:
    """A reward-model kind as the runner hosts it."""

    spec: KindSpec
    queue: ModelQueue = field(default_factory=ModelQueue)
    replicas: dict[int, Replica] = field(default_factory=dict)  # by slot index
    stats: ModelStats = field(default_factory=ModelStats)
    memory_mb: float = 0.0  # device memory one replica books
    load_s_est: float = LOAD_S_PRIOR
    batch_s_est: float = BATCH_S_PRIOR
    # When a load last failed on a device (by slot index): an extra replica is not tried there again
    # for a while, since the queue waits on the replicas elsewhere rather than failing.
    load_failed_at: dict[int, float] = field(default_factory=dict)
    # Most items per batch since one ran out of memory: halved by each that does, one more after each
    # batch that fills it, until the declared ``max_batch`` again (None: none ran out lately).
    oom_cap: int | None = None
    _rate: float = 0.0  # items per second, decayed to ``_rate_t``
    _rate_t: float = 0.0

    def __post_init__(self) -> None:
        # A value the runner cannot book (a string, NaN, a negative) raised on every kinds() and stats()
        # call, blocked every other load (NaN) or over-committed the device (negative): refused here,
        # naming the model and the field (the runner then leaves this one model out).
        declared = getattr(self.spec.target, "memory_mb", None) if self.is_class else None
        if declared is not None:
            declared = check_memory_mb(self.name, declared)
        self.memory_mb = declared or check_memory_mb(self.name, self.spec.demand.gpu_mem_mb, "gpu_mem_mb")
        check_options(self.name, self.spec.options)

    @property
    def name(self) -> str:
        """The kind's name."""
        return self.spec.name

    @property
    def is_class(self) -> bool:
        """Registered as a class (built per replica, loaded onto a device) rather than a function."""
        return bool(self.spec.options.get("is_class", False))

    @property
    def declared_max_batch(self) -> int:
        """Most items per call, as the model was registered."""
        return max(1, int(self.spec.options.get("max_batch", 32)))

    @property
    def max_batch(self) -> int:
        """Most items scored in one call: the declared ``max_batch``, less after running out of memory."""
        declared = self.declared_max_batch
        return declared if self.oom_cap is None else min(declared, self.oom_cap)

    def halve_batches(self, n_items: int) -> None:
        """A batch of ``n_items`` ran out of memory: batches take half as many from now on."""
        self.oom_cap = max(1, n_items // 2)

    @property
    def max_wait_s(self) -> float:
        """How long the first request of a batch waits for company."""
        return max(0.0, float(self.spec.options.get("max_wait_ms", 5.0))) / 1000.0

    @property
    def lane(self) -> Literal["device", "host"]:
        """``host``: needs no accelerator (registered with ``gpu=0``); ``device`` otherwise."""
        return "host" if self.spec.demand.gpu <= 0 else "device"

    def missing_requirements(self) -> list[str]:
        """Modules the model declares in ``requires`` that cannot be imported here."""
        return missing_requirements(self.spec)

    def ready_replicas(self) -> int:
        """Replicas loaded and able to score."""
        return sum(1 for r in self.replicas.values() if r.ready)

    def observe_arrival(self, n_items: int, now: float) -> None:
        """Count ``n_items`` arriving at ``now`` in the decayed arrival rate."""
        self._rate = self.rate(now) + n_items / RATE_TAU_S
        self._rate_t = now

    def rate(self, now: float) -> float:
        """Items per second asked of this model lately (exponentially decayed over ``RATE_TAU_S``)."""
        return self._rate * math.exp(-max(0.0, now - self._rate_t) / RATE_TAU_S)

    def observe_load(self, seconds: float) -> None:
        """Record a measured load time (the set-up cost the scheduler and the placement see)."""
        self.stats.loads += 1
        self.stats.load_s += seconds
        self.stats.last_load_s = seconds
        w = 1.0 if self.stats.loads == 1 else EMA_WEIGHT
        self.load_s_est = (1 - w) * self.load_s_est + w * seconds

    def observe_batch(self, n_items: int, seconds: float) -> None:
        """Record a measured batch."""
        self.stats.batches += 1
        self.stats.items += n_items
        self.stats.score_s += seconds
        self.stats.max_batch_seen = max(self.stats.max_batch_seen, n_items)
        if self.oom_cap is not None and n_items >= self.oom_cap:  # it fitted: try one more next time
            self.oom_cap += 1
            if self.oom_cap >= self.declared_max_batch:
                self.oom_cap = None
        w = 1.0 if self.stats.batches == 1 else EMA_WEIGHT
        self.batch_s_est = (1 - w) * self.batch_s_est + w * seconds

    # --- calls into user code (never under the runner's lock) ------------------------------------
    def build_and_load(self, device: str) -> Any:
        """Build a fresh instance and load it onto ``device`` (a function model is its own instance)."""
        target = self.spec.target
        if not self.is_class:
            return target
        instance = target()
        load = getattr(instance, "load", None)
        if load is not None:
            load(device)
        return instance

    def score(self, instance: Any, items: list[Any]) -> list[float]:
        """``instance``'s scores of ``items``, checked: a list of ``len(items)`` finite floats."""
        fn = instance.score if self.is_class else instance
        if "torch" in sys.modules:
            import torch

            with torch.inference_mode():
                raw = fn(items)
        else:
            raw = fn(items)
        return check_scores(self.name, raw, len(items))

    def unload(self, replica: Replica, device: str) -> None:
        """Call the instance's ``unload`` (if any), drop it and give the device's cached memory back."""
        instance, replica.instance = replica.instance, None
        try:
            unload = getattr(instance, "unload", None) if self.is_class else None
            if unload is not None:
                unload()
        finally:
            del instance
            free_device_cache(device)


def missing_requirements(spec: KindSpec) -> list[str]:
    """Modules the model ``spec`` declares in ``requires`` that cannot be imported here."""
    needs: Sequence[str] = getattr(spec.target, "requires", ()) or ()
    return [m for m in needs if m not in sys.modules and importlib.util.find_spec(m) is None]


def check_memory_mb(model: str, value: Any, field_name: str = "memory_mb", where: str = "") -> float:
    """``value`` as the MiB one replica of ``model`` books: a finite real number >= 0, else
    :class:`RewardModelError` naming the model, the field, the value and ``where`` it was set.
    """
    number = _real(value)
    if not math.isfinite(number) or number < 0:
        raise RewardModelError(
            f"reward model {model!r} has {field_name}={value!r:.80}{where}: "
            "it must be a finite number of MiB >= 0, without a unit"
        )
    return number


def _real(value: Any) -> float:
    """``value`` as a float when it is a real number (not a bool, a string or a size with its unit),
    else NaN (so is an int too large for a float).
    """
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except (OverflowError, ValueError, TypeError):
        return math.nan


def check_options(model: str, options: dict[str, Any]) -> None:
    """Refuse ``max_batch`` and ``max_wait_ms`` the runner cannot use (the placement policy reads them
    on every step of its device: a bad one would stall every model there), naming the model and field.
    """
    batch = options.get("max_batch", 32)
    if not isinstance(batch, numbers.Integral) or isinstance(batch, bool) or batch < 1:
        raise RewardModelError(
            f"reward model {model!r} has max_batch={batch!r:.80}: it must be a whole number of items >= 1"
        )
    wait = options.get("max_wait_ms", 5.0)
    number = _real(wait)
    if not math.isfinite(number) or number < 0:
        raise RewardModelError(
            f"reward model {model!r} has max_wait_ms={wait!r:.80}: it must be a finite number >= 0"
        )


def check_scores(model: str, raw: Any, n: int) -> list[float]:
    """``raw`` as ``n`` finite floats, or :class:`RewardModelError` saying what is wrong with it."""
    if hasattr(raw, "tolist") and not isinstance(raw, list | tuple):  # a tensor or an array
        raw = raw.tolist()
    if not isinstance(raw, list | tuple):
        raise RewardModelError(f"reward model {model!r} returned {type(raw).__name__}, not a list of floats")
    if len(raw) != n:
        raise RewardModelError(f"reward model {model!r} returned {len(raw)} scores for {n} items")
    out: list[float] = []
    for i, value in enumerate(raw):
        # float() would take "0.9", b"1" and True: a model returning text or flags is broken, not scored
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise RewardModelError(
                f"reward model {model!r} returned a non-number for item {i}: {value!r:.60}"
            )
        number = float(value)
        if not math.isfinite(number):
            raise RewardModelError(f"reward model {model!r} returned {number} for item {i}")
        out.append(number)
    return out
