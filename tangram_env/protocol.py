"""Protocol models: every message between clients, the orchestrator and workers.

On the wire a message is one ZeroMQ frame, ``version | len(type) | type | body`` (a ROUTER adds the
peer's identity as a frame in front); ``type`` is the model's ``kind`` and ``body`` its fields in msgpack.
See :mod:`tangram_env.wire` for the encoding and ``docs/architecture.md`` for the semantics.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

#: Bumped on any incompatible change; peers speaking another version get an ``Error``.
# 2: Register carries one `capacity`; a demand's omitted amounts are 0. 3: Submit carries
# `server_id`, Register a `token`.
PROTOCOL_VERSION = 3


class _Model(BaseModel):
    # No inf or NaN in any float field: they would poison the scheduler's sums and comparisons.
    model_config = ConfigDict(extra="forbid", frozen=False, allow_inf_nan=False)


# Amounts of each resource in a demand or a capacity. The upper bounds are sanity limits against
# hostile or garbled peers (a million cores, 10^5 GPUs, 2^40 MiB); no inf or NaN.
Cores = Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)]
GpuUnits = Annotated[float, Field(ge=0, le=1e5, allow_inf_nan=False)]
MiBAmount = Annotated[float, Field(ge=0, le=2**40, allow_inf_nan=False)]


@dataclass(frozen=True)
class Resources:
    """An amount of each resource type: an action's demand per unit of parallelism, or a capacity.

    One type from the wire to the scheduler's ledger. A plain dataclass, so the scheduler's arithmetic
    costs nothing; pydantic checks the bounds above wherever it arrives inside a message.
    """

    cpu: Cores = 0.0
    mem_mb: MiBAmount = 0.0
    gpu: GpuUnits = 0.0
    gpu_mem_mb: MiBAmount = 0.0

    def __add__(self, other: Resources) -> Resources:
        return Resources(
            self.cpu + other.cpu,
            self.mem_mb + other.mem_mb,
            self.gpu + other.gpu,
            self.gpu_mem_mb + other.gpu_mem_mb,
        )

    def __sub__(self, other: Resources) -> Resources:
        return Resources(
            self.cpu - other.cpu,
            self.mem_mb - other.mem_mb,
            self.gpu - other.gpu,
            self.gpu_mem_mb - other.gpu_mem_mb,
        )

    def scaled(self, k: float) -> Resources:
        """``k`` units of this demand."""
        return Resources(self.cpu * k, self.mem_mb * k, self.gpu * k, self.gpu_mem_mb * k)

    def fits_in(self, free: Resources, eps: float = 1e-9) -> bool:
        """Every component is at most ``free``'s."""
        return (
            self.cpu <= free.cpu + eps
            and self.mem_mb <= free.mem_mb + eps
            and self.gpu <= free.gpu + eps
            and self.gpu_mem_mb <= free.gpu_mem_mb + eps
        )

    def as_dict(self) -> dict[str, float]:
        """The four amounts by name (for listings and figures)."""
        return {"cpu": self.cpu, "mem_mb": self.mem_mb, "gpu": self.gpu, "gpu_mem_mb": self.gpu_mem_mb}


def Demand(cpu: float = 1.0, mem_mb: float = 256, gpu: float = 0.0, gpu_mem_mb: float = 0) -> Resources:
    """What one unit of parallelism of an action needs (a :class:`Resources` with a tool's defaults)."""
    return Resources(cpu, mem_mb, gpu, gpu_mem_mb)


class Elastic(_Model):
    """How many units of parallelism an action can use at once; ``1..1`` is rigid."""

    min_par: int = Field(1, ge=1)
    max_par: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> Elastic:
        if self.max_par < self.min_par:
            raise ValueError(f"max_par ({self.max_par}) < min_par ({self.min_par})")
        return self


def new_id() -> str:
    """A fresh action id (clients may choose their own; ids are idempotency keys)."""
    return os.urandom(16).hex()  # 128 random bits, as uuid4 has, without building a UUID object


