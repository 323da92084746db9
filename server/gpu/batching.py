"""Jobs, their queued shares and how a batch is cut from a model's queue (pure data, no threads).

A granted action becomes a :class:`Job`. Its items are split into ``parallelism`` contiguous
:class:`Share` s that wait in the model's FIFO queue; a batch takes up to ``max_batch`` items from the
front of the queue, at most one share per job (so a job's shares can run on different replicas at
once) and never from a job that already has ``parallelism`` batches in flight.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tangram_env.protocol import ErrorType, Result, Timing


@dataclass(eq=False)
class Job:
    """One granted action being scored: its items' scores fill in as batches finish."""

    action_id: str
    kind: str
    n_items: int
    parallelism: int
    submitted: float  # monotonic time the runner got it
    deadline: float
    queued_s: float = 0.0  # time it already waited in the orchestrator's queue
    scores: list[float | None] = field(default_factory=list)
    remaining: int = 0
    in_flight: int = 0
    first_run: float | None = None
    last_end: float = 0.0
    setup_s: float = 0.0
    result: Result | None = None  # set once the job is over (ok, failed, timed out)

    def __post_init__(self) -> None:
        if not self.scores:
            self.scores = [None] * self.n_items
        self.remaining = self.n_items

    @property
    def over(self) -> bool:
        """Finished one way or another; its remaining shares are dropped."""
        return self.result is not None

    def finish_ok(self, worker: str) -> Result:
        """Build the result once every item has its score."""
        first = self.first_run if self.first_run is not None else self.last_end
        local_wait = max(0.0, first - self.submitted - self.setup_s)
        self.result = Result(
            action_id=self.action_id,
            ok=True,
            value=[float(s) for s in self.scores if s is not None],
            timing=Timing(
                queued_s=self.queued_s + local_wait,
                setup_s=self.setup_s,
                run_s=max(0.0, self.last_end - first),
            ),
            parallelism=self.parallelism,
            worker=worker,
        )
        return self.result

    def finish_error(
        self, error_type: ErrorType, message: str, now: float, worker: str, traceback: str = ""
    ) -> Result:
        """Build the result of a job that failed (``model_error``) or ran out of time (``timeout``)."""
        first = self.first_run if self.first_run is not None else now
        self.result = Result(
            action_id=self.action_id,
            ok=False,
            error_type=error_type,
            message=message,
            traceback=traceback,
            timing=Timing(
                queued_s=self.queued_s + max(0.0, first - self.submitted - self.setup_s),
                setup_s=self.setup_s,
                run_s=max(0.0, now - first),
            ),
            parallelism=self.parallelism,
            worker=worker,
        )
        return self.result


@dataclass(eq=False)
class Share:
    """A contiguous slice ``items`` of ``job``'s items, starting at index ``start``, waiting to run.

    Batches cut from its front advance ``taken`` rather than copy the rest of ``items`` (a copy per
    batch made one large request quadratic, under the runner's lock).
    """

    job: Job
    start: int
    items: list[Any]
    enqueued: float
    taken: int = 0  # items already cut from the front into batches

    @property
    def left(self) -> int:
        """Items still waiting."""
        return len(self.items) - self.taken


@dataclass(eq=False)
class Piece:
    """The part of a batch that belongs to one job: ``items`` are its indices ``start..``."""

    job: Job
    start: int
    items: list[Any]
    enqueued: float


def split_job(job: Job, items: list[Any], now: float) -> list[Share]:
    """``items`` cut into ``job.parallelism`` contiguous shares of near-equal size (none empty)."""
    if not items:
        return []
    parts = max(1, min(job.parallelism, len(items)))
    size = math.ceil(len(items) / parts)
    return [Share(job, i, items[i : i + size], now) for i in range(0, len(items), size)]


class ModelQueue:
    """The FIFO of shares waiting for one model."""

    def __init__(self) -> None:
        self._shares: deque[Share] = deque()

    def push(self, shares: Iterable[Share]) -> None:
        """Queue ``shares`` behind everything already waiting."""
        self._shares.extend(shares)

    def push_front(self, shares: Iterable[Share]) -> None:
        """Put ``shares`` back at the front, in their order (they were taken from there)."""
        self._shares.extendleft(reversed(list(shares)))

    def prune(self) -> None:
        """Drop shares whose job is over (failed or timed out)."""
        if any(s.job.over for s in self._shares):
            self._shares = deque(s for s in self._shares if not s.job.over)

    def _takeable(self) -> Iterable[Share]:
        seen: set[int] = set()
        for share in self._shares:
            job = share.job
            if job.over or job.in_flight >= job.parallelism or id(job) in seen:
                continue
            seen.add(id(job))
            yield share

    def takeable_items(self, limit: int | None = None) -> int:
        """Items one batch could take now (counting up to ``limit``)."""
        total = 0
        for share in self._takeable():
            total += share.left
            if limit is not None and total >= limit:
                return total
        return total

    def oldest(self) -> float | None:
        """When the oldest takeable share was queued (None: nothing can be taken)."""
        return next((s.enqueued for s in self._takeable()), None)

    def queued_items(self) -> int:
        """Items waiting, takeable or not (jobs that are over excluded)."""
        return sum(s.left for s in self._shares if not s.job.over)

    def queued_jobs(self) -> int:
        """Distinct jobs with items waiting."""
        return len({id(s.job) for s in self._shares if not s.job.over})

    def jobs(self) -> list[Job]:
        """List the distinct jobs with shares waiting, oldest first."""
        out: dict[int, Job] = {}
        for s in self._shares:
            out.setdefault(id(s.job), s.job)
        return list(out.values())

    def take_batch(self, max_batch: int) -> list[Piece]:
        """Cut the next batch: up to ``max_batch`` items, front first, one share per job at most.

        A share larger than the room left is split; its rest keeps its place at the front.
        """
        self.prune()
        pieces: list[Piece] = []
        room = max_batch
        taken: set[int] = set()
        kept: deque[Share] = deque()
        while self._shares:
            share = self._shares.popleft()
            job = share.job
            if room == 0 or id(job) in taken or job.in_flight >= job.parallelism:
                kept.append(share)
                continue
            n = min(room, share.left)
            first = share.taken
            pieces.append(Piece(job, share.start + first, share.items[first : first + n], share.enqueued))
            taken.add(id(job))
            room -= n
            if n < share.left:
                share.taken += n
                kept.append(share)
        self._shares = kept
        for piece in pieces:
            piece.job.in_flight += 1
        return pieces

    def __len__(self) -> int:
        return len(self._shares)
