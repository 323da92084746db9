"""Misbehaving reward models give error results with the reason; the runner survives and reloads."""

from __future__ import annotations

import math
import threading

import pytest

from tangram_env.kinds import RewardModel, reward_model, tool
from tangram_env.server.gpu import run_grants, score_grant, wait_for
from tests.conftest import wait_for as wait_until  # polls a condition (wait_for here waits for results)

torch = pytest.importorskip("torch")


def test_a_model_that_raises_fails_that_batch_and_keeps_serving(make_runner, affine_model):
    affine_model(fail={-1.0: RuntimeError("boom")}, max_wait_ms=0)
    runner = make_runner()
    bad, good = (
        run_grants(runner, [score_grant("affine", [-1.0])]),
        run_grants(runner, [score_grant("affine", [2.0])]),
    )
    assert bad[0].error_type == "model_error" and not bad[0].ok
    assert "RuntimeError: boom" in bad[0].message and "affine" in bad[0].message
    assert "raise fail[value]" in bad[0].traceback
    assert good[0].ok and good[0].value == [5.0]
    assert runner.stats()["models"]["affine"]["loads"] == 1  # an ordinary error does not reload


def test_only_the_action_with_the_bad_item_fails_in_a_shared_batch(make_runner, affine_model):
    gate = threading.Event()
    calls = affine_model(fail={-1.0: ValueError("negative input")}, max_wait_ms=1000, load_gate=gate)
    runner = make_runner()
    grants = [score_grant("affine", [1.0]), score_grant("affine", [-1.0, 3.0]), score_grant("affine", [4.0])]
    for g in grants:
        runner.start(g)
    gate.set()
    got = wait_for(runner, [g.action.id for g in grants])
    first, bad, last = (got[g.action.id] for g in grants)
    assert first.value == [3.0] and last.value == [9.0]
    assert not bad.ok and "negative input" in bad.message
    assert [n for n, _ in calls.forwards] == [1, 1]  # the shared batch failed; each part rescored alone


@pytest.mark.parametrize(
    ("returns", "reason"),
    [
        (lambda batch: [0.5], "returned 1 scores for 2 items"),
        (lambda batch: [0.5, float("nan")], "returned nan for item 1"),
        (lambda batch: [0.5, math.inf], "returned inf for item 1"),
        (lambda batch: torch.tensor([0.5, float("nan")]), "returned nan for item 1"),
        (lambda batch: {"a": 1}, "returned dict, not a list"),
        (lambda batch: ["x", 1.0], "non-number for item 0"),
        # float() takes these; a model returning text or flags is broken, not scoring
        (lambda batch: [0.5, "0.9"], "non-number for item 1: '0.9'"),
        (lambda batch: [b"1", 0.5], "non-number for item 0: b'1'"),
        (lambda batch: [True, 0.0], "non-number for item 0: True"),
    ],
)
def test_wrong_outputs_are_error_results_with_the_reason(make_runner, registry, returns, reason):
    reward_model(name="broken", gpu=0.5, registry=registry)(returns)
    runner = make_runner()
    (result,) = run_grants(runner, [score_grant("broken", [1, 2])])
    assert result.error_type == "model_error"
    assert reason in result.message