class Action(_Model):
    """One self-contained piece of external work, the unit of scheduling."""

    id: str = Field(default_factory=new_id, min_length=1, max_length=128)
    kind: str = Field(min_length=1, max_length=128, description="registered tool or reward model name")
    payload: dict[str, Any] = Field(default_factory=dict)
    trajectory_id: str = ""
    env_id: str = ""
    demand: Resources | None = Field(None, description="per unit of parallelism; None: the kind's")
    elastic: Elastic | None = Field(None, description="None: the kind's registered elasticity")
    affinity: str | None = Field(None, description="sandbox session the action must run in")
    image: str | None = Field(
        None, min_length=1, description="sandbox image it needs; None: the kind's image"
    )
    timeout_s: float | None = Field(None, gt=0, description="None: the kind's registered timeout")
    deadline_s: float | None = Field(
        None, gt=0, description="from submission to result, queueing and set-up included; past it: 'deadline'"
    )
    priority: int = 0


#: The largest duration a Timing field accepts (seconds).
MAX_TIMING_S = 365 * 24 * 3600.0


class Timing(_Model):
    """Where an action's completion time went, in seconds (ACT = queued + setup + run)."""

    # Bounded: the timings a worker reports feed the duration estimator, and one absurd value must be
    # refused at the wire, not overflow a fit on the orchestrator's loop (a year is past any timeout).
    queued_s: float = Field(0.0, ge=0, le=MAX_TIMING_S)
    setup_s: float = Field(0.0, ge=0, le=MAX_TIMING_S)
    run_s: float = Field(0.0, ge=0, le=MAX_TIMING_S)

    @property
    def act_s(self) -> float:
        """Action completion time as the orchestrator measured it."""
        return self.queued_s + self.setup_s + self.run_s


# "throttled": the API an action calls answered 429; the orchestrator requeues it (clients do not see it
# while the API has a quota configured).
ErrorType = Literal[
    "error", "timeout", "deadline", "rejected", "cancelled", "sandbox_died", "model_error", "throttled"
]


class Result(_Model):
    """The outcome of one action: a value, or an error described as data."""

    action_id: str
    ok: bool
    value: Any = None
    error_type: ErrorType | None = None
    message: str = ""
    traceback: str = ""
    timing: Timing = Field(default_factory=Timing)
    parallelism: int = 1
    worker: str = ""

    def unwrap(self) -> Any:
        """The value, or the typed exception of :data:`tangram_env.errors.ERROR_TYPES` for a failure."""
        if self.ok:
            return self.value
        from tangram_env.errors import ERROR_TYPES, ActionError

        cls = ERROR_TYPES.get(self.error_type or "error", ActionError)
        raise cls(
            self.message or "action failed",
            action_id=self.action_id,
            error_type=self.error_type or "error",
            remote_traceback=self.traceback,
        )

    @classmethod
    def failure(cls, action_id: str, error_type: ErrorType, message: str, **fields: Any) -> Result:
        """A failed result (an error described as data)."""
        return cls(action_id=action_id, ok=False, error_type=error_type, message=message, **fields)


# --- messages -------------------------------------------------------------------------------------
#: The most actions one Submit carries, and ids one message lists: every message is decoded and
#: validated on the orchestrator's loop at once, so its size bounds how long one peer holds the loop.
MAX_ACTIONS_PER_SUBMIT = 4096
MAX_IDS_PER_MESSAGE = 16_384


def id_batches(ids: Sequence[str]) -> list[list[str]]:
    """``ids`` in lists of at most :data:`MAX_IDS_PER_MESSAGE`."""
    return [list(ids[i : i + MAX_IDS_PER_MESSAGE]) for i in range(0, len(ids), MAX_IDS_PER_MESSAGE)]


class Submit(_Model):
    """Client -> orchestrator: run these actions (a resubmitted id never runs twice)."""

    kind: Literal["submit"] = "submit"
    actions: list[Action] = Field(min_length=1, max_length=MAX_ACTIONS_PER_SUBMIT)
    acks: list[str] = Field(
        default_factory=list,
        max_length=MAX_IDS_PER_MESSAGE,
        description="result ids received (saves an Ack message)",
    )
    server_id: str = Field(
        "",
        max_length=64,
        description="the orchestrator the client last heard from ('': none yet); another one has restarted "
        "since, and the sandboxes of the client's sessions ended with it",
    )


class Results(_Model):
    """Orchestrator -> client: finished actions, in completion order."""

    kind: Literal["results"] = "results"
    results: list[Result]


class Ack(_Model):
    """Client -> orchestrator: these results arrived; the orchestrator may forget them."""

    kind: Literal["ack"] = "ack"
    action_ids: list[str] = Field(max_length=MAX_IDS_PER_MESSAGE)


