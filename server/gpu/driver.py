"""Driving a runner without an orchestrator: start grants, sleep on its fds, gather the results.

What a worker's loop does, in a few lines, for benchmarks, tests and scripts::

    results = run_grants(GpuRunner(), [score_grant("minilm_similarity", items)])
"""

from __future__ import annotations

import select
import time
from collections.abc import Iterable, Sequence
from typing import Any

from tangram_env.errors import ActionTimeout
from tangram_env.protocol import Action, Grant, Result
from tangram_env.server.runner import Runner


def score_grant(
    kind: str,
    items: Sequence[Any],
    *,
    parallelism: int = 1,
    timeout_s: float = 120.0,
    action_id: str | None = None,
) -> Grant:
    """Build a grant that scores ``items`` with the reward model ``kind``."""
    fields: dict[str, Any] = {"kind": kind, "payload": {"items": list(items)}}
    if action_id is not None:
        fields["id"] = action_id
    return Grant(action=Action(**fields), parallelism=parallelism, timeout_s=timeout_s)


def wait_for(runner: Runner, action_ids: Iterable[str], timeout_s: float = 120.0) -> dict[str, Result]:
    """Collect results until every id in ``action_ids`` has one (others that arrive are kept too).

    Raises :class:`~tangram_env.errors.ActionTimeout` when they are not all in after ``timeout_s``.
    """
    wanted = set(action_ids)
    out: dict[str, Result] = {}
    deadline = time.monotonic() + timeout_s
    while not wanted.issubset(out):
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(wanted - set(out))
            raise ActionTimeout(f"{len(missing)} results missing after {timeout_s}s", action_id=missing[0])
        select.select(runner.wait_fds(), [], [], min(left, 1.0))
        for result in runner.collect():
            out[result.action_id] = result
    return out


def run_grants(runner: Runner, grants: Sequence[Grant], timeout_s: float = 120.0) -> list[Result]:
    """Start ``grants`` and return their results in the same order."""
    for g in grants:
        runner.start(g)
    got = wait_for(runner, [g.action.id for g in grants], timeout_s)
    return [got[g.action.id] for g in grants]
