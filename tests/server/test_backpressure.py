"""A provider at capacity is backpressure: the core retries the action after a bounded back-off."""

from __future__ import annotations

import logging

import pytest

from tangram_env.protocol import Action, Cancel, CloseSessions, Resources, Result, Submit
from tangram_env.sandbox import SandboxBusy
from tangram_env.server.backpressure import BusyRetries, busy_result, is_busy
from tangram_env.server.lifecycle import Lifecycle, Limits, Stage
from tangram_env.server.scheduler import ElasticScheduler
from tests.server.test_lifecycle import ALICE, Driver, _registry, _results, _runs

BUSY = SandboxBusy("e2b is at capacity, retry later: 429")


def _busy(action_id: str) -> Result:
    return busy_result(action_id, BUSY)


def test_a_busy_result_is_marked_and_nothing_else_is() -> None:
    assert is_busy(_busy("a"))
    assert not is_busy(Result.failure("a", "throttled", "429 from an API", value={"retry_after_s": 1}))
    assert not is_busy(Result.failure("a", "sandbox_died", "gone"))


def test_back_off_doubles_up_to_its_cap_and_gives_up_after_its_tries() -> None:
    retries = BusyRetries(first_s=0.5, max_s=2.0, tries=4)
    waits = [retries.refused("a", _busy("a"), 10.0) for _ in range(4)]
    assert waits == [10.5, 11.0, 12.0, 12.0]
    assert retries.refused("a", _busy("a"), 10.0) is None and retries.given_up == 1
    hinted = busy_result("b", BUSY, retry_after_s=7.0)
    assert retries.refused("b", hinted, 0.0) == 7.0  # the provider's own hint, when longer


def test_a_busy_sandbox_action_waits_out_its_back_off_then_runs_again_under_its_id() -> None:
    d = Driver(Limits(busy_first_s=1.0, busy_max_s=4.0, busy_tries=3))
    d.submit(ALICE, Action(id="s", kind="shell", affinity="S"))
    assert [r.grant.action.id for r in _runs(d.turn())] == ["s"]
    d.finished("local", _busy("s"))
    out = d.turn()
    assert not _results(out) and not _runs(out)  # the client hears nothing; the grant is freed
    assert d.core.entries["s"].stage is Stage.QUEUED and d.core.wake_at == 1.0
    assert d.core.scheduler.pending() == 0 and d.core.scheduler.running() == 0
    figures = d.core.figures()["sandbox_busy"]
    assert figures == {"retries": 1, "backing_off": 1, "given_up": 0}
    d.now = 0.9
    assert not _runs(d.turn())
    d.now = 1.0
    d.core.wake(d.now)
    assert [r.grant.action.id for r in _runs(d.turn())] == ["s"]  # the same id, granted again
    d.finished("local", Result(action_id="s", ok=True, value=42))
    assert _results(d.turn())["s"].value == 42
    assert d.core.figures()["sandbox_busy"]["backing_off"] == 0
    story = [why for *_, why, _ in d.core.story("s")]
    assert any("provider busy" in why for why in story)


def test_a_provider_busy_through_every_try_fails_as_infrastructure_not_a_reward() -> None:
    d = Driver(Limits(busy_first_s=1.0, busy_max_s=1.0, busy_tries=2))
    d.submit(ALICE, Action(id="s", kind="shell", affinity="S"))
    d.turn()
    for attempt in range(3):
        d.finished("local", _busy("s"))
        out = d.turn()
        if attempt < 2:
            d.now += 1.0
            d.core.wake(d.now)
            assert _runs(d.turn())
    failure = _results(out)["s"]
    assert failure.error_type == "sandbox_died" and "at capacity through 2 tries" in failure.message
    assert d.core.figures()["sandbox_busy"]["given_up"] == 1


