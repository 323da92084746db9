"""The pure parts: cutting batches from a queue, and the placement policies' decisions (no threads)."""

from __future__ import annotations

from typing import Any

import pytest

from tangram_env.kinds import KindRegistry, reward_model
from tangram_env.server.gpu.batching import Job, ModelQueue, split_job
from tangram_env.server.gpu.devices import host_slot, make_slots
from tangram_env.server.gpu.models import ModelEntry, Replica
from tangram_env.server.gpu.policy import (
    Load,
    LruReplicaPolicy,
    Retire,
    RunBatch,
    StaticPolicy,
    Unplaceable,
    Wait,
)


def job(n: int, parallelism: int = 1, action_id: str = "a") -> Job:
    return Job(action_id, "m", n, parallelism, submitted=0.0, deadline=1e9)


def queue_with(*jobs_items: tuple[Job, list[Any]], now: float = 0.0) -> ModelQueue:
    q = ModelQueue()
    for j, items in jobs_items:
        q.push(split_job(j, items, now))
    return q


# --- batching ---------------------------------------------------------------------------------------
def test_split_job_makes_parallelism_contiguous_shares():
    shares = split_job(job(10, parallelism=3), list(range(10)), 0.0)
    assert [(s.start, s.items) for s in shares] == [(0, [0, 1, 2, 3]), (4, [4, 5, 6, 7]), (8, [8, 9])]
    assert len(split_job(job(2, parallelism=5), [1, 2], 0.0)) == 2  # never an empty share
    assert split_job(job(0), [], 0.0) == []


def test_take_batch_fills_up_to_max_batch_in_arrival_order_and_splits_the_last_share():
    a, b, c = job(3, action_id="a"), job(4, action_id="b"), job(2, action_id="c")
    q = queue_with((a, [1, 2, 3]), (b, [4, 5, 6, 7]), (c, [8, 9]))
    pieces = q.take_batch(5)
    assert [(p.job.action_id, p.start, p.items) for p in pieces] == [("a", 0, [1, 2, 3]), ("b", 0, [4, 5])]
    assert a.in_flight == b.in_flight == 1
    assert q.takeable_items() == 2  # b's rest waits for b's batch in flight (parallelism 1); c is free
    b.in_flight = 0
    rest = q.take_batch(5)
    assert [(p.job.action_id, p.start, p.items) for p in rest] == [("b", 2, [6, 7]), ("c", 0, [8, 9])]


def test_take_batch_takes_one_share_per_job_so_shares_can_go_to_other_replicas():
    j = job(8, parallelism=2)
    q = queue_with((j, list(range(8))))
    first = q.take_batch(32)
    assert [p.items for p in first] == [[0, 1, 2, 3]]
    second = q.take_batch(32)  # in flight 1 < parallelism 2: the other share can run elsewhere now
    assert [p.items for p in second] == [[4, 5, 6, 7]]
    assert q.take_batch(32) == [] and j.in_flight == 2


def test_jobs_that_are_over_are_dropped_from_the_queue():
    a, b = job(1, action_id="a"), job(1, action_id="b")
    q = queue_with((a, [1]), (b, [2]))
    a.finish_error("timeout", "late", 1.0, "w")
    assert q.oldest() == 0.0 and q.queued_items() == 1
    assert [p.job.action_id for p in q.take_batch(4)] == ["b"]


# --- placement ----------------------------------------------------------------------------------------
@pytest.fixture
def models() -> dict[str, ModelEntry]:
    reg = KindRegistry()
    for name in "abc":
        reward_model(name=name, gpu=0.5, gpu_mem_mb=100, max_batch=4, max_wait_ms=10, registry=reg)(
            lambda items: [0.0] * len(items)
        )
    return {s.name: ModelEntry(s) for s in reg}


def loaded(model: ModelEntry, slot: int, last_used: float = 0.0, busy: bool = False) -> Replica:
    replica = Replica(model.name, slot, model.memory_mb, state="ready", last_used=last_used, busy=busy)
    model.replicas[slot] = replica
    return replica


def enqueue(model: ModelEntry, n: int, at: float, action_id: str = "x") -> Job:
    j = Job(action_id, model.name, n, 1, submitted=at, deadline=1e9)
    model.queue.push(split_job(j, list(range(n)), at))
    return j


