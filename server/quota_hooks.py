"""What the orchestrator does for API quotas (issue 21), kept out of its loop: a few calls from it.

A tool whose API answered 429 fails with ``error_type="throttled"`` and its ``Retry-After``; when the
action holds a key of a configured quota, the orchestrator gives the scheduler an
:class:`~.scheduler.events.ActionThrottled` instead of a finish: the key pauses, the action queues again
under the same id (it never reached the API's work, so nothing runs twice to completion), and the
client never sees the refusal. Without a quota (no key granted) the failure goes back to the client,
since nothing would space the retries out.
"""

from __future__ import annotations

from typing import Any

from tangram_env.protocol import Result
from tangram_env.server.config import ServerSettings
from tangram_env.server.scheduler.events import ActionThrottled

DEFAULT_RETRY_AFTER_S = 1.0
#: The longest pause one 429 imposes (a longer ``Retry-After``, or an infinite one, is held to it).
MAX_RETRY_AFTER_S = 86_400.0


def throttle_of(result: Result, api_key: str | None) -> ActionThrottled | None:
    """The scheduler event for a throttled ``result`` of an action granted ``api_key`` (None: not one)."""
    if result.ok or result.error_type != "throttled" or api_key is None:
        return None
    retry = DEFAULT_RETRY_AFTER_S
    if isinstance(result.value, dict):
        value = result.value.get("retry_after_s")
        if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:  # NaN is not
            retry = min(float(value), MAX_RETRY_AFTER_S)
    return ActionThrottled(result.action_id, retry)


def scheduler_options(settings: ServerSettings) -> dict[str, Any]:
    """Constructor options of the scheduler that the settings imply (the API quotas, when any)."""
    return {"api_quotas": settings.quotas} if settings.quotas.apis else {}


def quota_starved(scheduler: Any) -> set[str]:
    """Queued actions that wait for their API's quota, not for capacity (none: a policy without quotas)."""
    starved = getattr(scheduler, "quota_starved", None)
    return starved() if starved is not None else set()


def quota_figures(scheduler: Any) -> dict[str, Any]:
    """Tokens, in flight, waiting and 429s per API and key, for ``Stats`` (empty: no quotas)."""
    snapshot = getattr(scheduler, "quota_snapshot", None)
    return snapshot() if snapshot is not None else {}
