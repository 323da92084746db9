"""The ledger and its fit index: multi-resource fits, no over-commit (property-tested), best/worst fit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_env.server.scheduler.ledger import FreeIndex, Ledger, OverCommitError, Worker, fits, max_units


def test_fits_needs_every_resource() -> None:
    free = [4.0, 1000.0, 1.0, 8000.0]
    assert fits(free, (2, 500, 0.5, 4000), 2)
    assert not fits(free, (2, 501, 0.5, 4000), 2)  # memory is short
    assert not fits(free, (1, 100, 1, 0), 2)  # GPUs are short
    assert max_units(free, (1, 100, 0.25, 0)) == 4
    assert max_units(free, (0, 0, 0, 0)) > 1000


def test_allocate_refuses_what_does_not_fit_and_keeps_the_books() -> None:
    led = Ledger()
    w = led.add_worker("w", (4, 1000, 0, 0), None)
    led.allocate(w, (1, 200, 0, 0), 3)
    with pytest.raises(OverCommitError, match="does not fit"):
        led.allocate(w, (1, 200, 0, 0), 2)
    with pytest.raises(OverCommitError):
        led.allocate(w, (0.5, 500, 0, 0), 1)  # cores fit, memory does not
    assert w.free == [1.0, 400.0, 0.0, 0.0]
    led.validate({"w": [3.0, 600.0, 0.0, 0.0]})
    led.release(w, (1, 200, 0, 0), 3)
    assert w.free == [4.0, 1000.0, 0.0, 0.0]
    assert isinstance(OverCommitError("x"), AssertionError)


def test_worker_registry_errors_are_clear() -> None:
    led = Ledger()
    led.add_worker("w", (4, 1000, 0, 0), None)
    with pytest.raises(ValueError, match="already"):
        led.add_worker("w", (4, 1000, 0, 0), None)
    with pytest.raises(ValueError, match="negative"):
        led.add_worker("x", (-1, 1000, 0, 0), None)
    assert led.remove_worker("nobody") is None


def test_best_fit_and_worst_fit() -> None:
    led = Ledger()
    ws = [led.add_worker(f"w{i}", (8, 8000, 0, 0), None) for i in range(3)]
    led.allocate(ws[0], (6, 100, 0, 0), 1)  # 2 free
    led.allocate(ws[1], (3, 100, 0, 0), 1)  # 5 free; ws[2] has 8 free
    pools = list(led.pools.values())
    assert led.find(pools, (2, 10, 0, 0), 1, worst=False, probe=8) is ws[0]
    assert led.find(pools, (2, 10, 0, 0), 1, worst=True, probe=8) is ws[2]
    assert led.find(pools, (3, 10, 0, 0), 1, worst=False, probe=8) is ws[1]
    assert led.find(pools, (9, 10, 0, 0), 1, worst=True, probe=8) is None
    # Memory is checked on each candidate: the most-free-cores worker lacks memory here.
    led.allocate(ws[2], (0, 7990, 0, 0), 1)
    assert led.find(pools, (1, 100, 0, 0), 1, worst=True, probe=8) is ws[1]


def test_hidden_workers_are_not_offered() -> None:
    led = Ledger()
    w = led.add_worker("w", (8, 8000, 0, 0), None)
    pools = list(led.pools.values())
    led.hide(w)
    assert led.find(pools, (1, 1, 0, 0), 1, worst=True, probe=8) is None
    led.show(w)
    assert led.find(pools, (1, 1, 0, 0), 1, worst=True, probe=8) is w


def test_pools_group_identical_workers_and_kinds() -> None:
    led = Ledger()
    led.add_worker("a", (8, 8000, 0, 0), None)
    led.add_worker("b", (8, 8000, 0, 0), None)
    led.add_worker("g", (8, 8000, 4, 320_000), frozenset({"score"}))
    assert len(led.pools) == 2
    assert [p.kinds for p in led.eligible_pools("score", (1, 1, 1, 1), 1)] == [frozenset({"score"})]
    assert len(led.eligible_pools("bash", (1, 1, 0, 0), 1)) == 1
    assert led.eligible_pools("bash", (9, 1, 0, 0), 1) == []
    v = led.version
    led.remove_worker("g")
    assert led.version == v + 1 and len(led.pools) == 1


def test_index_buckets() -> None:
    idx = FreeIndex(0, 32.0, nbuckets=64)
    ws = [Worker(f"w{i}", (32, 1, 0, 0), None) for i in range(4)]
    for w, free in zip(ws, (0.0, 3.0, 10.5, 32.0), strict=True):
        w.free[0] = free
        idx.put(w)
    idx.check(ws)
    assert [w.id for w in idx.candidates(3.0, worst=False)][:1] == ["w1"]
    assert [w.id for w in idx.candidates(3.0, worst=True)][:1] == ["w3"]
    assert "w0" not in [w.id for w in idx.candidates(0.5, worst=False)]
    ws[3].free[0] = 1.0
    idx.update(ws[3])
    idx.check(ws)
    idx.drop(ws[3])
    idx.check(ws[:3])


_op = st.tuples(
    st.sampled_from(["alloc", "release"]),
    st.integers(0, 2),
    st.tuples(
        st.sampled_from([0.0, 0.25, 0.5, 1.0, 3.0]),
        st.sampled_from([0.0, 100.0, 700.0]),
        st.sampled_from([0.0, 0.5, 1.0]),
        st.sampled_from([0.0, 1000.0]),
    ),
    st.integers(1, 4),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_op, max_size=60))
def test_ledger_never_over_commits(
    ops: list[tuple[str, int, tuple[float, float, float, float], int]],
) -> None:
    led = Ledger(nbuckets=8)
    ws = [led.add_worker(f"w{i}", (4.0, 2000.0, 2.0, 4000.0), None) for i in range(3)]
    grants: list[tuple[int, tuple[float, float, float, float], int]] = []
    for op, i, vec, k in ops:
        if op == "alloc":
            if fits(ws[i].free, vec, k):
                led.allocate(ws[i], vec, k)
                grants.append((i, vec, k))
            else:
                with pytest.raises(OverCommitError):
                    led.allocate(ws[i], vec, k)
        elif grants:
            j, vec2, k2 = grants.pop(i % len(grants))
            led.release(ws[j], vec2, k2)
        lent = {w.id: [0.0, 0.0, 0.0, 0.0] for w in ws}
        for j, vec2, k2 in grants:
            for d in range(4):
                lent[ws[j].id][d] += vec2[d] * k2
        led.validate(lent)