@pytest.mark.parametrize(
    "oom",
    [MemoryError("no room"), torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")],
    ids=["MemoryError", "torch.cuda.OutOfMemoryError"],
)
def test_out_of_memory_fails_the_batch_and_the_model_reloads(make_runner, affine_model, oom):
    calls = affine_model(fail={-1.0: oom}, max_wait_ms=0)
    runner = make_runner()
    run_grants(runner, [score_grant("affine", [1.0])])
    (result,) = run_grants(runner, [score_grant("affine", [-1.0])])
    assert result.error_type == "model_error" and "ran out of memory on cpu" in result.message
    assert calls.unloads == ["cpu"]  # dropped from the device
    (after,) = run_grants(runner, [score_grant("affine", [1.0])])
    assert after.ok and after.value == [3.0]
    stats = runner.stats()["models"]["affine"]
    assert stats["loads"] == 2 and stats["ooms"] == 1 and len(calls.loads) == 2


def _memory_bound_model(
    registry, *, most: int, alone: float | None = None, refuse_negative: bool = False
) -> tuple[list[int], threading.Event]:
    """Register ``double``: scores ``2x``, and runs out of device memory (as torch raises it) on a batch
    of more than ``most`` items, or on any batch holding the item ``alone``; with ``refuse_negative``
    a batch holding a negative item raises ``ValueError`` first (validated before the forward pass).
    Its load waits for the returned event, so that every request a test starts meanwhile shares the
    first batch; the list gets each batch's size.
    """
    sizes: list[int] = []
    gate = threading.Event()

    @reward_model(name="double", gpu=0.5, max_batch=8, max_wait_ms=1000, registry=registry)
    class Double(RewardModel):
        def load(self, device: str) -> None:
            gate.wait(30)

        def score(self, batch: list[float]) -> list[float]:
            sizes.append(len(batch))
            if refuse_negative and any(x < 0 for x in batch):
                raise ValueError("negative item")
            if len(batch) > most or alone in batch:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return [2.0 * x for x in batch]

    return sizes, gate


def test_a_batch_that_runs_out_of_memory_is_scored_again_in_smaller_batches(make_runner, registry):
    sizes, gate = _memory_bound_model(registry, most=2)
    runner = make_runner()
    grants = [score_grant("double", [1, 2]), score_grant("double", [3]), score_grant("double", [4, 5, 6])]
    for g in grants:
        runner.start(g)
    gate.set()
    got = wait_for(runner, [g.action.id for g in grants])
    assert [got[g.action.id].value for g in grants] == [[2, 4], [6], [8, 10, 12]]  # none failed
    assert sizes[:2] == [6, 3], sizes  # then half as many per batch
    stats = runner.stats()["models"]["double"]
    assert stats["ooms"] >= 1 and stats["errors"] == 0
    assert stats["max_batch"] <= 3  # batches stay smaller for a while


def test_an_item_that_runs_out_of_memory_alone_fails_only_its_action(make_runner, registry):
    sizes, gate = _memory_bound_model(registry, most=8, alone=99)
    runner = make_runner()
    grants = [score_grant("double", [1]), score_grant("double", [5, 99]), score_grant("double", [2])]
    for g in grants:
        runner.start(g)
    gate.set()
    got = wait_for(runner, [g.action.id for g in grants])
    first, bad, last = (got[g.action.id] for g in grants)
    assert first.value == [2] and last.value == [4]  # they shared a batch with it: scored again
    assert bad.error_type == "model_error" and "ran out of memory on cpu scoring 1 items" in bad.message
    assert sizes[0] == 4, sizes


def test_a_failed_load_fails_the_waiting_actions_and_is_retried_later(make_runner, registry):
    attempts = []

    @reward_model(name="flaky", gpu=0.5, registry=registry)
    class Flaky(RewardModel):
        def load(self, device: str) -> None:
            attempts.append(device)
            if len(attempts) == 1:
                raise OSError("weights file is missing")

        def score(self, batch: list[float]) -> list[float]:
            return [1.0] * len(batch)

    runner = make_runner()
    (first,) = run_grants(runner, [score_grant("flaky", [1])])
    assert first.error_type == "model_error"
    assert "could not load reward model 'flaky' on cpu: OSError: weights file is missing" in first.message
    (second,) = run_grants(runner, [score_grant("flaky", [1])])
    assert second.ok and len(attempts) == 2
    assert runner.stats()["models"]["flaky"]["load_failures"] == 1


def test_bad_requests_are_rejected(make_runner, registry, affine_model):
    affine_model()

    @tool(name="not_a_model", registry=registry)
    def not_a_model() -> int:
        return 1

    runner = make_runner()
    unknown, wrong_role = run_grants(runner, [score_grant("afine", [1]), score_grant("not_a_model", [1])])
    assert unknown.error_type == "rejected" and "did you mean 'affine'" in unknown.message
    assert wrong_role.error_type == "rejected" and "not a reward model" in wrong_role.message
    g = score_grant("affine", [])
    g.action.payload = {"items": "abc"}
    (bad_payload,) = run_grants(runner, [g])
    assert bad_payload.error_type == "rejected" and "items" in bad_payload.message
    g = score_grant("affine", [1.0])
    g.action.payload = {"items": [1.0], "itmes": [2.0]}  # a misspelt key is an error, not dropped
    (extra_key,) = run_grants(runner, [g])
    assert extra_key.error_type == "rejected" and "itmes" in extra_key.message


def test_an_action_past_its_time_limit_times_out_and_the_runner_goes_on(make_runner, affine_model):
    affine_model(score_delay_s=1.0, max_wait_ms=0)
    runner = make_runner()
    slow = score_grant("affine", [1.0], timeout_s=0.2)
    (result,) = run_grants(runner, [slow])
    assert result.error_type == "timeout"
    (ok,) = run_grants(runner, [score_grant("affine", [1.0])])
    assert ok.ok and ok.value == [3.0]


def test_a_model_with_missing_requirements_is_not_offered(make_runner, registry, affine_model):
    affine_model()

    @reward_model(name="needs_more", registry=registry)
    class NeedsMore(RewardModel):
        requires = ("no_such_module_for_tangram_tests",)

    runner = make_runner()
    assert runner.kinds() == frozenset({"affine"})
    (result,) = run_grants(runner, [score_grant("needs_more", [1])])
    assert result.error_type == "model_error"
    assert "install no_such_module_for_tangram_tests in its environment" in result.message
    assert "torch" not in result.message  # the fix names what is missing, not a guess


class _NoticedGate(threading.Event):
    """A load gate that also tells when the load began waiting on it."""

    def __init__(self) -> None:
        super().__init__()
        self.reached = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.reached.set()
        return super().wait(timeout)


def test_close_cancels_queued_actions_and_unloads(make_runner, affine_model):
    gate = _NoticedGate()
    calls = affine_model(load_gate=gate)
    runner = make_runner()
    g = score_grant("affine", [1.0])
    runner.start(g)
    assert gate.reached.wait(30)  # the load is under way (on a busy machine it may take a moment)
    threading.Timer(0.3, gate.set).start()  # the load finishes while close() waits for the device
    runner.close()
    runner.close()  # idempotent
    assert [(r.action_id, r.error_type) for r in runner.collect()] == [(g.action.id, "cancelled")]
    assert calls.loads == ["cpu"] and calls.unloads == ["cpu"]


def test_a_stuck_host_lane_model_holds_up_only_its_own_requests(make_runner, registry):
    # Models that need no device (gpu=0, like the built-in graders) shared one thread: one whose score
    # never returned made every later request of every other one time out.
    release = threading.Event()

    @reward_model(name="stuck", registry=registry)
    def stuck(items: list[float]) -> list[float]:
        release.wait(30)
        return [0.0] * len(items)

    @reward_model(name="quick", registry=registry)
    def quick(items: list[float]) -> list[float]:
        return [1.0] * len(items)

    runner = make_runner()
    try:
        hung, ok = run_grants(
            runner, [score_grant("stuck", [1], timeout_s=0.5), score_grant("quick", [1], timeout_s=5)]
        )
        assert hung.error_type == "timeout"  # at its limit, though its thread is still inside score
        assert ok.ok and ok.value == [1.0] and ok.timing.act_s < 2.0
        (again,) = run_grants(runner, [score_grant("quick", [2], timeout_s=5)])
        assert again.ok and again.timing.act_s < 2.0
    finally:
        release.set()


def test_a_device_stuck_past_its_requests_limits_is_unrecoverable_until_it_returns(make_runner, registry):
    # A forward pass that never returns holds its device for good (a thread cannot be killed, nor a
    # hung CUDA kernel): the runner says so, and its worker exits for a supervisor to restart it.
    release = threading.Event()

    @reward_model(name="hangs", gpu=0.5, registry=registry)
    def hangs(items: list[float]) -> list[float]:
        release.wait(60)
        return [0.0] * len(items)

    runner = make_runner(stuck_after_s=3.0)
    try:
        (hung,) = run_grants(runner, [score_grant("hangs", [1], timeout_s=0.3)])
        assert hung.error_type == "timeout"
        assert runner.unrecoverable() is None  # past its limit, but not by stuck_after_s yet
        why = wait_until(runner.unrecoverable, 10, "the runner to say the device is stuck", every_s=0.05)
        assert why.startswith("cpu is stuck in reward model 'hangs': its forward pass has run")
        assert "past the time limit of the last request it serves" in why
        running = runner.stats()["devices"][0]["running"]  # what an operator sees meanwhile
        assert running["model"] == "hangs" and running["what"] == "forward pass"
        assert running["past_limit_s"] > 3.0 and running["for_s"] > running["past_limit_s"]
    finally:
        release.set()
    # It returned: the device is well again.
    wait_until(lambda: runner.unrecoverable() is None, 10, "the device to be well again", every_s=0.05)
    (again,) = run_grants(runner, [score_grant("hangs", [2], timeout_s=5)])
    assert again.ok and again.value == [0.0]
    # Its device notes the pass done just after handing the result.
    wait_until(
        lambda: runner.stats()["devices"][0]["running"] is None,
        10,
        "the device to show no forward pass",
        every_s=0.02,
    )


def test_out_of_memory_is_told_by_the_exception_type_not_by_a_phrase_in_the_message():
    from tangram_env.server.gpu import is_out_of_memory

    with pytest.raises(RuntimeError) as real:  # torch's own CPU allocator, refusing 4 EiB
        torch.empty(2**62, dtype=torch.uint8)
    assert is_out_of_memory(real.value)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be ..."))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(ValueError("item 0 has an unknown key 'out of memory'"))
    assert not is_out_of_memory(ValueError("CUDA out of memory"))  # a model's own error, not torch's
    assert not is_out_of_memory(RuntimeError("bad item: CUDA out of memory"))
    assert not is_out_of_memory(KeyError("OutOfMemoryError"))


def test_an_error_that_mentions_out_of_memory_is_an_ordinary_model_error(make_runner, affine_model):
    # A client's item echoed in a validation error made it look like an OOM: the shared replica was
    # unloaded and reloaded, the other requests' batch requeued and the batch limit halved.
    gate = threading.Event()
    calls = affine_model(
        fail={-1.0: ValueError("item -1.0 is out of memory range")},
        max_batch=8,
        max_wait_ms=1000,
        load_gate=gate,
    )
    runner = make_runner()
    grants = [score_grant("affine", [1.0, 2.0]), score_grant("affine", [-1.0]), score_grant("affine", [3.0])]
    for g in grants:
        runner.start(g)
    gate.set()
    got = wait_for(runner, [g.action.id for g in grants])
    first, bad, last = (got[g.action.id] for g in grants)
    assert first.value == [3.0, 5.0] and last.value == [7.0]
    assert bad.error_type == "model_error" and "failed on cpu scoring 1 items: ValueError" in bad.message
    stats = runner.stats()["models"]["affine"]
    assert stats["ooms"] == 0 and stats["max_batch"] == 8 and stats["loads"] == 1
    assert calls.unloads == []


@pytest.mark.parametrize("bad", ["800 MiB", math.nan, -800, math.inf])
def test_a_load_that_sets_an_unusable_memory_mb_is_a_failed_load(make_runner, registry, bad):
    # float("800 MiB") raised outside the load's error handling: the replica stayed loading for good
    # with its 800 MiB booked, every request timed out and no other model could load on the device.
    unloads = []

    @reward_model(name="big", gpu=0.1, max_wait_ms=0, registry=registry)
    class Big(RewardModel):
        memory_mb = 800

        def load(self, device: str) -> None:
            self.memory_mb = bad

        def score(self, batch: list[float]) -> list[float]:
            return [1.0] * len(batch)

        def unload(self) -> None:
            unloads.append(True)

    @reward_model(name="good", gpu=0.1, gpu_mem_mb=400, max_wait_ms=0, registry=registry)
    def good(items: list[float]) -> list[float]:
        return [0.5] * len(items)

    runner = make_runner(mem_budget_mb=1000)
    (failed,) = run_grants(runner, [score_grant("big", [1], timeout_s=20)], timeout_s=30)
    assert failed.error_type == "model_error"
    assert failed.message.startswith("could not load reward model 'big' on cpu: RewardModelError: ")
    assert f"reward model 'big' has memory_mb={bad!r} after load(): it must be a finite" in failed.message
    assert unloads == [True]  # what load() put on the device is given back
    stats = runner.stats()
    assert stats["models"]["big"]["loading_on"] == [] and stats["models"]["big"]["load_failures"] == 1
    assert stats["devices"][0]["used_mb"] == 0
    (ok,) = run_grants(runner, [score_grant("good", [1], timeout_s=20)], timeout_s=30)
    assert ok.ok and ok.value == [0.5]


@pytest.mark.parametrize("bad", ["1GB", math.nan, -900, math.inf, True])
def test_a_model_with_an_unusable_class_memory_mb_is_left_out_and_the_rest_serve(
    make_runner, registry, caplog, bad
):
    # It made kinds() and stats() raise (the worker exited at registration, taking every model down),
    # or blocked every other load (NaN), or over-committed the device (negative).
    @reward_model(name="bad", gpu=0.1, max_wait_ms=0, registry=registry)
    class Bad(RewardModel):
        def score(self, batch: list[float]) -> list[float]:
            return [0.0] * len(batch)

    Bad.memory_mb = bad  # after registration (a registry that checks it would refuse it there)
    for name in ("big1", "big2"):
        reward_model(name=name, gpu=0.1, gpu_mem_mb=700, max_wait_ms=0, registry=registry)(
            lambda items: [1.0] * len(items)
        )
    runner = make_runner(mem_budget_mb=1000)
    assert runner.kinds() == frozenset({"bad", "big1", "big2"})  # its requests come here, to fail
    assert sorted(runner.stats()["models"]) == ["big1", "big2"]
    why = f"reward model 'bad' has memory_mb={bad!r}: it must be a finite number of MiB >= 0"
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        f"{why}, without a unit; its requests here fail with this reason"
    ]  # once, however often it is asked
    results = run_grants(runner, [score_grant(k, [0], timeout_s=20) for k in ("bad", "big1", "big2")])
    assert results[0].error_type == "model_error" and why in results[0].message
    assert [r.value for r in results[1:]] == [[1.0], [1.0]]
    assert runner.stats()["devices"][0]["used_mb"] == 700  # one at a time: they never fit together