def test_a_loaded_model_runs_when_its_batch_is_full_or_has_waited_max_wait(models):
    slots = make_slots(["cpu"], 1000)
    policy = LruReplicaPolicy()
    loaded(models["a"], 0)
    enqueue(models["a"], 2, at=10.0)
    assert policy.next_step(slots[0], slots, models, now=10.001) == Wait(10.0 + 0.010)
    assert policy.next_step(slots[0], slots, models, now=10.011) == RunBatch("a")
    loaded(models["c"], 0)
    enqueue(models["c"], 4, at=10.005, action_id="full")
    assert policy.next_step(slots[0], slots, models, now=10.006) == RunBatch("c")  # full: no waiting


def test_oldest_request_first_across_models_with_load_time_counted(models):
    slots = make_slots(["cpu"], 1000)
    policy = LruReplicaPolicy()
    loaded(models["a"], 0)
    enqueue(models["a"], 1, at=5.0)
    models["b"].load_s_est = 2.0
    enqueue(models["b"], 1, at=4.0)  # older, but 4.0 + 2.0 of loading > 5.0
    assert policy.next_step(slots[0], slots, models, now=6.0) == RunBatch("a")
    models["b"].load_s_est = 0.5
    assert policy.next_step(slots[0], slots, models, now=6.0) == Load("b")


def test_loads_evict_idle_models_least_recently_used_first(models):
    slots = make_slots(["cpu"], 250)
    policy = LruReplicaPolicy()
    loaded(models["a"], 0, last_used=2.0)
    loaded(models["b"], 0, last_used=1.0)
    enqueue(models["c"], 1, at=3.0)
    assert policy.next_step(slots[0], slots, models, now=4.0) == Load("c", evict=("b",))
    enqueue(models["b"], 1, at=3.5)  # b has work waiting: a goes instead, though used more recently
    models["b"].replicas[0].busy = True
    assert policy.next_step(slots[0], slots, models, now=4.0) == Load("c", evict=("a",))


def test_busy_models_are_never_evicted(models):
    slots = make_slots(["cpu"], 200)
    loaded(models["a"], 0, busy=True)
    loaded(models["b"], 0, busy=True)
    enqueue(models["c"], 1, at=0.0)
    assert LruReplicaPolicy().next_step(slots[0], slots, models, now=1.0) == Wait(None)


def test_a_model_that_fits_nowhere_is_unplaceable(models):
    slots = make_slots(["cpu", "cpu"], 50)
    enqueue(models["a"], 1, at=0.0)
    step = LruReplicaPolicy().next_step(slots[0], slots, models, now=1.0)
    assert isinstance(step, Unplaceable) and "needs 100 MiB" in step.reason


def test_a_new_model_goes_to_a_free_device_with_room_rather_than_evicting(models):
    slots = make_slots(["cpu", "cpu"], 150)
    policy = LruReplicaPolicy()
    loaded(models["a"], 0)
    enqueue(models["b"], 1, at=0.0)
    assert policy.next_step(slots[0], slots, models, now=1.0) == Wait(None)  # device 1 has room
    assert policy.next_step(slots[1], slots, models, now=1.0) == Load("b")
    slots[1].busy = True  # busy for now, but it has room: it takes b when it is free
    assert policy.next_step(slots[0], slots, models, now=1.0) == Wait(None)
    loaded(models["c"], 1)  # now neither has room: device 0 evicts
    slots[1].busy = False
    assert policy.next_step(slots[0], slots, models, now=1.0) == Load("b", evict=("a",))


def test_a_new_model_goes_to_the_least_pressed_device(models):
    slots = make_slots(["cpu", "cpu"], 1000)
    policy = LruReplicaPolicy()
    loaded(models["a"], 0)
    loaded(models["b"], 1)
    models["a"].observe_arrival(500, now=0.0)  # a is asked for far more than b
    models["b"].observe_arrival(20, now=0.0)
    enqueue(models["c"], 1, at=0.5)
    assert policy.next_step(slots[0], slots, models, now=1.0) == Wait(None)
    assert policy.next_step(slots[1], slots, models, now=1.0) == Load("c")


def test_a_replica_is_added_only_when_the_backlog_outlasts_a_load(models):
    slots = make_slots(["cpu", "cpu"], 1000)
    policy = LruReplicaPolicy()
    a = models["a"]
    loaded(a, 0, busy=True)
    a.batch_s_est, a.load_s_est = 0.1, 1.0
    enqueue(a, 60, at=0.0)  # 15 batches of 0.1s on one replica: less than 2 loads of 1s
    assert policy.next_step(slots[1], slots, models, now=1.0) == Wait(None)
    enqueue(a, 40, at=0.5, action_id="y")  # 25 batches: 2.5s > 2 x 1s
    assert policy.next_step(slots[1], slots, models, now=1.0) == Load("a")
    assert LruReplicaPolicy(replica_gain=3).next_step(slots[1], slots, models, now=1.0) == Wait(None)
    a.replicas[0].busy = False  # an idle replica will take the work instead
    assert policy.next_step(slots[1], slots, models, now=1.0) == Wait(None)
    assert LruReplicaPolicy(max_replicas=1).next_step(slots[1], slots, models, now=1.0) == Wait(None)


