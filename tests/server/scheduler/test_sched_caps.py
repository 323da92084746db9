"""Cluster-wide sandbox caps (live per image, creation rate per provider) and warm pools."""

from __future__ import annotations

import pytest

from tangram_env.server.scheduler import ElasticScheduler
from tangram_env.server.scheduler.caps import CapsConfig, SandboxCaps, best_keep_s
from tangram_env.server.scheduler.events import (
    ActionArrived,
    ActionFinished,
    ActionThrottled,
    ScalePool,
    SessionClosed,
    Tick,
    WorkerRemoved,
)
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


@pytest.mark.parametrize("recreated", [True, False])
def test_a_reset_that_recreates_the_sandbox_takes_a_creation_token(recreated: bool) -> None:
    # An e2b reset replaces the cloud sandbox: the pool's resets are creations the rate must count.
    caps = CapsConfig(
        creation_rate={"e2b": 1.0},
        creation_burst={"e2b": 2.0},
        warm_max_idle_s=float("inf"),
        recreated_on_reset=("e2b",) if recreated else (),
    )
    sched = ElasticScheduler(caps=caps)
    drive = Driver(sched)
    drive([worker("w", cpu=8)])

    def sessions(prefix: str, n: int) -> list[ActionArrived]:
        return [
            arrive(f"{prefix}{i}", kind="reset", affinity=f"{prefix}S{i}", image="img", provider="e2b")
            for i in range(n)
        ]

    drive(sessions("a", 2), 0.0)
    for i in range(2):  # the burst refilled by t=2; the two kept warm take it back
        drive([ActionFinished(f"a{i}", 1.0), SessionClosed(f"aS{i}")], 2.0)
    assert sched.caps.pool["img"] == 2
    out = drive(sessions("b", 3), 2.0)
    assert len(drive.starts(out)) == (2 if recreated else 3)  # the third needs a new sandbox
    if recreated:
        sched.caps.validate()
        assert sched.next_wakeup(2.0) == pytest.approx(3.0)
        assert len(drive.starts(drive([Tick()], 3.0))) == 1


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
    # It stays warm, under the cap (for as long as it takes: no creation was measured).
    assert caps.snapshot() == {"i": {"live": 0, "warm": 1, "sessionless": 0, "keep_s": None}}
    assert caps.admit("i", None, 2.0) and caps.start_session("i", 2.0) is True
    caps.drop_session("i")
    assert caps.cap("j") is None


def _gradings(tag: str, n: int, **kw: object) -> list:
    """``n`` session-less actions of image img, as the code env's gradings are."""
    return [arrive(f"{tag}{i}", kind="tests", image="img", **kw) for i in range(n)]


def test_a_burst_of_sessionless_actions_keeps_a_pool_of_its_size() -> None:
    sched = ElasticScheduler()
    drive = Driver(sched)
    drive([worker("w", cpu=8)])
    drive([arrive("bash", affinity="S", image="img")])  # one session of the image first
    drive([ActionFinished("bash", 0.1), SessionClosed("S")], 0.5)
    assert drive.book.pools == {"img": 1} and sched.caps.pool["img"] == 1
    for rnd in range(3):  # rounds of 8 gradings, each round after the last ended
        t = 1.0 + 10 * rnd
        out = drive(_gradings(f"g{rnd}.", 8), t)
        assert len(drive.starts(out)) == 8
        assert drive.book.pools == {"img": 8}  # the most that ran at once, not the one session
        drive([ActionFinished(f"g{rnd}.{i}", 0.5) for i in range(8)], t + 1)
        assert sched.caps.pool["img"] == 8  # every sandbox the round gave back stays warm
    assert sched.caps.created == 8  # the session's, and 7 more in the first round; none after
    window = sched.config.caps.pool_window_s
    drive([Tick()], 22.0 + window - 1)
    assert drive.book.pools == {"img": 8}  # the last burst is still within the window
    out = drive([Tick()], 22.0 + window + 1)
    assert ScalePool("img", 0) in out and sched.caps.pool["img"] == 0


