"""The knobs of the action-level schedulers, resolved once and passed down (every default described)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tangram_env.server.scheduler.caps import CapsConfig
from tangram_env.server.scheduler.estimator import EstimatorConfig
from tangram_env.server.scheduler.quotas import QuotaConfig


class PolicyConfig(BaseModel):
    """How an action-level scheduler orders, places and sizes actions.

    The defaults are the elastic policy; FCFS and task-isolated pools are the same machinery with
    ``ordering="arrival"``, ``elastic=False`` and ``warm_aware=False``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    ordering: Literal["expected_completion", "arrival"] = Field(
        "expected_completion",
        description="expected_completion: lowest (estimated run time + age_rate x arrival) first; "
        "arrival: oldest first",
    )
    age_rate: float = Field(
        3.0,
        gt=0,
        description="seconds of estimated run time a waiting action makes up per second it waits; "
        "1.0 orders by expected completion, larger is closer to FCFS, smaller to shortest-first",
    )
    order_cap_s: float = Field(
        10.0,
        gt=0,
        description="estimated run times above this order as this much: a long action is overtaken only "
        "by actions arriving within order_cap_s / age_rate after it (it keeps its place among other long "
        "ones), which bounds how far shortest-first stretches the tail; inf: no bound",
    )
    wait_aware_order: bool = Field(
        True,
        description="a CPU action's estimated run time counts in its key with the weight min(1, run / "
        "wait) of recent CPU actions (decayed over load_window_s): where actions wait longer than they "
        "run the pool is saturated, putting short ones first no longer lowers the mean but still "
        "stretches the tail, and the order tends to arrival order; False: weight 1",
    )
    priority_s: float = Field(
        10.0, ge=0, description="seconds of head start per unit of an action's priority"
    )
    elastic: bool = Field(
        True, description="give spare units to elastic actions (else every action gets min_par)"
    )
    min_rel_gain: float = Field(
        0.05,
        ge=0,
        description="add a unit only while it cuts the action's estimated run time by this fraction",
    )
    explore: int = Field(
        8,
        ge=0,
        description="completions above one unit after which a kind's own speed-up replaces the prior's",
    )
    cpu_headroom: float = Field(
        0.125,
        ge=0,
        le=1,
        description="fraction of a worker's cores that elastic growth leaves free for arrivals",
    )
    gpu_headroom: float = Field(0.0, ge=0, le=1, description="the same for GPU units")
    load_headroom: float = Field(
        1.0,
        ge=0,
        description="elastic growth leaves free, across the pool, this many times the demand that "
        "arrivals keep busy on average (recent arrivals x their estimated run time at min_par): units "
        "the queue is expected to need are not lent to a running action; 0 disables",
    )
    queue_cost: float = Field(
        1.0,
        ge=0,
        description="a unit lends for growth only if it cuts the action's run time by more than this x the "
        "resource's busy fraction (arrivals' average demand / capacity) x the time the unit is held: "
        "what the queue is expected to lose meanwhile; 0 disables",
    )
    load_window_s: float = Field(
        60.0, gt=0, description="time constant of that average (seconds): how fast it follows a burst"
    )
    warm_aware: bool = Field(
        True, description="prefer workers with warm state (a loaded model); wait for one when that is cheaper"
    )
    warm_min_setup_s: float = Field(
        0.5, ge=0, description="kinds whose estimated cold set-up is at least this are placed warm-aware"
    )
    warm_kinds_per_worker: int = Field(2, ge=0, description="kinds remembered as warm on each worker (LRU)")
    batch_max: int = Field(
        8,
        ge=1,
        description="GPU actions of one class (one model, same demand) that cannot start on units of "
        "their own join a batch of it started in the same call, up to this many per batch, as a GPU "
        "worker runs them; a batch is slower than a lone request, so more buys throughput with every "
        "member's latency; 1 disables",
    )
    reserve_after_s: float = Field(
        30.0,
        ge=0,
        description="a blocked action that has waited this long reserves a worker until it fits "
        "(no other new placement may take it meanwhile; actions of sandbox sessions living there still "
        "run, since their sandboxes' memory frees only when they end); inf disables",
    )
    await_capacity_s: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="how long an action that no worker present could ever fit waits for capacity that "
        "fits it to join before it is rejected (0: at once); a backend that grows the pool (Ray, whose "
        "nodes register their workers after the orchestrator starts, and whose autoscaler adds nodes "
        "for what the queue lacks) sets it",
    )
    probe: int = Field(16, ge=1, description="candidate workers checked per pool and query")
    nbuckets: int = Field(64, ge=1, le=4096, description="free-capacity buckets per pool in the fit index")
    story_per_action: int = Field(32, ge=1, description="transitions kept per action in story()")
    story_actions: int = Field(10_000, ge=1, description="actions whose story is kept")
    estimator: EstimatorConfig = Field(default_factory=EstimatorConfig)
    caps: CapsConfig = Field(default_factory=CapsConfig)
    api_quotas: QuotaConfig = Field(default_factory=QuotaConfig)
