"""Cluster-wide sandbox caps and warm pools: live sandboxes per image, creations per second per provider.

Cloud sandbox providers limit how many sandboxes may be alive and how fast new ones may be created;
those limits hold across every host, so the scheduler enforces them, not each worker. A *live*
sandbox is one lent (to a session, or to a session-less action while it runs) or waiting warm in the
pool of its image. A session that starts, or a session-less action of an image, takes a warm sandbox
when the pool has one (no creation), else creates one (one token of its provider's bucket, and room
under the image's cap). A closed session's sandbox, or the one a session-less action ran in, is reset
and kept warm while the pool holds fewer than its size (:class:`~.events.ScalePool`); pools never
create sandboxes of their own, so every creation passes through the caps. The size is the larger of
the number of sessions of that image started within the last ``pool_window_s`` and the most
session-less actions of that image that ran at once within it: RL steps start their trajectories
(and grade them) in bursts, and the last burst predicts the next.
"""

from __future__ import annotations

import math
from collections import deque

from pydantic import BaseModel, ConfigDict, Field

from tangram_env.server.scheduler.events import ScalePool

DEFAULT_PROVIDER = "local"


class CapsConfig(BaseModel):
    """Limits on sandboxes that hold across all workers, and warm-pool sizing."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_live_per_image: dict[str, int] = Field(
        default_factory=dict, description="image -> live sandboxes at most"
    )
    default_max_live: int | None = Field(None, ge=1, description="cap of images not listed; None: unlimited")
    creation_rate: dict[str, float] = Field(
        default_factory=dict,
        description="provider -> sandbox creations per second; a provider not listed: unlimited",
    )
    creation_burst: dict[str, float] = Field(
        default_factory=dict, description="provider -> creations allowed at once (default: max(1, rate))"
    )
    warm_pool: bool = Field(True, description="keep sandboxes given back warm for the next ones to start")
    pool_window_s: float = Field(
        1800.0,
        gt=0,
        description="sessions started, and session-less actions running at once, within it size the pool",
    )
    max_pool: int = Field(256, ge=0, description="warm sandboxes per image at most")
    billed_alive: tuple[str, ...] = Field(
        ("e2b",),
        description="providers that bill a sandbox for every second it lives, warm or busy: keeping one "
        "warm costs what running it does, so it pays only for about its creation time",
    )
    recreated_on_reset: tuple[str, ...] = Field(
        ("e2b",),
        description="providers whose reset replaces the sandbox with a new one: a sandbox kept warm takes "
        "a creation token (borrowed when none is left, so that new sandboxes wait until the rate repays it)",
    )
    warm_max_idle_s: float | None = Field(
        None,
        ge=0,
        description="how long a sandbox given back stays warm before it is destroyed. None: learned per "
        "image, the time that would have saved the most over the recent delays after which sandboxes "
        "given back were wanted again, where one kept warm holds its idle memory and one created holds "
        "the opening action's grant for the measured creation time (each resource valued at the pool's "
        "own ratio to its cores); inf: until it is taken or the pool shrinks",
    )


class _Bucket:
    """A token bucket: ``rate`` tokens per second, at most ``burst`` saved."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.tokens, self.stamp = rate, burst, burst, now

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + self.rate * (now - self.stamp))
            self.stamp = now

    def next_token_at(self) -> float:
        return self.stamp + max(0.0, 1.0 - self.tokens) / self.rate


