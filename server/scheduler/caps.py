"""Cluster-wide sandbox caps and warm pools: live sandboxes per image, creations per second per provider.

Cloud sandbox providers limit how many sandboxes may be alive and how fast new ones may be created;
those limits hold across every host, so the scheduler enforces them, not each worker. A *live*
sandbox is one bound to a session or waiting warm in the pool of its image. A session that starts
takes a warm sandbox when the pool has one (no creation), else creates one (one token of its
provider's bucket, and room under the image's cap). A closed session's sandbox is reset and kept warm
while the pool holds fewer than its size (:class:`~.events.ScalePool`); pools never create sandboxes
of their own, so every creation passes through the caps. The size is the number of sessions of that
image started within the last ``pool_window_s``: RL steps start their trajectories in bursts, and the
last burst predicts the next.
"""

from __future__ import annotations

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
    warm_pool: bool = Field(True, description="keep closed sessions' sandboxes warm for the next sessions")
    pool_window_s: float = Field(
        1800.0, gt=0, description="sessions started within this window size the pool"
    )
    max_pool: int = Field(256, ge=0, description="warm sandboxes per image at most")


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


class SandboxCaps:
    """Live sandboxes per image, creation tokens per provider and the warm pool of each image."""

    def __init__(self, config: CapsConfig | None = None) -> None:
        self.config = config or CapsConfig()
        self.live: dict[str, int] = {}  # image -> sandboxes bound to sessions
        self.pool: dict[str, int] = {}  # image -> warm sandboxes (the size last asked for)
        self._announced: dict[str, int] = {}  # image -> size in the last ScalePool
        self._starts: dict[str, deque[float]] = {}  # image -> recent session start times
        self._provider: dict[str, str] = {}
        self._buckets: dict[str, _Bucket] = {}
        self._starved: set[str] = set()  # images that wait for a creation token
        self.created = 0  # sandboxes created on this scheduler's word (for tests and reports)

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
        return cap - self.live.get(image, 0) - self.pool.get(image, 0)

    def admit(self, image: str, provider: str | None, now: float) -> bool:
        """Whether a new session of ``image`` may start now (a warm sandbox, or room and a token)."""
        self._provider.setdefault(image, provider or DEFAULT_PROVIDER)
        if self.pool.get(image, 0) > 0:
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
        self.live[image] = self.live.get(image, 0) + 1
        starts = self._starts.setdefault(image, deque())
        starts.append(now)
        if self.pool.get(image, 0) > 0:
            self.pool[image] -= 1
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
        self.live[image] -= 1
        if self.config.warm_pool and self.pool.get(image, 0) < self._announced.get(image, 0):
            self.pool[image] = self.pool.get(image, 0) + 1

    def drop_session(self, image: str) -> None:
        """Book a session of ``image`` whose sandbox died with its worker (nothing to recycle)."""
        if self.live.get(image, 0) > 0:
            self.live[image] -= 1

    def target(self, image: str, now: float) -> int:
        """Return the warm pool size ``image`` should have now."""
        if not self.config.warm_pool:
            return 0
        starts = self._starts.get(image)
        if starts is None:
            return 0
        horizon = now - self.config.pool_window_s
        while starts and starts[0] < horizon:
            starts.popleft()
        want = min(len(starts), self.config.max_pool)
        cap = self.cap(image)
        if cap is not None:
            want = min(want, cap - self.live.get(image, 0))
        return max(0, want)

    def rebalance(self, now: float) -> list[ScalePool]:
        """Resize every pool to its target; return the sizes that changed."""
        out: list[ScalePool] = []
        for image in list(self._starts):
            size = self.target(image, now)
            if self.pool.get(image, 0) > size:
                self.pool[image] = size  # the orchestrator destroys the extra warm sandboxes
            if self._announced.get(image, 0) != size:
                self._announced[image] = size
                out.append(ScalePool(image, size))
        return out

    def new_round(self) -> None:
        """Forget which images waited for a token (dispatch is about to ask again)."""
        self._starved.clear()

    def next_wakeup(self) -> float | None:
        """When a creation token next arrives for an image that waits for one (None: none waits)."""
        times = [
            b.next_token_at()
            for image in self._starved
            if (b := self._buckets.get(self._provider.get(image, DEFAULT_PROVIDER))) is not None
        ]
        return min(times) if times else None

    def validate(self) -> None:
        """Assert that no image is over its cap and no bucket holds more than its burst."""
        for image in set(self.live) | set(self.pool):
            live, pool = self.live.get(image, 0), self.pool.get(image, 0)
            assert live >= 0 and pool >= 0, f"negative sandbox count for {image}"
            cap = self.cap(image)
            assert cap is None or live + pool <= cap, f"{image}: {live} live + {pool} warm over its cap {cap}"
        for provider, b in self._buckets.items():
            assert b.tokens <= b.burst + 1e-9, f"{provider}: {b.tokens} tokens over burst {b.burst}"
            assert b.tokens >= -1e-9, f"{provider}: negative token count {b.tokens}"

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Live and warm counts per image."""
        return {
            i: {"live": self.live.get(i, 0), "warm": self.pool.get(i, 0)}
            for i in set(self.live) | set(self.pool)
        }
