"""Backpressure from sandbox providers: an action whose sandbox could not be made *yet* waits and retries.

A provider at capacity (e2b's 429 or 503, any provider raising
:class:`~tangram_env.sandbox.SandboxBusy`) is not a failure of the action nor of a sandbox: where
it ran, the action's result says so (:func:`busy_result`), and the orchestrator's core takes it back
out of the scheduler, waits a bounded, growing back-off, and queues it again under the same id
(:class:`BusyRetries`). Only after ``tries`` refusals in a row does the client get a failure (an
infrastructure failure: ``sandbox_died``, never a reward). Pure: no clock reads, no threads.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

from tangram_env.protocol import Result

#: The mark a runner puts in a busy result's value (beside ``retry_after_s``).
BUSY_MARK = "sandbox_busy"


def busy_result(action_id: str, exc: BaseException, retry_after_s: float | None = None) -> Result:
    """The result a runner reports when the provider had no sandbox for ``action_id`` yet."""
    value: dict[str, Any] = {BUSY_MARK: True}
    if retry_after_s is not None:
        value["retry_after_s"] = float(retry_after_s)
    return Result.failure(action_id, "throttled", f"{type(exc).__name__}: {exc}", value=value)


def is_busy(result: Result) -> bool:
    """Whether ``result`` is a provider's backpressure (see :func:`busy_result`)."""
    value = result.value
    return (
        not result.ok
        and result.error_type == "throttled"
        and isinstance(value, dict)
        and value.get(BUSY_MARK) is True
    )


def _hint(result: Result) -> float:
    value = result.value
    hint = value.get("retry_after_s") if isinstance(value, dict) else None
    if isinstance(hint, int | float) and not isinstance(hint, bool) and 0 <= hint < 86_400:
        return float(hint)
    return 0.0


@dataclass
class BusyRetries:
    """Actions waiting out a provider's backpressure, and how long each waits.

    The n-th refusal in a row waits ``first_s * 2**(n-1)``, at most ``max_s`` (or the provider's own
    ``retry_after_s``, when longer); after ``tries`` refusals the action fails.
    """

    first_s: float = 0.5
    max_s: float = 15.0
    tries: int = 12
    _due: list[tuple[float, str]] = field(default_factory=list)  # heap of (retry time, action id)
    _refusals: dict[str, int] = field(default_factory=dict)  # per action waiting or retried
    retries: int = 0  # back-offs begun, ever
    given_up: int = 0

    def refused(self, action_id: str, result: Result, now: float) -> float | None:
        """The provider refused ``action_id`` again: when to retry it, or None (given up: fail it)."""
        n = self._refusals.get(action_id, 0) + 1
        if n > self.tries:
            self._refusals.pop(action_id, None)
            self.given_up += 1
            return None
        self._refusals[action_id] = n
        wait = max(min(self.max_s, self.first_s * 2 ** (n - 1)), _hint(result))
        heapq.heappush(self._due, (now + wait, action_id))
        self.retries += 1
        return now + wait

    def due(self, now: float) -> list[str]:
        """Actions whose back-off is over (the caller checks they still wait: cancelled ones may not)."""
        out: list[str] = []
        while self._due and self._due[0][0] <= now:
            out.append(heapq.heappop(self._due)[1])
        return out

    def next_due(self) -> float | None:
        """When the next back-off ends (None: nothing waits)."""
        return self._due[0][0] if self._due else None

    def refusals(self, action_id: str) -> int:
        """Refusals in a row so far for ``action_id``."""
        return self._refusals.get(action_id, 0)

    def done(self, action_id: str) -> None:
        """``action_id`` has its result (or left): forget its count."""
        self._refusals.pop(action_id, None)

    def figures(self, waiting: int) -> dict[str, Any]:
        """For ``Stats``: back-offs begun, actions waiting one out now, and those given up on."""
        return {"retries": self.retries, "backing_off": waiting, "given_up": self.given_up}