def test_a_model_entry_refuses_unusable_settings_naming_the_model_and_field(registry):
    from tangram_env.server.gpu.models import ModelEntry, RewardModelError

    @reward_model(name="m", gpu=0.1, registry=registry)
    class M(RewardModel):
        memory_mb = 64

    spec = registry.get("m")
    assert ModelEntry(spec).memory_mb == 64.0
    M.memory_mb = "64 MiB"
    with pytest.raises(
        RewardModelError, match=r"reward model 'm' has memory_mb='64 MiB': it must be a finite"
    ):
        ModelEntry(spec)
    M.memory_mb = 0  # 0: the decorator's gpu_mem_mb
    spec.options["max_batch"] = "32"
    with pytest.raises(RewardModelError, match=r"reward model 'm' has max_batch='32'"):
        ModelEntry(spec)
    spec.options["max_batch"] = 32
    spec.options["max_wait_ms"] = math.nan
    with pytest.raises(RewardModelError, match=r"reward model 'm' has max_wait_ms=nan"):
        ModelEntry(spec)


def test_a_part_that_runs_out_of_memory_when_scored_alone_is_retried_not_failed(make_runner, registry):
    # A shared batch failed on another action's bad item; the parts were scored alone, and a part of
    # several items that ran out of memory failed its action, though alone it would have been retried
    # in smaller batches.
    sizes, gate = _memory_bound_model(registry, most=2, refuse_negative=True)
    runner = make_runner()
    grants = [score_grant("double", [1, 2, 3, 4]), score_grant("double", [-1]), score_grant("double", [5])]
    for g in grants:
        runner.start(g)
    gate.set()
    got = wait_for(runner, [g.action.id for g in grants])
    first, bad, last = (got[g.action.id] for g in grants)
    assert first.ok and first.value == [2, 4, 6, 8], first.message
    assert last.ok and last.value == [10], last.message
    assert bad.error_type == "model_error" and "ValueError: negative item" in bad.message
    # The shared batch, the first part alone (the rest waits for the reload), then half as many.
    assert sizes[:3] == [6, 4, 2], sizes
    stats = runner.stats()["models"]["double"]
    assert stats["ooms"] == 1 and stats["errors"] == 1 and stats["max_batch"] <= 3 and stats["loads"] == 2


