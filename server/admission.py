"""An action as it enters the orchestrator: resolved once (its kind's defaults applied), and seen by
the scheduler as an :class:`~.scheduler.events.ActionArrived`.
"""

from __future__ import annotations

from tangram_env.kinds import KindSpec
from tangram_env.protocol import Action, Resources
from tangram_env.server.scheduler.events import ActionArrived


def resolve(spec: KindSpec, action: Action) -> Action:
    """``action`` with its kind's defaults filled in: the one place they are applied.

    In place: the action was just decoded (or loaded) and belongs to the orchestrator, and the values
    come from the kind's spec, already validated; a copy per action would cost more than the rest.
    """
    fields = action.__dict__
    asked, floor = fields["demand"], spec.demand
    if asked is None:
        fields["demand"] = floor
    elif (
        asked.cpu < floor.cpu
        or asked.mem_mb < floor.mem_mb
        or asked.gpu < floor.gpu
        or asked.gpu_mem_mb < floor.gpu_mem_mb
    ):
        # A client may ask for more than its kind declares, never less: a demand of no cores would
        # let its commands run beside everything else, whatever the pool holds.
        fields["demand"] = Resources(
            max(asked.cpu, floor.cpu),
            max(asked.mem_mb, floor.mem_mb),
            max(asked.gpu, floor.gpu),
            max(asked.gpu_mem_mb, floor.gpu_mem_mb),
        )
    if fields["elastic"] is None:
        fields["elastic"] = spec.elastic
    if fields["image"] is None:
        fields["image"] = spec.image or ("default" if spec.placement == "sandbox" else None)
    if fields["timeout_s"] is None:
        fields["timeout_s"] = spec.timeout_s
    return action


def arrival(
    action: Action, api: str | None = None, sandbox_mem_mb: float = 0.0, provider: str | None = None
) -> ActionArrived:
    """The scheduler's view of a resolved action (``api``: the quota its kind draws on, if any;
    ``sandbox_mem_mb``: the memory its session's sandbox holds from its first action to its close;
    ``provider``: the sandbox provider that would create its sandbox, for the creation-rate caps).
    """
    elastic = action.elastic
    assert action.demand is not None and elastic is not None, "resolve() the action first"
    return ActionArrived(
        action_id=action.id,
        kind=action.kind,
        demand=action.demand,
        min_par=elastic.min_par,
        max_par=elastic.max_par,
        trajectory_id=action.trajectory_id,
        env_id=action.env_id,
        affinity=action.affinity,
        image=action.image,
        priority=action.priority,
        api=api,
        sandbox_mem_mb=sandbox_mem_mb if action.affinity is not None else 0.0,
        provider=provider if action.image is not None else None,
    )
