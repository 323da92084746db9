"""The elastic policy: multi-resource fitting, elastic sizing from learned speed-ups, warm state, stories."""

from __future__ import annotations

import pytest

from tangram_env.server.scheduler import DEFAULT_SCHEDULER, SCHEDULERS, ElasticScheduler, make_scheduler
from tangram_env.server.scheduler.events import ActionCancelled, ActionFinished, Reject, Start, Tick
from tangram_env.server.scheduler.story import ActionState, IllegalTransition, StoryLog
from tests.server.scheduler.sched_helpers import Driver, arrive, worker


def test_registry_and_default() -> None:
    assert DEFAULT_SCHEDULER == "elastic"
    assert set(SCHEDULERS) == {"elastic", "fcfs", "task_isolated", "trajectory_bound"}
    for name in SCHEDULERS:
        assert make_scheduler(name).name == name
    with pytest.raises(ValueError, match="unknown scheduler 'nope'"):
        make_scheduler("nope")
    with pytest.raises(Exception, match="age_rate"):
        make_scheduler("elastic", age_rate=-1)


def test_an_action_fits_only_where_every_demand_fits() -> None:
    drive = Driver(ElasticScheduler())
    drive([worker("cpu", cpu=8, mem=1000), worker("gpu", cpu=2, mem=64_000, gpu=1, gmem=80_000)])
    out = drive([arrive("big-mem", cpu=1, mem=4000), arrive("gpu-job", kind="score", gpu=1, gmem=40_000)])
    starts = drive.starts(out)
    assert starts["big-mem"].worker_id == "gpu"  # the CPU worker has the cores but not the memory
    assert starts["gpu-job"].worker_id == "gpu"
    out = drive([arrive("second-gpu", kind="score", gpu=1, gmem=40_000)])
    assert not drive.starts(out)  # the one GPU is taken: it waits rather than over-commit
    assert drive.sched.pending() == 1
    out = drive([ActionFinished("gpu-job", 2.0)], 1.0)
    assert drive.starts(out)["second-gpu"].worker_id == "gpu"


def test_what_can_never_fit_is_rejected_and_unserved_kinds_wait() -> None:
    drive = Driver(ElasticScheduler())
    drive([worker("a", cpu=4, kinds=frozenset({"bash"}))])
    out = drive([arrive("huge", cpu=64), arrive("other-kind", kind="score")])
    assert [d.action_id for d in out if isinstance(d, Reject)] == ["huge"]
    assert drive.sched.pending() == 1  # nobody serves "score" yet: a worker that does may join
    out = drive([worker("g", cpu=4, kinds=frozenset({"score"}))])
    assert drive.starts(out)["other-kind"].worker_id == "g"
    assert drive([arrive("bad", lo=3, hi=2)])[0] == Reject("bad", "bad elasticity 3..2")


def test_elastic_actions_take_spare_units_up_to_max_par_and_headroom() -> None:
    drive = Driver(ElasticScheduler())
    drive([worker("w", cpu=32, mem=64_000)])
    out = drive([arrive("t", kind="tests", lo=1, hi=64)])
    k = drive.starts(out)["t"].parallelism
    # The prior says half the work is parallel: units are added while each cuts >= 5% of the run time,
    # and an eighth of the cores stays free for arrivals.
    assert 2 <= k <= 28
    out = drive([arrive("r", kind="bash")])
    assert "r" in drive.starts(out)  # the headroom left room for a rigid arrival


def test_pending_actions_come_before_extra_units() -> None:
    drive = Driver(ElasticScheduler())
    drive([worker("w", cpu=4)])
    out = drive([arrive("t", kind="tests", hi=8), arrive("a"), arrive("b"), arrive("c")])
    starts = drive.starts(out)
    assert set(starts) == {"t", "a", "b", "c"}
    assert starts["t"].parallelism == 1  # every core went to a pending action first


def test_parallelism_follows_the_learned_speed_up() -> None:
    sched = ElasticScheduler()
    for k in [1, 2, 4, 8, 16] * 4:
        sched.estimator.observe("parallel", k, 40 * (0.05 + 0.95 / k))
        sched.estimator.observe("serial", k, 40.0)
    drive = Driver(sched)
    drive([worker("w1", cpu=32), worker("w2", cpu=32)])
    out = drive([arrive("p", kind="parallel", hi=16), arrive("s", kind="serial", hi=16)])
    starts = drive.starts(out)
    assert starts["s"].parallelism == 1  # more units would not make it faster
    assert starts["p"].parallelism >= 8