def test_sessionless_actions_give_their_sandboxes_back_on_failure_throttle_and_worker_death() -> None:
    sched = ElasticScheduler()
    drive = Driver(sched)
    drive([worker("w0", cpu=4)])
    assert len(drive.starts(drive(_gradings("g", 4), 0.0))) == 4
    assert sched.caps.snapshot()["img"] == {"live": 4, "warm": 0, "sessionless": 4, "keep_s": None}
    out = drive([WorkerRemoved("w0")], 1.0)  # their sandboxes die with it: nothing to recycle
    assert len(drive.book.requeues) == 4 and not drive.starts(out)
    assert sched.caps.snapshot()["img"] == {"live": 0, "warm": 0, "sessionless": 0, "keep_s": None}
    out = drive([worker("w1", cpu=4)], 2.0)
    assert len(drive.starts(out)) == 4 and sched.caps.created == 8
    drive([ActionFinished(f"g{i}", 0.0, ok=False) for i in range(3)], 3.0)  # failures give back too
    assert sched.caps.snapshot()["img"] == {"live": 1, "warm": 3, "sessionless": 1, "keep_s": None}
    out = drive([ActionThrottled("g3", 0.0)], 4.0)  # taken back, its sandbox too; it starts again
    assert list(drive.starts(out)) == ["g3"] and sched.caps.created == 8  # in a warm one
    assert sched.caps.snapshot()["img"] == {"live": 1, "warm": 3, "sessionless": 1, "keep_s": None}
    drive([ActionFinished("g3", 0.1)], 5.0)
    assert sched.caps.snapshot()["img"] == {"live": 0, "warm": 4, "sessionless": 0, "keep_s": None}


def test_sessionless_actions_that_need_a_new_sandbox_pass_the_caps() -> None:
    caps = CapsConfig(max_live_per_image={"img": 2}, creation_rate={"e2b": 1.0}, creation_burst={"e2b": 1.0})
    sched = ElasticScheduler(caps=caps)
    drive = Driver(sched)
    drive([worker("w", cpu=8)])
    out = drive(_gradings("g", 4, provider="e2b"), 0.0)
    assert list(drive.starts(out)) == ["g0"]  # one creation token
    assert sched.next_wakeup(0.0) == pytest.approx(1.0)
    out = drive([Tick()], 1.0)
    assert list(drive.starts(out)) == ["g1"]
    out = drive([Tick()], 5.0)
    assert not drive.starts(out)  # tokens, but two live already: the image's cap
    out = drive([ActionFinished("g0", 1.0)], 6.0)
    assert list(drive.starts(out)) == ["g2"]  # the sandbox g0 gave back, warm: no creation
    assert sched.caps.created == 2


def test_the_sessionless_peak_leaves_the_window_only_once_it_has_ended() -> None:
    caps = SandboxCaps(CapsConfig(pool_window_s=100.0))
    for _ in range(3):
        caps.start_action("i", 0.0)
    for _ in range(3):
        caps.end_action("i", 50.0)  # three ran at once until t=50
    caps.start_action("i", 60.0)
    caps.end_action("i", 70.0)
    assert caps.target("i", 149.0) == 3
    assert caps.target("i", 151.0) == 1  # three held until 50; one until 70
    caps.start_action("i", 160.0)
    assert caps.target("i", 300.0) == 1  # one runs now
    caps.end_action("i", 301.0, lost=True)
    assert caps.target("i", 402.0) == 0
    caps.validate()
    assert caps.snapshot() == {"i": {"live": 0, "warm": 0, "sessionless": 0, "keep_s": None}}


def test_best_keep_time_weighs_a_saved_creation_against_the_time_kept() -> None:
    inf = float("inf")
    assert best_keep_s([inf] * 10, 60.0) == 0.0  # never wanted again: keeping only costs
    assert best_keep_s([10.0] * 10, 60.0) == 10.0  # each saves 60 s of keeping for 10 s kept
    assert best_keep_s([10.0] * 5 + [inf] * 5, 60.0) == 10.0  # half wasted for 10 s still pays
    assert best_keep_s([100.0] * 10, 60.0) == 0.0  # wanted only after more than a creation is worth
    assert best_keep_s([5.0, 5.0, 400.0, 400.0], 60.0) == 5.0  # worth it for the quick ones only


