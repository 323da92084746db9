"""Rewards training can trust: what an env does when a reward cannot be determined.

A reward is a judgement of the agent's work. When the work could not be judged for a reason outside
the agent's control (the grading action failed: the sandbox died, no sandbox could be had, the grader
or reward model failed or timed out), the step has no reward, and saying 0.0 would teach the policy
from noise. Envs call :func:`graded` on each result their reward depends on::

    (result,) = yield [Action(kind="mytask.grade", payload=...)]
    report = graded(result, "grading")      # RewardUnavailable if the grader itself failed
    reward = report["passed"] / report["total"]

A grading action the orchestrator *rejected* (an unknown kind, a payload its tool refuses, a limit
the caller went over) is neither: the request itself was wrong, so every step would fail alike.
:func:`graded` raises :class:`~tangram_env.errors.ActionRejected` for it, whatever the policy below,
rather than let a configuration mistake pass as a stream of flagged samples.

What the caller then sees is the env's ``invalid_reward`` policy (a keyword of ``make``):

- ``"raise"`` (single envs' default): ``step()`` raises :class:`~tangram_env.errors.RewardUnavailable`.
- ``"flag"`` (vector envs' default): the step returns the last observation (a chat env: a message
  naming the failure), reward ``nan``,
  ``truncated=True`` (the episode cannot go on where its state may be lost), and ``info`` with
  ``reward_valid=False`` and ``reward_error``; every other step's ``info`` has ``reward_valid=True``,
  so a vector env's ``info["reward_valid"]`` is a mask over the batch (in same-step autoreset mode
  too: the step's :data:`REWARD_INFO_KEYS` stay beside the reset's info).
"""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

from tangram_env.errors import ActionRejected, RewardUnavailable
from tangram_env.protocol import Result

#: What an env does with a step whose reward could not be determined.
InvalidRewardPolicy = Literal["raise", "flag"]
INVALID_REWARD_POLICIES: tuple[str, ...] = get_args(InvalidRewardPolicy)
#: The reward of a flagged step: not a number, so that an unmasked use cannot pass unnoticed.
INVALID_REWARD = math.nan
#: The ``info`` entries that describe a step's reward (``reward_valid`` always, the rest when flagged).
REWARD_INFO_KEYS: tuple[str, ...] = ("reward_valid", "reward_error", "reward_error_cause")


def graded(result: Result, what: str = "grading") -> Any:
    """The value of a grading action's ``result``, or :class:`RewardUnavailable` if it failed.

    A failed grading action is outside the agent's control: the agent's own failures (wrong
    answers, crashes, tests that fail or time out) are part of a successful grading report. A
    rejected one is the caller's mistake (the orchestrator refused the request as sent: an unknown
    kind, an invalid payload, a session or id misused, a demand no worker can ever hold), raised as
    :class:`~tangram_env.errors.ActionRejected` for the caller to fix: it is no sample to skip.
    """
    if result.ok:
        return result.value
    if result.error_type == "rejected":
        raise ActionRejected(
            f"{what} was rejected: {result.message}", action_id=result.action_id, error_type="rejected"
        )
    raise RewardUnavailable(
        f"{what} failed: {result.message or result.error_type}",
        cause=result.error_type or "error",
        action_id=result.action_id,
    )


def check_policy(policy: str) -> InvalidRewardPolicy:
    """``policy`` if it is one of :data:`INVALID_REWARD_POLICIES`, else a ``ValueError`` naming them."""
    if policy not in INVALID_REWARD_POLICIES:
        raise ValueError(f"invalid_reward must be one of {INVALID_REWARD_POLICIES}, not {policy!r}")
    return policy  # type: ignore[return-value]


def flagged_info(error: RewardUnavailable) -> dict[str, Any]:
    """The ``info`` entries of a flagged step (the :data:`REWARD_INFO_KEYS`)."""
    return {"reward_valid": False, "reward_error": str(error), "reward_error_cause": error.cause}