def test_a_device_with_its_own_work_does_not_load_a_replica(models):
    slots = make_slots(["cpu", "cpu"], 1000)
    a, b = models["a"], models["b"]
    loaded(a, 0, busy=True)
    a.batch_s_est, a.load_s_est = 1.0, 0.1
    enqueue(a, 40, at=0.0)  # a long backlog of a...
    loaded(b, 1)
    enqueue(b, 1, at=5.0)  # ...but device 1 has b's (younger) request to serve first
    policy = LruReplicaPolicy()
    assert policy.next_step(slots[1], slots, models, now=4.0 + 1.0) == Wait(5.0 + b.max_wait_s)
    assert policy.next_step(slots[1], slots, models, now=5.5) == RunBatch("b")
    b.queue.take_batch(4)
    assert policy.next_step(slots[1], slots, models, now=5.5) == Load("a")


def test_a_device_much_less_busy_than_a_models_devices_gets_a_replica(models):
    slots = make_slots(["cpu", "cpu"], 1000)
    a = models["a"]
    loaded(a, 0)
    enqueue(a, 1, at=9.99)  # a short queue: the backlog rule alone would not add a replica
    slots[0].set_busy(True, 0.0)  # device 0 busy for the last 10 s, device 1 idle
    policy = LruReplicaPolicy()
    assert slots[0].utilization(10.0) > 0.9 and slots[1].utilization(10.0) == 0.0
    assert policy.next_step(slots[1], slots, models, now=10.0) == Load("a")
    slots[1].set_busy(True, 0.0)  # both busy: nothing to gain
    slots[1].set_busy(False, 10.0)
    assert policy.next_step(slots[1], slots, models, now=10.0) == Wait(None)


def test_idle_extra_replicas_retire_after_retire_idle_s(models):
    slots = make_slots(["cpu", "cpu"], 1000)
    policy = LruReplicaPolicy(retire_idle_s=5.0)
    loaded(models["a"], 0, last_used=1.0)
    loaded(models["a"], 1, last_used=2.0)
    assert policy.next_step(slots[1], slots, models, now=3.0) == Wait(7.0)
    assert policy.next_step(slots[1], slots, models, now=7.5) == Retire("a")
    del models["a"].replicas[1]
    assert policy.next_step(slots[0], slots, models, now=100.0) == Wait(None)  # the last one stays


def test_static_policy_loads_only_on_the_home_device(models):
    slots = make_slots(["cpu", "cpu"], 1000)
    policy = StaticPolicy({"a": 1})
    enqueue(models["a"], 1, at=0.0)
    assert policy.next_step(slots[0], slots, models, now=1.0) == Wait(None)
    assert policy.next_step(slots[1], slots, models, now=1.0) == Load("a")
    enqueue(models["b"], 1, at=0.0)
    enqueue(models["c"], 1, at=0.0)
    assert policy.home(models["b"], slots) == 0 and policy.home(models["c"], slots) == 1  # round-robin


def test_host_lane_models_stay_off_the_devices():
    reg = KindRegistry()
    reward_model(name="pure", gpu=0.0, registry=reg)(lambda items: [0.0] * len(items))
    models = {s.name: ModelEntry(s) for s in reg}
    slots = [*make_slots(["cpu"], 1000), host_slot(1, "pure"), host_slot(2, "other")]
    enqueue(models["pure"], 1, at=0.0)
    assert LruReplicaPolicy().next_step(slots[0], slots, models, now=1.0) == Wait(None)
    assert LruReplicaPolicy().next_step(slots[2], slots, models, now=1.0) == Wait(None)  # not its own
    assert LruReplicaPolicy().next_step(slots[1], slots, models, now=1.0) == Load("pure")
    assert slots[1].lane == "host"


def test_bad_devices_budgets_and_assignments_are_refused():
    with pytest.raises(ValueError, match="do not exist"):
        StaticPolicy({"a": 1}).check(make_slots(["cpu"], 100))
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        make_slots(["tpu"], None)
    with pytest.raises(ValueError, match="mem_budget_mb"):
        make_slots(["cpu"], 0)
