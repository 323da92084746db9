"""Placement: what a free device does next. Pure functions of the runner's state and ``now``.

Each device slot, whenever it is free, asks its policy for one :data:`Step`: score a batch of a model
loaded there, load a model (evicting the least recently used ones that do not fit beside it), retire
an idle extra replica, or wait. Two policies:

- :class:`LruReplicaPolicy` (the default): a model loads on demand on the least pressed device with
  room for it (pressure: the recent request rate of the models there), else the least recently
  used idle models are evicted to make room. A device with nothing of its own to run lends itself
  to a busy model as another replica, when that model's backlog would take a few loads' time to
  drain or its devices have been much busier than this one lately; extra replicas idle for a while
  retire. Requests are served oldest first across models; a model that must be loaded first counts
  its load time against its age, so warm models win ties.
- :class:`StaticPolicy` (the baseline of the benchmarks): each model has one fixed device and never
  a second replica.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tangram_env.server.gpu.devices import DeviceSlot
from tangram_env.server.gpu.models import ModelEntry, Replica

LOAD_RETRY_S = 60.0  # a device where an extra replica failed to load is not asked again for this long


@dataclass(frozen=True)
class RunBatch:
    """Score the next batch of ``model`` on this device (it is loaded here)."""

    model: str


@dataclass(frozen=True)
class Load:
    """Unload ``evict`` (least recently used first), then load ``model`` here."""

    model: str
    evict: tuple[str, ...] = ()


@dataclass(frozen=True)
class Retire:
    """Unload this device's idle replica of ``model`` (the model has replicas elsewhere)."""

    model: str


@dataclass(frozen=True)
class Wait:
    """Nothing to do before ``until`` (a monotonic time; None: until something changes)."""

    until: float | None = None


@dataclass(frozen=True)
class Unplaceable:
    """``model`` does not fit on any device of its lane, even alone: its requests must fail."""

    model: str
    reason: str


Step = RunBatch | Load | Retire | Wait | Unplaceable


def replicas_on(slot: DeviceSlot, models: Mapping[str, ModelEntry]) -> dict[str, Replica]:
    """Model name -> its replica on ``slot``."""
    return {name: m.replicas[slot.index] for name, m in models.items() if slot.index in m.replicas}


def used_mb(slot: DeviceSlot, models: Mapping[str, ModelEntry]) -> float:
    """Memory booked on ``slot`` by replicas loaded or loading there."""
    return sum(r.memory_mb for r in replicas_on(slot, models).values())


def pressure(slot: DeviceSlot, models: Mapping[str, ModelEntry], now: float) -> float:
    """Items per second ``slot`` is expected to serve.

    Each resident model's recent arrival rate, shared among its replicas.
    """
    return sum(
        models[name].rate(now) / max(1, len(models[name].replicas)) for name in replicas_on(slot, models)
    )


def batch_ready_at(model: ModelEntry, oldest: float) -> float:
    """Return when ``model``'s next batch should go.

    At once if it is full, else when its oldest request has waited ``max_wait_ms``.
    """
    if model.queue.takeable_items(limit=model.max_batch) >= model.max_batch:
        return oldest
    return oldest + model.max_wait_s


