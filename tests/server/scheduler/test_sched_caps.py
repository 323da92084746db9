"""Cluster-wide sandbox caps (live per image, creation rate per provider) and warm pools."""

from __future__ import annotations

import pytest

from tangram_env.server.scheduler import ElasticScheduler
from tangram_env.server.scheduler.caps import CapsConfig, SandboxCaps
from tangram_env.server.scheduler.events import ActionFinished, ScalePool, SessionClosed, Tick
from tests.server.scheduler.sched_helpers import Driver, arrive, worker


def test_live_sandboxes_per_image_are_capped_across_workers() -> None:
    sched = ElasticScheduler(caps=CapsConfig(max_live_per_image={"img": 2}))
    drive = Driver(sched)
    drive([worker(f"w{i}", cpu=4) for i in range(3)])
    out = drive([arrive(f"a{i}", affinity=f"S{i}", image="img") for i in range(4)] + [arrive("free")])
    started = set(drive.starts(out))
    assert started == {"a0", "a1", "free"}  # two sessions of img at most, whichever worker hosts them
    assert sched.caps.live["img"] == 2
    drive([ActionFinished("a0", 1.0)], 1.0)
    assert sched.pending() == 2  # finishing an action does not end its session
    out = drive([SessionClosed("S0")], 2.0)
    assert set(drive.starts(out)) == {"a2"}
    # Other images are not limited by img's cap.
    assert "b" in drive.starts(drive([arrive("b", affinity="T", image="other")], 3.0))


def test_creation_rate_is_a_token_bucket_per_provider() -> None:
    caps = CapsConfig(creation_rate={"e2b": 2.0}, creation_burst={"e2b": 2.0}, warm_pool=False)
    sched = ElasticScheduler(caps=caps)
    drive = Driver(sched)
    drive([worker("w", cpu=64, mem=1e6)])
    arrivals = [arrive(f"a{i}", affinity=f"S{i}", image="img", provider="e2b") for i in range(6)]
    arrivals += [arrive(f"l{i}", affinity=f"L{i}", image="img2") for i in range(4)]  # local: unlimited
    out = drive(arrivals, 0.0)
    assert sum(a.startswith("a") for a in drive.starts(out)) == 2  # the burst
    assert sum(a.startswith("l") for a in drive.starts(out)) == 4
    wake = sched.next_wakeup(0.0)
    assert wake == pytest.approx(0.5)  # the next token
    out = drive([Tick()], 0.5)
    assert sum(a.startswith("a") for a in drive.starts(out)) == 1
    out = drive([Tick()], 1.5)
    assert sum(a.startswith("a") for a in drive.starts(out)) == 2
    assert sched.caps.created == 9


def test_warm_pool_keeps_closed_sandboxes_for_the_next_burst() -> None:
    sched = ElasticScheduler()
    drive = Driver(sched)
    drive([worker("w", cpu=8)])
    drive([arrive(f"r{i}", kind="reset", affinity=f"S{i}", image="img") for i in range(4)])
    assert drive.book.pools == {"img": 4}  # four sessions started recently: keep up to four warm
    for i in range(4):
        drive([ActionFinished(f"r{i}", 1.0, setup_s=3.0), SessionClosed(f"S{i}")], 10.0)
    assert sched.caps.pool["img"] == 4 and sched.caps.created == 4
    drive([arrive(f"n{i}", kind="reset", affinity=f"N{i}", image="img") for i in range(5)], 20.0)
    assert sched.caps.created == 5  # four from the pool, one new
    assert sched.caps.pool["img"] == 0
    # Long after the burst the pool shrinks.
    out = drive([Tick()], 20.0 + sched.config.caps.pool_window_s + 1)
    assert ScalePool("img", 0) in out


def test_caps_bookkeeping_alone() -> None:
    caps = SandboxCaps(CapsConfig(max_live_per_image={"i": 1}))
    assert caps.admit("i", None, 0.0)
    assert caps.start_session("i", 0.0) is False
    assert not caps.admit("i", None, 0.0)
    caps.rebalance(0.0)
    caps.close_session("i", 1.0)
    caps.validate()
    assert caps.snapshot() == {"i": {"live": 0, "warm": 0}}  # the target (1) leaves no room under the cap
    caps.drop_session("i")
    assert caps.cap("j") is None
