"""Action-level FCFS: one shared pool, arrival order, no elasticity (a baseline for the benchmarks).

It is the elastic scheduler's machinery with the policy taken out: actions keep their arrival order
within each placement class (the head of a class blocks the rest of it; classes that need other
resources go on), every action runs at ``min_par`` units, and warm state is ignored.
"""

from __future__ import annotations

from typing import Any

from tangram_env.server.scheduler.caps import CapsConfig
from tangram_env.server.scheduler.core import ActionLevelScheduler
from tangram_env.server.scheduler.policy import PolicyConfig

#: The policy knobs that make the action-level machinery FCFS (no warm pools either: every session
#: creates its sandbox, as without Tangram's resource managers).
FCFS_POLICY: dict[str, Any] = {
    "ordering": "arrival",
    "elastic": False,
    "warm_aware": False,
    "caps": CapsConfig(warm_pool=False),
}


class FCFSScheduler(ActionLevelScheduler):
    """Starts queued actions oldest first wherever they fit, each with ``min_par`` units."""

    name = "fcfs"

    def __init__(self, config: PolicyConfig | None = None, **overrides: Any) -> None:
        super().__init__(config, **{**FCFS_POLICY, **overrides})
