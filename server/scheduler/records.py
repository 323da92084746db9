"""The scheduler's records: one per action, and one per class of interchangeable pending actions."""

from __future__ import annotations

import math
from typing import Any

from tangram_env.server.scheduler.events import ActionArrived
from tangram_env.server.scheduler.ledger import Pool, Vec, Worker, vec_of
from tangram_env.server.scheduler.story import ActionState


class Act:
    """One action in the scheduler's books, from arrival to completion."""

    __slots__ = (
        "api_key",
        "arrived",
        "cls",
        "cold",
        "devices",
        "ev",
        "expect_end",
        "home",
        "id",
        "k",
        "key",
        "leader",
        "open_mb",
        "opens",
        "sandbox",
        "seq",
        "session",
        "state",
        "vec",
        "worker",
    )

    def __init__(self, ev: ActionArrived, now: float) -> None:
        self.ev = ev
        self.id = ev.action_id
        self.vec: Vec = vec_of(ev.demand)
        self.session = ev.affinity
        self.open_mb = ev.sandbox_mem_mb if ev.affinity is not None else 0.0  # held if it opens its session
        self.opens: str | None = None  # the image of the sandbox it opened its session in
        self.arrived = now
        self.key = 0.0
        self.seq = -1
        self.state = ActionState.NEW
        self.cls: Klass | None = None  # the class heap it waits in (None: a worker's session heap)
        self.home: Worker | None = None  # the worker whose session heap it waits in
        self.worker: Worker | None = None
        self.k = 0
        self.cold = False
        self.expect_end = 0.0
        self.api_key: str | None = None  # the API key its grant holds (a token taken, a slot held)
        self.leader: Act | None = None  # the action whose batch it runs in (it holds nothing itself)
        self.devices: tuple[int, ...] = ()  # the GPU devices of its worker it was lent
        self.sandbox: str | None = None  # the image of the sandbox it runs in without a session


def opening_vec(act: Act) -> Vec:
    """Per unit at ``min_par``, what ``act`` needs to start if it opens its session (sandbox memory too)."""
    v = act.vec
    if not act.open_mb:
        return v
    return (v[0], v[1] + act.open_mb / act.ev.min_par, v[2], v[3])


class Klass:
    """Pending actions that are interchangeable for placement (same demand, kind, elasticity, image)."""

    __slots__ = (
        "blocked",
        "blocked_version",
        "heap",
        "image",
        "key",
        "kind",
        "live",
        "max_par",
        "min_par",
        "new_session",
        "pools",
        "pools_version",
        "provider",
        "reserved",
        "vec",
        "worst",
    )

    def __init__(self, key: tuple[Any, ...], act: Act) -> None:
        ev = act.ev
        self.key = key
        self.kind = ev.kinds_needed or ev.kind
        self.min_par, self.max_par = ev.min_par, ev.max_par
        self.image, self.provider = ev.image, ev.provider
        self.new_session = act.session is not None
        self.vec = opening_vec(act)
        # Elastic actions and new sessions go where most is free (room to grow, sessions spread out);
        # rigid ones pack into the least free worker that fits.
        self.worst = self.max_par > self.min_par or self.new_session
        self.heap: list[tuple[float, int, Act]] = []
        self.live = 0
        self.pools: list[Pool] = []
        self.pools_version = -1
        self.reserved: str | None = None
        self.blocked = False  # its head fitted nowhere (retried when capacity it could use frees)
        self.blocked_version = -1


class DecayedMean:
    """A mean whose samples weigh less the older they are (time constant ``tau_s`` seconds)."""

    __slots__ = ("_at", "_n", "_sum", "_tau")

    def __init__(self, tau_s: float) -> None:
        self._tau = tau_s
        self._sum = self._n = self._at = 0.0

    def add(self, x: float, now: float) -> None:
        """Add sample ``x`` taken at ``now``."""
        if now > self._at:
            decay = math.exp(-(now - self._at) / self._tau)
            self._sum *= decay
            self._n *= decay
            self._at = now
        self._sum += x
        self._n += 1.0

    def mean(self) -> float:
        """The weighted mean (0 before any sample); decay since the last sample cancels out of it."""
        return self._sum / self._n if self._n > 0.0 else 0.0