class _Lent:
    """Sandboxes of one image lent to session-less actions: how many now, and the most within a window.

    ``marks`` holds (time, count) pairs, counts falling from left to right: a count followed by one as
    large can never again be the window's most. A count is stamped when it is reached and again when it
    ends, so it leaves the window only once it has not held for a whole window. O(1) amortised.
    """

    __slots__ = ("marks", "running")

    def __init__(self) -> None:
        self.running = 0
        self.marks: deque[tuple[float, int]] = deque()

    def _mark(self, now: float) -> None:
        marks, n = self.marks, self.running
        while marks and marks[-1][1] <= n:
            marks.pop()
        marks.append((now, n))

    def up(self, now: float) -> None:
        self.running += 1
        self._mark(now)

    def down(self, now: float) -> None:
        self._mark(now)  # the count that ends now held until now
        self.running -= 1

    def peak(self, horizon: float) -> int:
        """The most lent at once since ``horizon``."""
        marks = self.marks
        while marks and marks[0][0] < horizon:
            marks.popleft()
        return max(self.running, marks[0][1] if marks else 0)


#: Reuse delays remembered per image, and how many are needed before they replace the break-even.
_DELAYS_KEPT = 256
_DELAYS_NEEDED = 8


def best_keep_s(delays: list[float], pays_s: float) -> float:
    """How long to keep a sandbox warm to save the most, given the delays after which sandboxes given
    back were wanted again (``inf``: never): one wanted within the time saves a creation, worth
    ``pays_s`` seconds of keeping one warm, and every one costs the time it is kept. 0: don't keep.
    """
    ds = sorted(delays)
    n = len(ds)
    best_t, best_gain, spent = 0.0, 0.0, 0.0
    for j, d in enumerate(ds, 1):
        if d == math.inf:
            break
        spent += d
        gain = pays_s * j - spent - (n - j) * d  # kept up to d: the first j reused, the rest wasted d each
        if gain > best_gain:
            best_t, best_gain = d, gain
    return best_t


class _Reuse:
    """When sandboxes of one image given back are wanted again, seen through a virtual pool that keeps
    every one (taken newest first by each start, as the real pool is), so that what is learned does not
    depend on what was kept; and from it, how long keeping one warm pays.

    A sandbox still waiting in the virtual pool past the break-even counts as if it were taken now: for
    a keeping time up to its wait so far that is exact (it was not wanted within it), and beyond, it is
    the most it could still save, so the pool errs towards keeping. Counting it then, not only once it
    is taken or forgotten, lets a burst of give-backs nobody takes teach the pool before the next burst
    comes: once 8 have waited past the break-even, no keeping time pays.
    """

    __slots__ = ("_keep", "aged_at", "backs", "delays", "overdue", "pays_s")

    def __init__(self) -> None:
        self.backs: deque[float] = deque()  # give-back times in the virtual pool, oldest first
        self.delays: deque[float] = deque(maxlen=_DELAYS_KEPT)
        self.overdue = 0  # the oldest this many of ``backs`` have waited past the break-even
        self.aged_at = 0.0  # when ``overdue`` was counted
        self.pays_s: float | None = None  # keeping one this long costs what creating one holds
        self._keep: float | None = None  # cached best keeping time

    def given_back(self, now: float, size: int) -> None:
        self.backs.append(now)
        while len(self.backs) > size:  # the virtual pool is as large as the real one may be
            self._wasted()

    def started(self, now: float) -> None:
        if self.backs:
            self.delays.append(now - self.backs.pop())
            self.overdue = min(self.overdue, len(self.backs))
            self._keep = None

    def forget_before(self, horizon: float) -> None:
        while self.backs and self.backs[0] < horizon:
            self._wasted()

    def _wasted(self) -> None:
        self.backs.popleft()
        self.overdue = max(0, self.overdue - 1)
        self.delays.append(math.inf)
        self._keep = None

    def age(self, now: float) -> None:
        """Count the sandboxes that have waited past the break-even by ``now``, and how long they have."""
        if self.pays_s is None:
            return
        backs, n = self.backs, self.overdue
        while n < len(backs) and now - backs[n] >= self.pays_s:
            n += 1
        if n or self.overdue:  # their waits grew
            self.overdue, self._keep = n, None
        self.aged_at = now

    def next_overdue(self) -> float | None:
        """When the next sandbox waiting in the virtual pool passes the break-even (None: none waits)."""
        if self.pays_s is None or self.overdue >= len(self.backs):
            return None
        return self.backs[self.overdue] + self.pays_s

    def observe_creation(self, pays_s: float, now: float) -> None:
        self.pays_s = pays_s if self.pays_s is None else 0.8 * self.pays_s + 0.2 * pays_s
        self.overdue, self._keep = 0, None
        self.age(now)  # counted again against the new break-even

    def keep_s(self) -> float:
        """Inf until a creation was measured; its break-even until enough reuses were seen."""
        if self.pays_s is None:
            return math.inf
        if self._keep is None:
            backs, now = self.backs, self.aged_at
            delays = [*self.delays, *(now - backs[i] for i in range(self.overdue))]
            self._keep = self.pays_s if len(delays) < _DELAYS_NEEDED else best_keep_s(delays, self.pays_s)
        return self._keep


