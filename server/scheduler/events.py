"""What the scheduler consumes (events) and produces (decisions): plain data, no sockets, no clock.

The orchestrator and the benchmark simulator both drive a scheduler through
:meth:`Scheduler.handle`, with ``now`` in seconds from any fixed origin.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tangram_env.protocol import Resources  # one type from the wire to the ledger


# --- events ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ActionArrived:
    """An action entered the queue."""

    action_id: str
    kind: str
    demand: Resources
    min_par: int = 1
    max_par: int = 1
    trajectory_id: str = ""
    env_id: str = ""
    affinity: str | None = None  # a sandbox session that lives on one worker
    image: str | None = None  # sandbox image it needs, for per-image caps and warm pools
    priority: int = 0
    kinds_needed: str | None = None  # a worker must serve this kind (None: any worker)
    provider: str | None = None  # sandbox provider that creates ``image`` (creation-rate caps); None: "local"
    api: str | None = None  # external API it calls once (a quota: a key's token and slot); None: none
    # Memory its sandbox session holds on its worker from creation to SessionClosed, idle or not; charged
    # when this action opens the session (its first action), beside the action's own demand.
    sandbox_mem_mb: float = 0.0


@dataclass(frozen=True)
class ActionFinished:
    """A started action ended (any outcome); its resources are free again."""

    action_id: str
    duration_s: float  # execution time as measured where it ran (feeds the estimator)
    ok: bool = True
    setup_s: float = 0.0  # set-up before execution (sandbox creation, model load), measured where it ran


@dataclass(frozen=True)
class ActionThrottled:
    """A started action's API answered 429: its key pauses ``retry_after_s``, the action queues again."""

    action_id: str
    retry_after_s: float


@dataclass(frozen=True)
class ActionCancelled:
    """A queued action was withdrawn (cancelled or expired) before it started."""

    action_id: str


@dataclass(frozen=True)
class WorkerAdded:
    """Capacity joined (a worker registered)."""

    worker_id: str
    capacity: Resources
    kinds: frozenset[str] | None = None  # None: serves every kind
    sessions: frozenset[str] = frozenset()  # warm sandbox sessions / loaded models it holds


@dataclass(frozen=True)
class WorkerRemoved:
    """Capacity left (a worker deregistered or died); actions running there are lost to it."""

    worker_id: str


@dataclass(frozen=True)
class Tick:
    """Time passed (lets ageing and pool sizing act with no other event)."""


@dataclass(frozen=True)
class SessionClosed:
    """A sandbox session ended (the client closed it): its sandbox no longer counts as live."""

    session_id: str


@dataclass(frozen=True)
class TrajectoryClosed:
    """A trajectory ended (its env was closed or reset): whatever was bound to it may be released."""

    trajectory_id: str


Event = (
    ActionArrived
    | ActionFinished
    | ActionCancelled
    | WorkerAdded
    | WorkerRemoved
    | Tick
    | SessionClosed
    | TrajectoryClosed
    | ActionThrottled
)


# --- decisions ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Start:
    """Run ``action_id`` on ``worker_id`` with ``parallelism`` units (holding ``parallelism`` x demand)."""

    action_id: str
    worker_id: str
    parallelism: int = 1
    api_key: str | None = None  # the API key it must use (its name; the secret stays on the worker)
    # Runs in the batch of this action (started in the same call): one model, one forward pass on the
    # leader's units; it holds nothing of its own. None: a grant of its own.
    batch_of: str | None = None


@dataclass(frozen=True)
class Requeue:
    """An action that had started on a departed worker goes back to the queue (the scheduler did it)."""

    action_id: str


@dataclass(frozen=True)
class Reject:
    """An action that can never run here (no worker could ever fit it), with the reason."""

    action_id: str
    reason: str


@dataclass(frozen=True)
class ScalePool:
    """Keep up to ``size`` warm sandboxes of ``image`` (grow or shrink the warm pool).

    A sandbox given back (its session closed, or its session-less action ended) is reset and kept
    while fewer than ``size`` are warm, else destroyed; warm sandboxes above a smaller ``size`` are
    destroyed. The pool does not create sandboxes to fill itself: creations happen when a session or a
    session-less action starts with no warm sandbox, counted by the scheduler against the image's live
    cap and the provider's creation rate. ``expire`` warm sandboxes, the longest idle, are destroyed
    first: they have waited longer than keeping them pays (see :class:`~.caps.CapsConfig`).
    """

    image: str
    size: int
    expire: int = 0


Decision = Start | Requeue | Reject | ScalePool


class Scheduler(Protocol):
    """A pure state machine: events in, decisions out. Never sees sockets or the wall clock."""

    name: str

    def handle(self, events: Sequence[Event], now: float) -> list[Decision]:
        """Apply ``events`` (in order) at time ``now`` and return what to do next."""
        ...

    def pending(self) -> int:
        """Actions waiting to start."""
        ...

    def running(self) -> int:
        """Actions started and not finished."""
        ...

    def next_wakeup(self, now: float) -> float | None:
        """Return the earliest time a :class:`Tick` could change a decision unprompted (None: never)."""
        ...


class Inspectable(Protocol):
    """What the simulator and tests read from a scheduler besides the :class:`Scheduler` protocol."""

    def held(self) -> Resources:
        """Resources allocated right now, across all workers (grants, slots, replicas)."""
        ...

    def validate_state(self) -> None:
        """Check every internal invariant; raise ``AssertionError`` on the first broken one."""
        ...

    def story(self, action_id: str) -> list[tuple[float, str, str, str]]:
        """Return what happened to ``action_id``: ``(now, from, to, detail)``, oldest first (bounded)."""
        ...
