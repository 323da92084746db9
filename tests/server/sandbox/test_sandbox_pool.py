"""The warm pool on real local sandboxes: reuse, sessions, sizing, broken sandboxes, figures."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from tangram_env import Action, ActionContext, Client
from tangram_env.kinds import KindRegistry, tool
from tangram_env.sandbox import SandboxBroken, SandboxError, SandboxRequestError, SandboxSpec
from tangram_env.server.config import ServerSettings
from tangram_env.server.sandbox import SandboxPool, build_image
from tangram_env.server.sandbox.local import LocalProvider, LocalSandbox
from tests.server.helpers import serving
from tests.server.sandbox.helpers import SMALL


class Clock:
    """A hand-driven clock for the idle delay (the pool takes ``clock=``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Nothing(BaseModel):
    pass


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def pool(provider: LocalProvider, clock: Clock) -> Iterator[SandboxPool]:
    made = SandboxPool(provider, spec_for_image=lambda image: SMALL, max_idle_s=30, clock=clock)
    yield made
    made.close()


def test_release_resets_and_reuses(pool: SandboxPool) -> None:
    first = pool.acquire()
    first.write_file("left-over.txt", "from the previous trajectory")
    pool.release(first)
    second = pool.acquire()
    assert second is first  # warm: the same sandbox, not a new one
    with pytest.raises(FileNotFoundError):
        second.read_file("left-over.txt")
    stats = pool.stats()
    assert (stats["created"], stats["cold_starts"], stats["warm_hits"], stats["resets"]) == (1, 1, 1, 1)
    pool.release(second)


def test_sessions_keep_their_sandbox(pool: SandboxPool) -> None:
    a = pool.acquire(session="traj-a")
    a.write_file("state.txt", "step 1")
    b = pool.acquire(session="traj-b")
    assert b is not a
    assert pool.acquire(session="traj-a") is a  # affinity: same sandbox, same files
    assert a.read_file("state.txt") == b"step 1"
    assert pool.session("traj-a") is a and pool.stats()["sessions"] == 2
    pool.end_session("traj-a")
    assert pool.session("traj-a") is None
    reused = pool.acquire(session="traj-c")
    assert reused is a and reused.exec("ls").stdout == ""  # reset between trajectories
    pool.end_session("unknown")  # no-op


def test_a_session_cannot_change_image(pool: SandboxPool, provider: LocalProvider) -> None:
    pool.acquire(session="s")
    with pytest.raises(SandboxRequestError, match="image"):
        pool.acquire("other-image", session="s")


def test_scale_grows_now_and_shrinks_after_idle(pool: SandboxPool, clock: Clock) -> None:
    pool.scale("default", 3)
    assert pool.stats()["images"]["default"] == {"warm": 3, "in_use": 0, "target": 3}
    pool.scale("default", 1)
    assert pool.stats()["images"]["default"]["warm"] == 3  # not yet: they have not been idle long
    clock.now += 31
    pool.maintain()
    assert pool.stats()["images"]["default"]["warm"] == 1
    assert pool.stats()["shrunk"] == 2
    with pytest.raises(SandboxRequestError):
        pool.scale("default", -1)


def test_keep_recycles_released_sandboxes_up_to_its_size_and_creates_none(pool: SandboxPool) -> None:
    # The scheduler's ScalePool: its caps count every creation, so the pool must not make its own.
    pool.keep("default", 1)
    assert pool.stats()["created"] == 0 and pool.stats()["images"]["default"]["warm"] == 0
    held = [pool.acquire(session=f"s{i}") for i in range(3)]
    assert pool.stats()["created"] == 3
    for i in range(3):
        pool.end_session(f"s{i}")
    stats = pool.stats()
    assert stats["images"]["default"] == {"warm": 1, "in_use": 0, "target": 1}
    assert stats["closed"] == 2  # at once, not after an idle period
    assert stats["resets"] == 1  # only the one kept: the others were closed without a wasted reset
    kept = pool.acquire()
    assert kept is held[0]  # the first released, reset
    pool.discard(kept, "sandbox_died: test")
    pool.maintain()
    assert pool.stats()["created"] == 3  # a broken one is not replaced either
    pool.release(pool.acquire())
    pool.keep("default", 0)
    assert pool.stats()["images"]["default"]["warm"] == 0


def test_released_sandboxes_above_target_linger_then_close(pool: SandboxPool, clock: Clock) -> None:
    held = [pool.acquire() for _ in range(2)]
    for sb in held:
        pool.release(sb)
    assert pool.stats()["images"]["default"]["warm"] == 2
    clock.now += 31
    pool.maintain()
    assert pool.stats()["images"]["default"]["warm"] == 0 and pool.stats()["closed"] == 2


def test_discard_replaces_to_target(pool: SandboxPool) -> None:
    pool.scale("default", 1)
    sb = pool.acquire(session="s")
    assert pool.stats()["images"]["default"] == {"warm": 0, "in_use": 1, "target": 1}
    pool.maintain()  # refilling waits for the loop's next tick, not the acquire
    assert pool.stats()["images"]["default"] == {"warm": 1, "in_use": 1, "target": 1}
    pool.discard(sb, "sandbox_died: the action killed it")
    pool.discard(sb, "sandbox_died: and another path found it broken too")  # let go already: nothing
    stats = pool.stats()
    assert stats["discarded"] == 1 and stats["discard_reasons"] == {"sandbox_died": 1}
    assert stats["sessions"] == 0 and stats["images"]["default"] == {"warm": 1, "in_use": 0, "target": 1}
    # The session's files went with it: it fails until it ends, then its id starts afresh.
    with pytest.raises(SandboxBroken, match="lost its sandbox"):
        pool.acquire(session="s")
    with pytest.raises(SandboxBroken, match="lost its sandbox"):
        pool.held("s")  # the loop's fast path says so too
    pool.end_session("s")
    assert pool.acquire(session="s") is not sb
    assert sb.health() == "closed"


def test_a_broken_sandbox_is_not_reused(pool: SandboxPool) -> None:
    sb = pool.acquire()
    assert isinstance(sb, LocalSandbox) and sb.agent is not None
    sb.agent.proc.kill()  # break it for real: the process its commands run through is gone
    sb.agent.proc.wait()
    with pytest.raises(SandboxBroken) as info:
        sb.exec("true")
    pool.release(sb)  # the executor gives it back; the pool sees it is broken
    assert pool.stats()["discarded"] == 1 and pool.stats()["images"]["default"]["warm"] == 0
    assert info.value.reason in sb.health() or sb.health() == "closed"
    fresh = pool.acquire()
    assert fresh is not sb and fresh.exec("echo ok").stdout == "ok\n"


def test_foreign_sandbox_is_refused(pool: SandboxPool, provider: LocalProvider) -> None:
    stranger = provider.create(SMALL)
    try:
        with pytest.raises(SandboxRequestError, match="not lent"):
            pool.release(stranger)
    finally:
        stranger.close()


def test_spec_for_image_gives_the_limits(provider: LocalProvider) -> None:
    pool = SandboxPool(provider, spec_for_image=lambda image: SandboxSpec(mem_mb=128, max_pids=32))
    try:
        sb = pool.acquire()
        assert sb.spec.mem_mb == 128 and sb.spec.image == "default"
    finally:
        pool.close()


def test_close_closes_everything(provider: LocalProvider, clock: Clock) -> None:
    pool = SandboxPool(provider, spec_for_image=lambda image: SMALL, clock=clock)
    pool.scale("default", 2)
    lent = pool.acquire(session="s")
    dirs = [lent.dir, *(sb.dir for sb, _ in pool._images["default"].warm)]
    pool.close()
    assert not any(os.path.exists(d) for d in dirs)
    with pytest.raises(SandboxError, match="closed"):
        pool.acquire()
    pool.release(lent)  # an action that finishes after shutdown is simply closed


def test_images_with_files_reset_in_the_background(
    provider: LocalProvider, image_dir: Path, tmp_path: Path, clock: Clock
) -> None:
    source = tmp_path / "tree"
    for i in range(300):
        (source / f"d{i % 7}").mkdir(parents=True, exist_ok=True)
        (source / f"d{i % 7}" / f"f{i}.txt").write_text(f"{i}\n" * 50)
    build_image("bg-tree", from_dir=source, root=image_dir)
    pool = SandboxPool(provider, spec_for_image=lambda image: SMALL, clock=clock)
    try:
        sb = pool.acquire("bg-tree")
        sb.exec("rm -rf d0; echo agent > d1/f1.txt")
        started = time.perf_counter()
        pool.release(sb)
        returned_in = time.perf_counter() - started
        assert pool._resetting  # handed to a child: the caller's loop did not wait for the copy
        deadline = time.monotonic() + 10
        while pool.stats()["resetting"] and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = pool.stats()
        assert stats["resetting"] == 0 and stats["resets"] == 1 and stats["images"]["bg-tree"]["warm"] == 1
        again = pool.acquire("bg-tree")
        assert again is sb
        assert again.exec("ls d0 | wc -l; cat d1/f1.txt | head -1").stdout.split() == ["43", "1"]
        assert returned_in < 1.0
    finally:
        pool.close()


def _slowed(sandbox: Any, method: str, delay_s: float) -> threading.Event:
    """Make the real ``sandbox.method`` take ``delay_s`` longer (a large image's copy, an e2b create);
    the event is set when a call starts."""
    real, started = getattr(sandbox, method), threading.Event()

    def slow(*args: Any) -> Any:
        started.set()
        time.sleep(delay_s)
        return real(*args)

    setattr(sandbox, method, slow)
    return started


def _fast(call: Any, *args: Any) -> Any:
    """``call(*args)``, which must answer at once (well within a slow provider call)."""
    started = time.monotonic()
    answer = call(*args)
    assert time.monotonic() - started < 0.5, f"{call.__name__} waited {time.monotonic() - started:.1f}s"
    return answer


def test_a_slow_reset_holds_up_no_other_session(pool: SandboxPool) -> None:
    # The pool held its one lock through each reset (an e2b reset is a create: seconds): every other
    # session's next command, even one holding its sandbox already, waited for it.
    mine = pool.acquire(session="mine")
    other = pool.acquire(session="other")
    spare = pool.acquire()
    pool.release(spare)  # warm
    resetting = _slowed(other, "reset", 2.0)
    releasing = threading.Thread(target=pool.end_session, args=("other",))
    releasing.start()
    assert resetting.wait(5)
    assert _fast(pool.held, "mine") is mine
    assert _fast(pool.acquire, "default", "mine") is mine
    assert _fast(pool.acquire, "default", "third") is spare  # a warm one, not the one being reset
    figures = _fast(pool.stats)
    assert figures["resetting"] == 1 and figures["images"]["default"] == {"warm": 0, "in_use": 2, "target": 0}
    assert pool.acquire() is other  # none warm: it waits for the reset under way rather than make one
    releasing.join()
    stats = pool.stats()
    assert stats["resetting"] == 0 and stats["created"] == 3 and stats["resets"] == 2


def test_a_slow_health_check_holds_up_no_other_session_and_lends_nothing_twice(pool: SandboxPool) -> None:
    mine = pool.acquire(session="mine")
    warm = pool.acquire()
    pool.release(warm)
    checking = _slowed(warm, "health", 2.0)
    taken: list[Any] = []
    taking = threading.Thread(target=lambda: taken.append(pool.acquire(session="slow")))
    taking.start()
    assert checking.wait(5)
    assert _fast(pool.held, "mine") is mine
    fresh = pool.acquire(session="fresh")  # the warm one is being checked: not lent a second time
    assert fresh is not warm and fresh is not mine
    taking.join()
    assert taken == [warm] and pool.held("slow") is warm


@contextlib.contextmanager
def _served(provider: LocalProvider, caps: dict[str, Any]) -> Iterator[tuple[Client, SandboxPool]]:
    """An orchestrator whose pool makes ``provider``'s sandboxes, its scheduler's caps set to ``caps``,
    serving ``in_sandbox`` (a command in its sandbox); a client of it, and the pool."""
    reg = KindRegistry()

    @tool(name="in_sandbox", cpu=0.1, mem_mb=16, timeout_s=30, placement="sandbox", registry=reg)
    def in_sandbox(args: Nothing, ctx: ActionContext) -> str:
        return str(ctx.sandbox.exec("echo hi").stdout).strip()

    pool = SandboxPool(provider, spec_for_image=lambda image: SMALL)
    settings = ServerSettings(
        bind="tcp://127.0.0.1:0",
        cpus=2,
        mem_mb=4096,
        entry_point_plugins=False,
        scheduler_options={"caps": caps},
    )
    with serving(settings, reg, pool) as orchestrator, Client(orchestrator.address) as client:
        yield client, pool


def test_sessionless_bursts_after_a_session_reuse_their_sandboxes(provider: LocalProvider) -> None:
    """Through the orchestrator: a session of an image, then rounds of 8 session-less actions of it
    (the ``code`` env's gradings). The scheduler sizes the pool by the most that ran at once, so every
    round after the first finds its sandboxes warm: none is closed, none created again. (Sandboxes are
    kept until taken here; how long keeping one pays is the next test's.)"""
    with _served(provider, {"warm_max_idle_s": 1e9}) as (client, pool):
        assert client.submit([Action(kind="in_sandbox", affinity="S")])[0].result(30).value == "hi"
        client.close_sessions(["S"])
        created: list[int] = []
        for _ in range(4):
            futures = client.submit([Action(kind="in_sandbox") for _ in range(8)])
            assert all(f.result(30).value == "hi" for f in futures)
            stats = pool.stats()
            assert stats is not None
            created.append(stats["created"])
    assert stats["closed"] == 0, stats  # nothing closed only to be created again
    assert created[0] <= 9 and created[1:] == [created[0]] * 3, created
    assert stats["images"]["default"]["target"] == 8, stats


def test_the_orchestrator_destroys_warm_sandboxes_once_keeping_them_no_longer_pays(
    provider: LocalProvider,
) -> None:
    """Through the orchestrator, with a fixed keeping time of 1 s: a session's sandbox given back is
    kept warm, then destroyed by the pool once it has waited that long; the next session creates one."""
    with _served(provider, {"warm_max_idle_s": 1.0}) as (client, pool):
        assert client.submit([Action(kind="in_sandbox", affinity="S")])[0].result(30).value == "hi"
        client.close_sessions(["S"])
        deadline = time.monotonic() + 10
        while (stats := pool.stats()) is not None and stats["images"]["default"]["warm"] == 0:
            assert time.monotonic() < deadline, stats  # reset and kept warm first
            time.sleep(0.02)
        while (stats := pool.stats()) is not None and stats["shrunk"] == 0:
            assert time.monotonic() < deadline, stats  # then destroyed after 1 s
            time.sleep(0.05)
        assert stats["images"]["default"]["warm"] == 0 and stats["closed"] == 1, stats
        assert client.submit([Action(kind="in_sandbox", affinity="T")])[0].result(30).value == "hi"
        assert pool.stats()["created"] == 2  # nothing warm was left to take
        assert client.stats()["sandbox_images"]["default"]["keep_s"] == 1.0


def test_the_orchestrators_provider_is_the_one_whose_creation_rate_binds(
    provider: LocalProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``creation_rate`` names providers (e2b's API limits how fast sandboxes are made); the
    orchestrator never told the scheduler which provider its pool uses, so every creation counted as
    "local" and a cloud provider's rate never bound."""
    monkeypatch.setattr(provider, "name", "cloudy")  # a provider with a rate limit
    caps = {"creation_rate": {"cloudy": 2.0}, "creation_burst": {"cloudy": 1.0}, "warm_pool": False}
    with _served(provider, caps) as (client, _pool):
        t0 = time.monotonic()
        futures = client.submit([Action(kind="in_sandbox", affinity=f"S{i}") for i in range(3)])
        assert all(f.result(30).value == "hi" for f in futures)
        # One creation at once, then one every 0.5 s: the third sandbox is made a second in.
        assert time.monotonic() - t0 >= 0.9


def test_an_ended_sessions_id_is_free_before_its_sandbox_is_reset(pool: SandboxPool) -> None:
    # The ending ran on a set-up thread alone: the same id used again before it ran found the old
    # session's lost mark (CI saw it), or its sandbox with the old files.
    kept = pool.acquire(session="s")
    kept.write_file("old.txt", "the ended session's")
    lost = pool.acquire(session="t")
    pool.discard(lost, "sandbox_died: the agent exited")
    later: list[tuple[object, ...]] = []
    pool.end_sessions_soon(["s", "t"], lambda *call: later.append(call))  # the set-up thread is slow
    assert pool.held("s") is None and pool.held("t") is None  # neither the old sandbox nor "lost"
    ((reset, *args),) = later
    reset(*args)  # the set-up thread gets to it (an acquire meanwhile waits for it, as for any reset)
    again = pool.acquire(session="t")
    assert again is kept and again.exec("ls").stdout == ""  # the ended sandbox, reset