class _RunnerWithABug:
    """Wraps a runner method so that its first call raises, as a bug in the runner's own code would."""

    def __init__(self, method):
        self.method, self.calls = method, 0

    def __call__(self, *args):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("a bug in the runner")
        return self.method(*args)


@pytest.mark.parametrize("method", ["_run_load", "_run_batch"])
def test_a_runner_bug_in_a_load_or_batch_fails_its_requests_and_frees_the_device(
    make_runner, affine_model, method
):
    # The device thread's catch-all only cleared the busy flags: a replica left loading kept its
    # memory booked and its model's requests waited for their time limit, as did a batch's.
    affine_model(memory_mb=600, max_wait_ms=0)
    runner = make_runner(mem_budget_mb=1000)
    setattr(runner, method, _RunnerWithABug(getattr(runner, method)))
    (failed,) = run_grants(runner, [score_grant("affine", [1.0], timeout_s=20)], timeout_s=30)
    assert failed.error_type == "model_error" and "the GPU runner failed on cpu" in failed.message
    assert "a bug in the runner" in failed.traceback
    stats = runner.stats()
    assert stats["models"]["affine"]["loading_on"] == []
    assert stats["devices"][0]["used_mb"] == (0 if method == "_run_load" else 600)
    (ok,) = run_grants(runner, [score_grant("affine", [1.0], timeout_s=20)], timeout_s=30)
    assert ok.ok and ok.value == [3.0]