def test_an_action_waiting_out_a_back_off_can_be_cancelled() -> None:
    d = Driver(Limits(busy_first_s=5.0))
    d.submit(ALICE, Action(id="s", kind="shell", affinity="S"))
    d.turn()
    d.finished("local", _busy("s"))
    d.turn()
    d.receive(ALICE, Cancel(action_ids=["s"]))
    assert _results(d.turn())["s"].error_type == "cancelled"
    d.now = 6.0
    d.core.wake(d.now)
    assert not _runs(d.turn())  # its back-off ended after it left: nothing starts


def _memory_core(reserve_mb: float) -> Lifecycle:
    core = Lifecycle(_registry(), ElasticScheduler(), sandbox_mem_mb=lambda image: reserve_mb)
    core.add_runner("local", Resources(cpu=8, mem_mb=1000), None)
    core.flush(0.0)
    return core


def test_live_sessions_hold_their_sandbox_memory_and_new_ones_wait_with_a_reason() -> None:
    core = _memory_core(400.0)
    actions = [Action(id=f"a{i}", kind="shell", affinity=f"S{i}") for i in range(3)]
    core.receive(ALICE, Submit(actions=actions), 0.0)
    started = [e.grant.action.id for e in core.flush(0.0) if hasattr(e, "grant")]
    core.validate_state()
    # shell demands 100 MiB while it runs, each session 400 MiB while it lives: two fit in 1000.
    assert sorted(started) == ["a0", "a1"]
    core.finished("local", [Result(action_id=a, ok=True) for a in started], 1.0)
    assert not [e for e in core.flush(1.0) if hasattr(e, "grant")]  # idle sandboxes still hold theirs
    memory = core.figures()["sandbox_memory"]
    assert memory["live_sessions"] == 2 and memory["new_sessions_waiting"] == 1
    assert memory["lent_mb"] == 800 and "wait for cores or memory" in memory["why"]
    core.receive(ALICE, CloseSessions(session_ids=["S0"]), 2.0)
    assert [e.grant.action.id for e in core.flush(2.0) if hasattr(e, "grant")] == ["a2"]
    core.validate_state()


def test_actions_without_a_session_reserve_no_sandbox_memory() -> None:
    core = _memory_core(400.0)
    core.receive(ALICE, Submit(actions=[Action(id=f"b{i}", kind="shell") for i in range(8)]), 0.0)
    started = [e for e in core.flush(0.0) if hasattr(e, "grant")]
    assert len(started) == 8  # 8 x 100 MiB of their own, nothing held for a session


def test_the_figures_reach_prometheus() -> None:
    from tangram_env.server.prometheus import families_from_figures

    d = Driver(Limits(busy_first_s=1.0))
    d.submit(ALICE, Action(id="s", kind="shell", affinity="S"))
    d.turn()
    d.finished("local", _busy("s"))
    d.turn()
    series = {
        sample.name: sample.value
        for family in families_from_figures(d.core.figures())
        for sample in family.samples
    }
    assert series["tangram_sandbox_busy_retries_total"] == 1
    assert series["tangram_sandbox_busy_backing_off"] == 1
    assert series["tangram_sandbox_memory_new_sessions_waiting"] == 0


def test_a_lockstep_batch_larger_than_memory_is_named_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    core = _memory_core(400.0)
    core.receive(
        ALICE, Submit(actions=[Action(id=f"a{i}", kind="shell", affinity=f"S{i}") for i in range(3)]), 0.0
    )
    started = [e.grant.action.id for e in core.flush(0.0) if hasattr(e, "grant")]
    core.finished("local", [Result(action_id=a, ok=True) for a in started], 1.0)
    core.flush(1.0)
    with caplog.at_level(logging.WARNING, logger="tangram_env.server.lifecycle"):
        for now in (2.0, 20.0):
            core.tick(now)
        assert not caplog.records  # not yet: a wait of seconds is ordinary
        core.tick(40.0)
    assert "1 new sandbox sessions wait" in caplog.text and "lower reserve_mb" in caplog.text