class SandboxCaps:
    """Live sandboxes per image, creation tokens per provider and the warm pool of each image."""

    def __init__(self, config: CapsConfig | None = None) -> None:
        self.config = config or CapsConfig()
        self.live: dict[str, int] = {}  # image -> sandboxes lent to sessions and session-less actions
        # image -> when each of its warm sandboxes was given back, oldest first (taken newest first,
        # destroyed oldest first, as the orchestrator's pool does)
        self._warm: dict[str, deque[float]] = {}
        self._reuse: dict[str, _Reuse] = {}
        self._announced: dict[str, int] = {}  # image -> size in the last ScalePool
        self._starts: dict[str, deque[float]] = {}  # image -> recent session start times
        self._lent: dict[str, _Lent] = {}  # image -> sandboxes lent to session-less actions
        self._provider: dict[str, str] = {}
        self._buckets: dict[str, _Bucket] = {}
        self._starved: set[str] = set()  # images that wait for a creation token
        self.created = 0  # sandboxes created on this scheduler's word (for tests and reports)

    @property
    def pool(self) -> dict[str, int]:
        """Image -> its warm sandboxes."""
        return {image: len(warm) for image, warm in self._warm.items()}

    def _warm_count(self, image: str) -> int:
        warm = self._warm.get(image)
        return len(warm) if warm is not None else 0

    def cap(self, image: str) -> int | None:
        """Return the live cap of ``image`` (None: unlimited)."""
        return self.config.max_live_per_image.get(image, self.config.default_max_live)

    def _bucket(self, provider: str, now: float) -> _Bucket | None:
        b = self._buckets.get(provider)
        if b is None:
            rate = self.config.creation_rate.get(provider)
            if rate is None:
                return None
            burst = self.config.creation_burst.get(provider, max(1.0, rate))
            b = self._buckets[provider] = _Bucket(rate, burst, now)
        b.refill(now)
        return b

    def _room(self, image: str) -> int:
        cap = self.cap(image)
        if cap is None:
            return 1 << 30
        return cap - self.live.get(image, 0) - self._warm_count(image)

    def admit(self, image: str, provider: str | None, now: float) -> bool:
        """Whether a new sandbox user of ``image`` may start now (a warm sandbox, or room and a token)."""
        self._provider.setdefault(image, provider or DEFAULT_PROVIDER)
        if self._warm_count(image) > 0:
            return True
        if self._room(image) <= 0:
            return False
        b = self._bucket(self._provider[image], now)
        if b is not None and b.tokens < 1.0:
            self._starved.add(image)
            return False
        return True

    def start_session(self, image: str, now: float) -> bool:
        """Book a session start that :meth:`admit` allowed; True when it took a warm sandbox."""
        self._starts.setdefault(image, deque()).append(now)
        self._reuse_of(image).started(now)
        return self._lend(image, now)

    def _reuse_of(self, image: str) -> _Reuse:
        reuse = self._reuse.get(image)
        if reuse is None:
            reuse = self._reuse[image] = _Reuse()
        return reuse

    def start_action(self, image: str, now: float) -> bool:
        """Book a session-less action of ``image`` that :meth:`admit` allowed; True: a warm sandbox."""
        lent = self._lent.get(image)
        if lent is None:
            lent = self._lent[image] = _Lent()
        lent.up(now)
        self._reuse_of(image).started(now)
        return self._lend(image, now)

    def _lend(self, image: str, now: float) -> bool:
        self.live[image] = self.live.get(image, 0) + 1
        if self._warm_count(image) > 0:
            self._warm[image].pop()
            return True
        b = self._bucket(self._provider.get(image, DEFAULT_PROVIDER), now)
        if b is not None:
            b.tokens -= 1.0
        self.created += 1
        return False

    def close_session(self, image: str, now: float) -> None:
        """Book the end of a session of ``image``: its sandbox stays warm if the pool has room."""
        if self.live.get(image, 0) <= 0:
            return
        self._give_back(image, now)

    def end_action(self, image: str, now: float, *, lost: bool = False) -> None:
        """Book the end of a session-less action of ``image``: its sandbox stays warm if the pool has room.

        A ``lost`` sandbox died with its worker: nothing to recycle.
        """
        self._lent[image].down(now)
        if lost:
            self.drop_session(image)
        else:
            self._give_back(image, now)

    def _give_back(self, image: str, now: float) -> None:
        self.live[image] -= 1
        if not self.config.warm_pool:
            return
        self._reuse_of(image).given_back(now, self._want(image, now))
        if self._warm_count(image) < self._announced.get(image, 0):
            self._warm.setdefault(image, deque()).append(now)
            provider = self._provider.get(image, DEFAULT_PROVIDER)
            if provider in self.config.recreated_on_reset and (b := self._bucket(provider, now)) is not None:
                b.tokens -= 1.0  # the pool's reset creates one; it may borrow, never wait

    def drop_session(self, image: str) -> None:
        """Book a session of ``image`` whose sandbox died with its worker (nothing to recycle)."""
        if self.live.get(image, 0) > 0:
            self.live[image] -= 1

    def target(self, image: str, now: float) -> int:
        """Return the warm pool size ``image`` should have now (0 while keeping one warm does not pay)."""
        if not self.config.warm_pool or self.keep_s(image) <= 0:
            return 0
        return self._want(image, now)

    def _want(self, image: str, now: float) -> int:
        """The warm sandboxes the last burst of ``image`` asks for (its virtual pool's size)."""
        horizon = now - self.config.pool_window_s
        starts = self._starts.get(image)
        while starts and starts[0] < horizon:
            starts.popleft()
        lent = self._lent.get(image)
        want = max(len(starts) if starts else 0, lent.peak(horizon) if lent else 0)
        want = min(want, self.config.max_pool)
        # Under the live cap, not under what is left of it: a sandbox given back only moves from lent
        # to warm, so live + warm stays within the cap, and the sandboxes lent now come back warm.
        cap = self.cap(image)
        if cap is not None:
            want = min(want, cap)
        return max(0, want)

    def observe_creation(self, image: str, pays_s: float, now: float) -> None:
        """Learn, from one measured creation, how long a warm sandbox of ``image`` may idle before it
        has held as much as creating one does.
        """
        self._reuse_of(image).observe_creation(pays_s, now)

    def billed_alive(self, image: str) -> bool:
        """Whether sandboxes of ``image`` cost as much warm as busy (their provider bills them alive)."""
        return self._provider.get(image, DEFAULT_PROVIDER) in self.config.billed_alive

    def keep_s(self, image: str) -> float:
        """How long a sandbox of ``image`` given back stays warm: what saved the most over the recent
        reuse delays (the break-even until enough were seen; inf until a creation was measured).
        """
        fixed = self.config.warm_max_idle_s
        if fixed is not None:
            return fixed
        reuse = self._reuse.get(image)
        return math.inf if reuse is None else reuse.keep_s()

    def next_expiry(self) -> float | None:
        """When the longest-idle warm sandbox of some image stops paying for itself (None: never)."""
        times = []
        for image, q in self._warm.items():
            if q:
                times.append(q[0] + self.keep_s(image))
                # a sandbox of the virtual pool passing the break-even unwanted may shorten their keep
                if (overdue := self._reuse[image].next_overdue()) is not None:
                    times.append(overdue)
        t = min(times, default=float("inf"))
        return t if t != float("inf") else None

    def _expire(self, now: float) -> dict[str, int]:
        """Forget warm sandboxes idle longer than keeping them pays (the longest idle first); return how
        many per image, for the orchestrator to destroy.
        """
        expired: dict[str, int] = {}
        horizon = now - self.config.pool_window_s
        for reuse in self._reuse.values():
            reuse.forget_before(horizon)
            reuse.age(now)
        for image, since in self._warm.items():
            keep = self.keep_s(image)
            n = len(since)
            while since and now - since[0] >= keep:
                since.popleft()
            if len(since) < n:
                expired[image] = n - len(since)
        return expired

    def rebalance(self, now: float) -> list[ScalePool]:
        """Destroy warm sandboxes that no longer pay for themselves, resize every pool to its target;
        return the pools that changed.
        """
        expired = self._expire(now)
        out: list[ScalePool] = []
        for image in dict.fromkeys([*self._starts, *self._lent]):
            size = self.target(image, now)
            since = self._warm.get(image)
            while since and len(since) > size:
                since.popleft()  # the orchestrator destroys the extra warm sandboxes
            if self._announced.get(image, 0) != size or image in expired:
                self._announced[image] = size
                out.append(ScalePool(image, size, expired.get(image, 0)))
        return out

    def new_round(self) -> None:
        """Forget which images waited for a token (dispatch is about to ask again)."""
        self._starved.clear()

    def next_wakeup(self) -> float | None:
        """When a creation token next arrives for an image that waits for one, or a warm sandbox
        expires (None: neither).
        """
        times = [
            b.next_token_at()
            for image in self._starved
            if (b := self._buckets.get(self._provider.get(image, DEFAULT_PROVIDER))) is not None
        ]
        expiry = self.next_expiry()
        if expiry is not None:
            times.append(expiry)
        return min(times) if times else None

    def validate(self) -> None:
        """Assert that no image is over its cap or lends a negative count, no bucket is over its burst."""
        for image in set(self.live) | set(self._warm):
            live, pool = self.live.get(image, 0), self._warm_count(image)
            assert live >= 0, f"negative sandbox count for {image}"
            cap = self.cap(image)
            assert cap is None or live + pool <= cap, f"{image}: {live} live + {pool} warm over its cap {cap}"
        for image, lent in self._lent.items():
            assert 0 <= lent.running <= self.live.get(image, 0), (
                f"{image}: {lent.running} lent to session-less actions, {self.live.get(image, 0)} live"
            )
        for provider, b in self._buckets.items():
            assert b.tokens <= b.burst + 1e-9, f"{provider}: {b.tokens} tokens over burst {b.burst}"
            borrows = provider in self.config.recreated_on_reset  # its resets take tokens they may lack
            assert borrows or b.tokens >= -1e-9, f"{provider}: negative token count {b.tokens}"

    def snapshot(self) -> dict[str, dict[str, float | None]]:
        """Live and warm counts per image, how many of the live run session-less actions, and how
        long a sandbox given back stays warm (``keep_s``; None: until taken).
        """
        return {
            i: {
                "live": self.live.get(i, 0),
                "warm": self._warm_count(i),
                "sessionless": lent.running if (lent := self._lent.get(i)) else 0,
                "keep_s": None if (keep := self.keep_s(i)) == math.inf else round(keep, 3),
            }
            for i in set(self.live) | set(self._warm)
        }
