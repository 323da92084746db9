"""What the orchestrator's core (:class:`~.lifecycle.Lifecycle`) asks its shell to do: plain data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tangram_env.kinds import KindSpec
from tangram_env.protocol import Action, Grant, Result


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``message`` to the peer whose ROUTER identity is ``peer``."""

    peer: bytes
    message: BaseModel


@dataclass(frozen=True, slots=True)
class Run:
    """Start ``grant`` on the in-process runner called ``worker_id`` (remote workers get a ``Send``)."""

    worker_id: str
    grant: Grant


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop these actions on the in-process runner ``worker_id``: their owner cancelled them while they
    ran (remote workers get a ``Send`` of ``Cancel``). Each ends with a ``cancelled`` result.
    """

    worker_id: str
    action_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RunInline:
    """Call an inline kind now, on the loop; its result comes back through :meth:`Lifecycle.finished`."""

    spec: KindSpec
    action: Action
    args: Any
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Persist:
    """Call ``StateStore.<op>(*args)`` (only emitted when the core is ``persistent``)."""

    op: str
    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Observe:
    """An action finished: count it in the exporter (only emitted when the core is ``observed``)."""

    kind: str
    result: Result


@dataclass(frozen=True, slots=True)
class EndSessions:
    """These sandbox sessions are over: reset or close their sandboxes (slow: off the loop)."""

    sessions: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class KeepWarm:
    """Keep up to ``size`` warm sandboxes of ``image``, once the ``expire`` longest idle are destroyed
    (the scheduler's ``ScalePool``).
    """

    image: str
    size: int
    expire: int = 0


@dataclass(frozen=True, slots=True)
class SendFigures:
    """Answer a ``Stats`` request: the shell adds its runners' and exporter's figures to the core's."""

    peer: bytes


Effect = Send | Run | Stop | RunInline | Persist | Observe | EndSessions | KeepWarm | SendFigures