class Cancel(_Model):
    """Client -> orchestrator: cancel these actions if they have not started."""

    kind: Literal["cancel"] = "cancel"
    action_ids: list[str] = Field(max_length=MAX_IDS_PER_MESSAGE)


class CloseSessions(_Model):
    """Client -> orchestrator, and orchestrator -> the worker that holds them: these sandbox sessions
    are over (reset their sandboxes, pool them).
    """

    kind: Literal["close_sessions"] = "close_sessions"
    session_ids: list[str] = Field(max_length=MAX_IDS_PER_MESSAGE)
    trajectory_ids: list[str] = Field(
        default_factory=list,
        max_length=MAX_IDS_PER_MESSAGE,
        description="trajectories that ended (whatever a policy bound to them is freed)",
    )


class Heartbeat(_Model):
    """Either direction: I am alive. The orchestrator answers a client's heartbeat with its own.

    A client's says how many messages it sent before it (``sent``); the answer echoes that and says
    how many the orchestrator heard from the client, this one included (``heard``), and sent it before
    the answer (``answered``). A connection that broke and came back (ZeroMQ reconnects on its own)
    may have lost messages either way; the counts show it, and the client resubmits what it waits for.
    """

    kind: Literal["heartbeat"] = "heartbeat"
    server_id: str = ""
    sent: int | None = Field(None, ge=0, description="a client's: messages it sent before this one")
    heard: int | None = Field(None, ge=0, description="the answer's: messages heard from the client")
    answered: int | None = Field(None, ge=0, description="the answer's: messages sent to the client")
    figures: dict[str, Any] | None = Field(None, description="a worker's runner figures, every few beats")
    max_body: int | None = Field(
        None, gt=0, description="the orchestrator's message limit, told a worker that registers: it adopts it"
    )


class Register(_Model):
    """Worker -> orchestrator: my capacity and the kinds I can run."""

    kind: Literal["register"] = "register"
    worker_id: str
    capacity: Resources
    kinds: list[str] = Field(default_factory=list)
    token: str = Field("", max_length=256, description="the orchestrator's worker token, where it asks one")


class Grant(_Model):
    """One scheduled action as the orchestrator hands it to a worker: what to run, on what."""

    action: Action
    parallelism: int = Field(1, ge=1)
    cores: list[int] = Field(default_factory=list, description="CPU ids on the worker; empty: any")
    timeout_s: float = Field(gt=0, description="resolved execution limit")
    queued_s: float = Field(0.0, ge=0, description="time it waited in the orchestrator's queue")
    api_key: str | None = Field(
        None, max_length=128, description="name of the API key it must use (the worker holds the secret)"
    )
    # The payload as validated at admission, when the grant stays in the process that admitted it
    # (never on the wire: a remote worker validates what it receives once, on arrival).
    _args: Any = PrivateAttr(None)

    @property
    def args(self) -> Any:
        """The validated payload carried from admission (None: validate ``action.payload`` here)."""
        return self._args

    def carrying(self, args: Any) -> Grant:
        """The grant, carrying ``args`` (the payload already validated) to an in-process runner."""
        self._args = args
        return self


class Dispatch(_Model):
    """Orchestrator -> worker: start these granted actions; the worker answers with ``Results``."""

    kind: Literal["dispatch"] = "dispatch"
    grants: list[Grant] = Field(min_length=1)


class Error(_Model):
    """Orchestrator -> peer: the message you sent could not be used, and why."""

    kind: Literal["error"] = "error"
    code: str
    message: str
    action_ids: list[str] = Field(default_factory=list)


class Stats(_Model):
    """Client -> orchestrator asks (empty ``figures``); the orchestrator answers with its figures."""

    kind: Literal["stats"] = "stats"
    figures: dict[str, Any] = Field(default_factory=dict)


class ListKinds(_Model):
    """Client -> orchestrator asks which kinds it serves; the reply fills ``kinds`` (name -> spec)."""

    kind: Literal["list_kinds"] = "list_kinds"
    kinds: dict[str, dict[str, Any]] = Field(default_factory=dict)


#: Message type name (the ``type`` frame) -> its model.
MESSAGE_TYPES: dict[str, type[_Model]] = {
    model.model_fields["kind"].default: model
    for model in (
        Submit,
        Results,
        Ack,
        Cancel,
        CloseSessions,
        Heartbeat,
        Register,
        Dispatch,
        Error,
        Stats,
        ListKinds,
    )
}
