"""The elastic policy (the default): expected-completion order with ageing, elastic sizing, warm-aware."""

from __future__ import annotations

from typing import Any

from tangram_env.server.scheduler.core import ActionLevelScheduler
from tangram_env.server.scheduler.policy import PolicyConfig


class ElasticScheduler(ActionLevelScheduler):
    """Tangram's scheduler: shortest expected completion first, aged so that nothing starves.

    It packs actions across resource types, gives spare units to the actions whose estimated run time
    falls most per unit, counts warm state in placement, and enforces sandbox caps and warm pools
    across the whole pool.

    Options are :class:`~.policy.PolicyConfig` fields (``ElasticScheduler(age_rate=0.5)``).
    """

    name = "elastic"

    def __init__(self, config: PolicyConfig | None = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)
