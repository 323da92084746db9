"""Schedulers: pure state machines behind one interface (:class:`~.events.Scheduler`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tangram_env.server.scheduler.events import Scheduler
from tangram_env.server.scheduler.fcfs import FCFSScheduler

#: Policy name -> factory. ``--scheduler NAME`` on the server picks one.
SCHEDULERS: dict[str, Callable[..., Scheduler]] = {
    "fcfs": FCFSScheduler,
}

DEFAULT_SCHEDULER = "fcfs"


def make_scheduler(name: str = DEFAULT_SCHEDULER, **options: Any) -> Scheduler:
    """A new scheduler of policy ``name``."""
    try:
        factory = SCHEDULERS[name]
    except KeyError:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {sorted(SCHEDULERS)}") from None
    return factory(**options)