def test_spare_units_go_where_they_save_most() -> None:
    sched = ElasticScheduler(cpu_headroom=0.0, min_rel_gain=0.0, queue_cost=0.0, load_headroom=0.0)
    for k in [1, 2, 4, 8] * 5:
        sched.estimator.observe("long", k, 100 * (0.1 + 0.9 / k))
        sched.estimator.observe("short", k, 2 * (0.1 + 0.9 / k))
    drive = Driver(sched)
    drive([worker("w", cpu=8)])
    starts = drive.starts(drive([arrive("L", kind="long", hi=8), arrive("S", kind="short", hi=8)]))
    assert starts["L"].parallelism + starts["S"].parallelism == 8
    assert starts["L"].parallelism > starts["S"].parallelism


def test_shortest_expected_first() -> None:
    sched = ElasticScheduler()
    for _ in range(10):
        sched.estimator.observe("long", 1, 50.0)
        sched.estimator.observe("short", 1, 0.5)
    drive = Driver(sched)
    drive([worker("w", cpu=1)])
    drive([arrive("busy", kind="short")])
    drive([arrive("L", kind="long"), arrive("S1", kind="short"), arrive("S2", kind="short")], 1.0)
    order = []
    for t, done in ((2.0, "busy"), (3.0, "S1"), (4.0, "S2")):
        order += list(drive.starts(drive([ActionFinished(done, 1.0)], t)))
    assert order == ["S1", "S2", "L"]


def test_warm_workers_are_preferred_and_waited_for_when_cheaper() -> None:
    sched = ElasticScheduler()
    drive = Driver(sched)
    drive([worker(f"g{i}", cpu=4, gpu=1, gmem=80_000, kinds=frozenset({"score"})) for i in range(2)])
    first = drive.starts(drive([arrive("s0", kind="score", gpu=1)]))["s0"].worker_id
    drive([ActionFinished("s0", 1.0, setup_s=20.0)], 21.0)  # a cold start: the model took 20 s to load
    assert sched.estimator.setup("score") > 1.0
    again = drive.starts(drive([arrive("s1", kind="score", gpu=1)], 22.0))["s1"].worker_id
    assert again == first  # the model is loaded there
    # Busy warm worker, idle cold one: the warm one frees in about a second, the cold start costs more.
    out = drive([arrive("s2", kind="score", gpu=1)], 22.1)
    assert not drive.starts(out)
    assert sched.next_wakeup(22.1) is not None
    out = drive([ActionFinished("s1", 1.0)], 23.0)
    assert drive.starts(out)["s2"].worker_id == first


def test_cancel_only_touches_pending_actions() -> None:
    drive = Driver(ElasticScheduler())
    drive([worker("w", cpu=1)])
    drive([arrive("run"), arrive("wait")])
    drive([ActionCancelled("wait"), ActionCancelled("run")])
    assert drive.sched.pending() == 0 and drive.sched.running() == 1
    assert [s[2] for s in drive.sched.story("wait")] == ["pending", "cancelled"]


def test_duplicates_and_late_news_are_ignored() -> None:
    drive = Driver(ElasticScheduler())
    drive([worker("w", cpu=1)])
    drive([arrive("a")])
    assert drive([arrive("a"), ActionFinished("ghost", 1.0), Tick()]) == []
    assert drive.sched.running() == 1 and drive.sched.pending() == 0
    with pytest.raises(TypeError, match="not a scheduler event"):
        drive.sched.handle([object()], 1.0)


def test_failed_runs_do_not_teach_durations() -> None:
    sched = ElasticScheduler()
    drive = Driver(sched)
    drive([worker("w", cpu=1)])
    drive([arrive("a", kind="k")])
    drive([ActionFinished("a", 0.0, ok=False)], 1.0)
    assert sched.estimator.snapshot()["k"]["observations"] == 0