class LruReplicaPolicy:
    """Load on demand, evict the least recently used, add replicas of busy models on free devices.

    ``retire_idle_s``: an extra replica idle this long is unloaded (the last one stays cached until
    evicted). ``max_replicas``: cap per model (None: one per device). ``replica_gain``: a device with
    nothing of its own to run loads another replica of a busy model when the model's backlog would
    take more than this many load times to drain on the replicas it has, or when every device holding
    the model has been busy more than ``spread_util`` of the time lately (utilization is weighted
    over the last few seconds) and this one at least ``spread_gap`` less.
    """

    name = "lru+replicas"

    def __init__(
        self,
        retire_idle_s: float = 60.0,
        max_replicas: int | None = None,
        replica_gain: float = 2.0,
        spread_util: float = 0.6,
        spread_gap: float = 0.25,
    ) -> None:
        if retire_idle_s < 0:
            raise ValueError("retire_idle_s must be >= 0")
        if max_replicas is not None and max_replicas < 1:
            raise ValueError("max_replicas must be >= 1")
        if replica_gain <= 0:
            raise ValueError("replica_gain must be > 0")
        self.retire_idle_s = retire_idle_s
        self.max_replicas = max_replicas
        self.replica_gain = replica_gain
        self.spread_util = spread_util
        self.spread_gap = spread_gap

    def check(self, slots: Sequence[DeviceSlot]) -> None:
        """Refuse settings that cannot work on ``slots`` (raises ``ValueError``)."""

    def next_step(
        self, slot: DeviceSlot, slots: Sequence[DeviceSlot], models: Mapping[str, ModelEntry], now: float
    ) -> Step:
        """Decide what the free device ``slot`` should do now."""
        here = replicas_on(slot, models)
        wake: list[float] = []
        extra: list[ModelEntry] = []
        best: tuple[float, Step] | None = None
        for model in models.values():
            if not slot.serves(model.lane, model.name):
                continue
            oldest = model.queue.oldest()
            if oldest is None:
                continue
            replica = here.get(model.name)
            step: Step
            if replica is not None:
                if not replica.ready or replica.busy:
                    continue
                ready_at = batch_ready_at(model, oldest)
                if ready_at > now:
                    wake.append(ready_at)
                    continue
                key, step = oldest, RunBatch(model.name)
            else:
                if model.memory_mb > slot.budget_mb:
                    lane = [s for s in slots if s.serves(model.lane, model.name)]
                    if all(model.memory_mb > s.budget_mb for s in lane):
                        return Unplaceable(
                            model.name,
                            f"reward model {model.name!r} needs {model.memory_mb:.0f} MiB; the largest "
                            f"device budget is {max(s.budget_mb for s in lane):.0f} MiB",
                        )
                    continue
                if model.replicas:
                    extra.append(model)  # served elsewhere: a replica only if this device has nothing else
                    continue
                if not self.wants_replica(slot, slots, model, models, now):
                    continue
                evict = self.evictions(slot, model, models)
                if evict is None:
                    continue
                key, step = oldest + model.load_s_est, Load(model.name, evict)
            if best is None or key < best[0]:
                best = (key, step)
        if best is not None:
            return best[1]
        if not wake:  # idle, with no batch of its own forming: lend this device to a backlog
            for model in sorted(extra, key=lambda m: m.queue.oldest() or now):
                if self.wants_replica(slot, slots, model, models, now):
                    evict = self.evictions(slot, model, models)
                    if evict is not None:
                        return Load(model.name, evict)
        retire = self._retire(here, models, now, wake)
        return retire if retire is not None else Wait(min(wake) if wake else None)

    def wants_replica(
        self,
        slot: DeviceSlot,
        slots: Sequence[DeviceSlot],
        model: ModelEntry,
        models: Mapping[str, ModelEntry],
        now: float = 0.0,
    ) -> bool:
        """Whether ``slot`` (free, without ``model``) should load ``model`` for its waiting requests."""
        homes = model.replicas
        if not homes:
            roomy = [
                s for s in slots if s.serves(model.lane, model.name) and self._fits_free(s, model, models)
            ]
            if not roomy:
                return True  # it fits nowhere without evicting: evict here
            # Of the devices with room to spare, the least pressed takes it (it may be busy for a
            # moment; it looks again as soon as it is free).
            best = min(roomy, key=lambda s: (pressure(s, models, now), s is not slot, s.index))
            return best is slot
        cap = self.max_replicas or sum(1 for s in slots if s.serves(model.lane, model.name))
        if len(homes) >= cap or any(not r.ready for r in homes.values()):
            return False  # at the cap, or one is already loading
        if now - model.load_failed_at.get(slot.index, -math.inf) < LOAD_RETRY_S:
            return False  # it failed to load here lately, and the replicas it has serve meanwhile
        if all(r.busy for r in homes.values()):  # else an idle replica will take the work
            backlog = model.queue.takeable_items()
            drain_s = math.ceil(backlog / model.max_batch) * model.batch_s_est / len(homes)
            if drain_s > self.replica_gain * model.load_s_est:
                return True
        # Sustained imbalance: every device holding the model is busy most of the time, this one not.
        by_index = {s.index: s for s in slots}
        home_util = min(by_index[i].utilization(now) for i in homes)
        return home_util >= self.spread_util and slot.utilization(now) <= home_util - self.spread_gap

    @staticmethod
    def _fits_free(slot: DeviceSlot, model: ModelEntry, models: Mapping[str, ModelEntry]) -> bool:
        return model.memory_mb <= slot.budget_mb - used_mb(slot, models)

    @staticmethod
    def evictions(
        slot: DeviceSlot, model: ModelEntry, models: Mapping[str, ModelEntry]
    ) -> tuple[str, ...] | None:
        """Pick the models to unload from ``slot`` so ``model`` fits.

        Idle ones without waiting work go first, least recently used first. None: it cannot fit now
        (the rest are busy).
        """
        here = replicas_on(slot, models)
        need = model.memory_mb - (slot.budget_mb - sum(r.memory_mb for r in here.values()))
        if need <= 1e-9:
            return ()
        idle = [r for r in here.values() if r.ready and not r.busy]
        idle.sort(key=lambda r: (models[r.model].queue.oldest() is not None, r.last_used))
        out: list[str] = []
        for replica in idle:
            out.append(replica.model)
            need -= replica.memory_mb
            if need <= 1e-9:
                return tuple(out)
        return None

    def _retire(
        self, here: Mapping[str, Replica], models: Mapping[str, ModelEntry], now: float, wake: list[float]
    ) -> Retire | None:
        for name, replica in here.items():
            model = models[name]
            if (
                not replica.ready
                or replica.busy
                or len(model.replicas) < 2
                or model.queue.oldest() is not None
            ):
                continue
            due = replica.last_used + self.retire_idle_s
            if due <= now:
                return Retire(name)
            wake.append(due)
        return None