def _rounds(sched: ElasticScheduler, gap_s: float, rounds: int = 4, n: int = 8) -> tuple[Driver, list]:
    """``rounds`` bursts of ``n`` sessions of img (256 MiB idle, created cold in 3 s, 1 core + 1 GiB),
    each burst ``gap_s`` after the last one closed, on a 64-core pool with 4 GiB per core; the driver
    and the pools announced, with their times.
    """
    drive = Driver(sched)
    sizes: list = []
    drive([worker("w", cpu=64, mem=64 * 4096)])
    t = 0.0
    for r in range(rounds):
        drive(
            [
                arrive(
                    f"r{r}.{i}", kind="reset", mem=1024, affinity=f"S{r}.{i}", image="img", sandbox_mem_mb=256
                )
                for i in range(n)
            ],
            t,
        )
        t += 5.0
        drive([ActionFinished(f"r{r}.{i}", 1.0, setup_s=3.0) for i in range(n)], t)
        drive([SessionClosed(f"S{r}.{i}") for i in range(n)], t)
        closed, t = t, t + gap_s
        while (wake := sched.next_wakeup(closed)) is not None and closed < wake < t:
            out = drive([Tick()], wake)
            sizes += [(wake, d) for d in out if isinstance(d, ScalePool)]
            closed = wake
    return drive, sizes


def test_a_warm_sandbox_is_kept_only_while_keeping_it_pays() -> None:
    # A creation holds 1 core + 1 GiB (1.25 cores at 4 GiB per core) for 3 s; an idle sandbox holds
    # 256 MiB (1/16 core): keeping one warm pays for 3 x 1.25 x 16 = 60 s.
    sched = ElasticScheduler()
    _, _ = _rounds(sched, gap_s=20.0)
    assert sched.caps.keep_s("img") == pytest.approx(20.0)  # every sandbox was wanted again after 20 s
    assert sched.caps.created == 8  # the first burst's; every later one found them warm
    sched = ElasticScheduler()
    drive, _ = _rounds(sched, gap_s=300.0)
    assert sched.caps.keep_s("img") == 0.0  # wanted only after 300 s: cheaper to create them again
    assert sched.caps.snapshot()["img"]["keep_s"] == 0.0  # what the orchestrator's stats show
    assert sched.caps.created == 32 and drive.book.pools == {"img": 0}
    assert sched.caps.pool["img"] == 0
    sched.validate_state()


def test_warm_sandboxes_expire_after_the_break_even_until_reuses_are_seen() -> None:
    sched = ElasticScheduler()
    _, sizes = _rounds(sched, gap_s=300.0, rounds=1, n=4)
    # One burst of 4: no reuse seen yet, so they were kept for the break-even (60 s), then destroyed.
    assert sizes[0] == (pytest.approx(65.0), ScalePool("img", 4, expire=4))  # closed at 5 s
    assert sched.caps.pool["img"] == 0 and sched.caps.keep_s("img") == pytest.approx(60.0)


def test_sandboxes_unwanted_past_the_break_even_teach_the_pool_at_once() -> None:
    # 16 sessions of one burst close 5 s apart (1 core + 1 GiB created in 3 s, 256 MiB idle: keeping one
    # pays for 60 s). None is wanted again: once 8 have waited 60 s (the 8th closed at 40 s, so at
    # 100 s), keeping pays for none, and the 8 still warm go then, not each 60 s after its close.
    sched = ElasticScheduler()
    drive = Driver(sched)
    drive([worker("w", cpu=64, mem=64 * 4096)])
    drive(
        [
            arrive(f"r{i}", kind="reset", mem=1024, affinity=f"S{i}", image="img", sandbox_mem_mb=256)
            for i in range(16)
        ]
    )
    drive([ActionFinished(f"r{i}", 1.0, setup_s=3.0) for i in range(16)], 4.0)
    t, pools = 0.0, []
    for i in range(16):
        t = 5.0 * (i + 1)
        pools += [(t, d) for d in drive([SessionClosed(f"S{i}")], t) if isinstance(d, ScalePool)]
    while (wake := sched.next_wakeup(t)) is not None and wake < 300.0:
        t = wake
        pools += [(t, d) for d in drive([Tick()], t) if isinstance(d, ScalePool)]
    expired = [(at, d) for at, d in pools if d.expire]
    assert expired[:7] == [
        (pytest.approx(60.0 + 5.0 * i), ScalePool("img", 16, expire=1)) for i in range(1, 8)
    ]
    # the 8th with the 8 still warm, 5-40 s before their break-even
    assert expired[7:] == [(pytest.approx(100.0), ScalePool("img", 0, expire=9))]
    assert sched.caps.keep_s("img") == 0.0 and sched.caps.pool["img"] == 0 and drive.book.pools == {"img": 0}
    sched.validate_state()