def test_story_is_bounded_and_checks_transitions() -> None:
    sched = ElasticScheduler(story_per_action=3, story_actions=2)
    drive = Driver(sched)
    drive([worker("w", cpu=1)])
    drive([arrive("a")])
    drive([ActionFinished("a", 1.0)], 1.0)
    story = sched.story("a")
    assert [(s[1], s[2]) for s in story] == [("new", "pending"), ("pending", "running"), ("running", "done")]
    assert "on w x 1" in story[1][3]
    drive([arrive("b"), arrive("c")], 2.0)
    assert sched.story("a") == []  # only the last two actions are remembered
    log = StoryLog()
    with pytest.raises(IllegalTransition, match="done -> running"):
        log.record("x", 0.0, ActionState.DONE, ActionState.RUNNING)


def test_held_is_what_was_granted() -> None:
    drive = Driver(ElasticScheduler(elastic=False))
    drive([worker("w", cpu=8, mem=8000)])
    drive([arrive("a", cpu=2, mem=1000, lo=2, hi=4)])
    held = drive.sched.held()
    assert (held.cpu, held.mem_mb) == (4.0, 2000.0)
    snap = drive.sched.snapshot()
    assert snap["running"] == 1 and "estimates" in snap
    assert isinstance(drive.sched.story("a")[-1][0], float)
    assert all(isinstance(d, Start) for d in [Start("a", "w", 2)])


def test_a_class_emptied_while_blocked_starts_its_next_arrival() -> None:
    drive = Driver(ElasticScheduler())
    drive([worker("w", cpu=1)])
    drive([arrive("busy")])
    drive([arrive("x", kind="k")], 1.0)  # blocked: the one core is taken
    drive([ActionCancelled("x")], 2.0)  # its class is empty now, still marked blocked
    drive([ActionFinished("busy", 1.0)], 3.0)
    out = drive([arrive("y", kind="k")], 4.0)  # nothing frees at this instant, yet it must start
    assert "y" in drive.starts(out)


def _busy_then_elastic(**options: float) -> int:
    """Parallelism of an elastic start on an idle worker right after a burst of work arrived elsewhere."""
    sched = ElasticScheduler(**options)
    for k in [1, 2, 4, 8] * 5:
        sched.estimator.observe("tests", k, 40 * (0.08 + 0.92 / k))
        sched.estimator.observe("bash", k, 30.0)
    drive = Driver(sched)
    drive([worker("w1", cpu=16), worker("w2", cpu=16)])
    drive([arrive(f"b{i}", kind="bash") for i in range(16)])  # 16 x 30 s of work: the pool is half busy
    return drive.starts(drive([arrive("t", kind="tests", hi=16)], 1.0))["t"].parallelism


def test_growth_counts_what_the_queue_is_expected_to_lose() -> None:
    free = _busy_then_elastic(queue_cost=0.0, load_headroom=0.0)
    loaded = _busy_then_elastic()
    assert free >= 8  # with the queue's cost ignored, the spare cores all go to the test run
    assert 1 < loaded < free  # busy arrivals make the later units cost more than they save


def _score_width(judge_waiting: bool, warm_devices: bool = True) -> int:
    sched = ElasticScheduler(queue_cost=0.0, load_headroom=0.0)
    drive = Driver(sched)
    drive([worker("g", cpu=16, gpu=4, kinds=frozenset({"hold", "judge", "score"}))])
    if warm_devices:  # a first score on two devices leaves its model loaded on both
        drive([arrive("s0", kind="score", gpu=1, lo=2, hi=2)])
        drive([ActionFinished("s0", 1.0)], 0.5)
    drive([arrive("h", kind="hold", gpu=1, lo=2, hi=2)], 0.5)  # two of the four GPUs busy
    if judge_waiting:
        drive([arrive("j", kind="judge", gpu=1, lo=3, hi=3)], 1.0)  # needs three: it waits
    out = drive([arrive("s", kind="score", gpu=1, hi=4)], 2.0)
    return drive.starts(out)["s"].parallelism


def test_gpus_are_not_lent_for_growth_while_gpu_actions_wait() -> None:
    assert _score_width(judge_waiting=False) == 2  # the spare GPU goes to the score's batch
    assert _score_width(judge_waiting=True) == 1  # a GPU action waits: the freed GPU is kept for it


def test_gpus_are_lent_for_growth_only_where_the_model_is_loaded() -> None:
    # The hold took the two empty devices; the two left have never loaded the score's model.
    assert _score_width(judge_waiting=False, warm_devices=False) == 1