class StaticPolicy(LruReplicaPolicy):
    """A fixed device per model, one replica each: the static placement baseline.

    ``assignment`` maps model names to device slot indices; models it does not name are placed
    round-robin in the order they are first seen. Models still evict each other (least recently
    used first) if those sharing a device do not fit together.
    """

    name = "static"

    def __init__(self, assignment: Mapping[str, int] | None = None) -> None:
        super().__init__(retire_idle_s=float("inf"), max_replicas=1)
        self.assignment = dict(assignment or {})
        self._next = 0

    def check(self, slots: Sequence[DeviceSlot]) -> None:
        """Every assigned index must be a device slot."""
        devices = {s.index for s in slots if s.lane == "device"}
        bad = {name: i for name, i in self.assignment.items() if i not in devices}
        if bad:
            raise ValueError(
                f"static placement names devices that do not exist: {bad}; devices are {sorted(devices)}"
            )

    def home(self, model: ModelEntry, slots: Sequence[DeviceSlot]) -> int:
        """Return the slot index ``model`` lives on."""
        lane = [s.index for s in slots if s.serves(model.lane, model.name)]
        if model.lane == "host":
            return lane[0]  # its own slot
        if model.name not in self.assignment:
            self.assignment[model.name] = lane[self._next % len(lane)]
            self._next += 1
        return self.assignment[model.name]

    def wants_replica(
        self,
        slot: DeviceSlot,
        slots: Sequence[DeviceSlot],
        model: ModelEntry,
        models: Mapping[str, ModelEntry],
        now: float = 0.0,
    ) -> bool:
        """Only a model's own device loads it, and only once."""
        return not model.replicas and self.home(model, slots) == slot.index
