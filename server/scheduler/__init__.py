"""Schedulers: pure state machines behind one interface (:class:`~.events.Scheduler`).

``elastic`` is Tangram's policy and the default; ``fcfs``, ``task_isolated`` and ``trajectory_bound``
are the baselines the benchmarks compare it with (``python -m benchmarks.act``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tangram_env.server.scheduler.core import ActionLevelScheduler
from tangram_env.server.scheduler.elastic import ElasticScheduler
from tangram_env.server.scheduler.events import Scheduler
from tangram_env.server.scheduler.fcfs import FCFSScheduler
from tangram_env.server.scheduler.policy import PolicyConfig
from tangram_env.server.scheduler.task_isolated import TaskIsolatedScheduler
from tangram_env.server.scheduler.trajectory_bound import TrajectoryBoundScheduler

#: Policy name -> factory. ``--scheduler NAME`` on the server picks one.
SCHEDULERS: dict[str, Callable[..., Scheduler]] = {
    "elastic": ElasticScheduler,
    "fcfs": FCFSScheduler,
    "task_isolated": TaskIsolatedScheduler,
    "trajectory_bound": TrajectoryBoundScheduler,
}

DEFAULT_SCHEDULER = "elastic"


def make_scheduler(name: str = DEFAULT_SCHEDULER, **options: Any) -> Scheduler:
    """Build a new scheduler of policy ``name`` (``options`` go to its constructor)."""
    try:
        factory = SCHEDULERS[name]
    except KeyError:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {sorted(SCHEDULERS)}") from None
    return factory(**options)


__all__ = [
    "DEFAULT_SCHEDULER",
    "SCHEDULERS",
    "ActionLevelScheduler",
    "ElasticScheduler",
    "FCFSScheduler",
    "PolicyConfig",
    "TaskIsolatedScheduler",
    "TrajectoryBoundScheduler",
    "make_scheduler",
]
