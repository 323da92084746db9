"""Dynamic batching in the GPU runner: real threads, a real torch module, real fd readiness."""

from __future__ import annotations

import select
import threading
import time

from tangram_env.server.gpu import run_grants, score_grant, wait_for


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_requests_within_max_wait_share_one_forward_pass(make_runner, affine_model):
    calls = affine_model(max_batch=32, max_wait_ms=300)
    runner = make_runner()
    # Warm the model so the batch below does not also wait for the load.
    run_grants(runner, [score_grant("affine", [0.0])])
    calls.forwards.clear()
    grants = [score_grant("affine", [float(i), float(i) + 0.5]) for i in range(8)]
    results = run_grants(runner, grants)
    assert calls.forwards == [(16, "cpu")]
    for i, result in enumerate(results):
        assert result.ok, result.message
        assert result.value == [2.0 * i + 1.0, 2.0 * i + 2.0]  # each caller gets its own scores, in order
    assert runner.stats()["models"]["affine"]["max_batch_seen"] == 16


def test_batches_are_capped_at_max_batch_and_keep_arrival_order(make_runner, affine_model):
    gate = threading.Event()
    calls = affine_model(max_batch=4, max_wait_ms=1000, load_gate=gate)
    runner = make_runner()
    grants = [score_grant("affine", [float(i)]) for i in range(10)]
    for g in grants:
        runner.start(g)
    gate.set()  # everything is queued while the model loads
    got = wait_for(runner, [g.action.id for g in grants])
    assert [n for n, _ in calls.forwards] == [4, 4, 2]
    assert [got[g.action.id].value for g in grants] == [[2.0 * i + 1.0] for i in range(10)]


def test_a_large_action_is_split_into_batches_and_reassembled(make_runner, affine_model):
    calls = affine_model(max_batch=4, max_wait_ms=0)
    runner = make_runner()
    items = [float(i) for i in range(10)]
    (result,) = run_grants(runner, [score_grant("affine", items)])
    assert result.ok
    assert result.value == [2.0 * x + 1.0 for x in items]
    assert [n for n, _ in calls.forwards] == [4, 4, 2]


def test_requests_apart_by_more_than_max_wait_are_not_batched(make_runner, affine_model):
    calls = affine_model(max_batch=32, max_wait_ms=20)
    runner = make_runner()
    run_grants(runner, [score_grant("affine", [1.0])])
    time.sleep(0.3)
    run_grants(runner, [score_grant("affine", [2.0])])
    assert [n for n, _ in calls.forwards] == [1, 1]


def test_start_never_waits_for_the_model_and_the_fd_signals_results(make_runner, affine_model):
    gate = threading.Event()
    affine_model(load_gate=gate, max_wait_ms=0)
    runner = make_runner()
    (fd,) = runner.wait_fds()
    g = score_grant("affine", [3.0])
    runner.start(g)  # returns while load() is still blocked on the gate
    assert not gate.is_set()
    assert not readable(fd)
    assert runner.collect() == []
    try:
        deadline = time.monotonic() + 10
        while runner.stats()["models"]["affine"]["loading_on"] != ["cpu"] and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = runner.stats()["models"]["affine"]
        assert stats["loading_on"] == ["cpu"] and stats["queue_items"] == 1
        assert runner.stats()["devices"][0]["busy"]
    finally:
        gate.set()
    assert select.select([fd], [], [], 30)[0] == [fd]
    results = []
    while not results:  # readable means "may be ready"
        results = runner.collect()
        select.select([fd], [], [], 1)
    assert [r.value for r in results] == [[7.0]]
    assert not readable(fd)  # collect drained it


def test_empty_items_succeed_at_once(make_runner, affine_model):
    calls = affine_model()
    runner = make_runner()
    (result,) = run_grants(runner, [score_grant("affine", [])])
    assert result.ok and result.value == []
    assert calls.loads == []  # nothing to score, nothing loaded


def test_timing_reports_load_as_setup_and_scoring_as_run(make_runner, affine_model):
    affine_model(load_delay_s=0.3, score_delay_s=0.1, max_wait_ms=0)
    runner = make_runner()
    (first,) = run_grants(runner, [score_grant("affine", [1.0])])
    (second,) = run_grants(runner, [score_grant("affine", [1.0])])
    assert first.timing.setup_s >= 0.3
    assert first.timing.run_s >= 0.1
    assert second.timing.setup_s == 0.0  # warm: no load to wait for
    assert runner.stats()["models"]["affine"]["last_load_s"] >= 0.3


class _CopyCountingList(list):
    """A list that counts the items its slices (and theirs) copy."""

    copied = 0

    def __getitem__(self, index):
        got = super().__getitem__(index)
        if isinstance(index, slice):
            _CopyCountingList.copied += len(got)
            return _CopyCountingList(got)
        return got


def test_draining_a_large_share_copies_each_item_once():
    # Each batch copied the rest of the share (O(n^2 / max_batch) under the runner's lock: 8.8 s to
    # cut 400k items into batches of 32).
    from tangram_env.server.gpu.batching import Job, ModelQueue, Share

    n = 20_000
    job = Job("a", "m", n, 1, 0.0, 1e9)
    queue = ModelQueue()
    queue.push([Share(job, 0, _CopyCountingList(range(n)), 0.0)])
    _CopyCountingList.copied = 0
    got: list[int] = []
    while len(queue):
        assert queue.queued_items() == n - len(got) == queue.takeable_items()
        (piece,) = queue.take_batch(32)
        assert piece.start == len(got)
        got.extend(piece.items)
        job.in_flight -= 1
    assert got == list(range(n))
    assert _CopyCountingList.copied == n