def test_a_fixed_warm_idle_limit() -> None:
    sched = ElasticScheduler(caps=CapsConfig(warm_max_idle_s=5.0))
    drive = Driver(sched)
    drive([worker("w", cpu=8)])
    drive([arrive("r", kind="reset", affinity="S", image="img")], 0.0)
    drive([ActionFinished("r", 1.0, setup_s=3.0), SessionClosed("S")], 2.0)
    assert sched.caps.pool["img"] == 1
    assert sched.next_wakeup(2.0) == pytest.approx(7.0)
    out = drive([Tick()], 7.0)
    assert out == [ScalePool("img", 1, expire=1)]  # destroyed; the next one given back may be kept
    assert sched.caps.pool["img"] == 0 and sched.next_wakeup(7.0) is None


@pytest.mark.parametrize(("provider", "keep_s"), [("e2b", 3.0), ("local", float("inf"))])
def test_a_sandbox_billed_while_it_lives_is_kept_for_its_creation_time(provider: str, keep_s: float) -> None:
    # e2b sandboxes take none of a runner's memory (sandbox_mem_mb 0) but are billed every second they
    # live, warm or busy: keeping one pays only for the creation (3 s) a reuse saves. A local sandbox
    # declared free to keep (no idle memory) is kept until taken.
    sched = ElasticScheduler()
    drive = Driver(sched)
    drive([worker("w", cpu=8)])
    drive([arrive("r", kind="reset", affinity="S", image="img", provider=provider)], 0.0)
    drive([ActionFinished("r", 1.0, setup_s=3.0), SessionClosed("S")], 4.0)
    assert sched.caps.pool["img"] == 1 and sched.caps.keep_s("img") == keep_s
    if provider == "e2b":
        assert sched.next_wakeup(4.0) == pytest.approx(7.0)
        assert drive([Tick()], 7.0) == [ScalePool("img", 1, expire=1)]
        assert sched.caps.pool["img"] == 0
    else:
        assert sched.next_wakeup(4.0) is None


def test_sandboxes_wanted_soon_after_the_break_even_still_count_as_wanted() -> None:
    # Keeping one pays for 60 s. The last 10 given back were wanted after 50 s; these 10 wait longer.
    # Waiting past 60 s they count as if taken now (the most they could still save), not as never
    # wanted: kept 60 s, 10 each save 10 s on the first round and cost nothing more on this one,
    # where keeping none would have forgone that. Taken at 65 s, they are kept that long next time.
    caps = SandboxCaps()
    caps.observe_creation("i", 60.0, 0.0)
    t = 0.0
    for delay in (50.0, None):
        for _ in range(10):
            caps.start_session("i", t)
        caps.rebalance(t + 1.0)
        for _ in range(10):
            caps.close_session("i", t + 1.0)
        if delay is not None:
            t += 1.0 + delay
    caps.rebalance(t + 1.0 + 60.0)
    assert caps.keep_s("i") == pytest.approx(60.0)  # not 0: a reuse at 60 s or later is still possible
    for _ in range(10):
        caps.start_session("i", t + 1.0 + 65.0)
    assert caps.keep_s("i") == pytest.approx(65.0)
