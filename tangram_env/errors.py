"""The exception hierarchy: one root, three sub-trees (registry, protocol, runtime).

Each error also subclasses the nearest builtin, so ``except KeyError`` or ``except TimeoutError`` keep
working, and each pickles (arguments are kept in ``args``) so errors cross process boundaries.
"""

from __future__ import annotations

import difflib
import socket
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


def did_you_mean(name: str, known: Iterable[str], n: int = 3) -> str:
    """``"; did you mean 'a', 'b'?"`` with the known names closest to ``name`` (empty when none is)."""
    hint = difflib.get_close_matches(name, list(known), n=n)
    return f"; did you mean {', '.join(map(repr, hint))}?" if hint else ""


def describe_validation_error(exc: ValidationError, limit: int = 5) -> str:
    """Pydantic's errors in one line: ``loc: message`` for the first few."""
    parts = [f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors()[:limit]]
    more = exc.error_count() - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


class TangramError(Exception):
    """Root of every error raised by Tangram."""


# --- registry -------------------------------------------------------------------------------------
class RegistryError(TangramError):
    """A name could not be registered or resolved."""


class UnknownNameError(RegistryError, KeyError):
    """An env id, tool or reward model name that is not registered (with a "did you mean" hint)."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it readable.
        return str(self.args[0]) if self.args else ""


class AlreadyRegisteredError(RegistryError, ValueError):
    """A name registered twice with different definitions."""


class SettingsError(TangramError, ValueError):
    """A client setting (a ``TANGRAM_*`` variable or a keyword) or an address that cannot be used."""


# --- protocol -------------------------------------------------------------------------------------
class ProtocolError(TangramError, ValueError):
    """A message that cannot be decoded or validated.

    ``code`` is a short machine-readable reason (``bad_frames``, ``bad_version``, ``too_large``,
    ``bad_body``, ``bad_schema``, ``unknown_type``), also sent back in the ``Error`` reply.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


# --- runtime --------------------------------------------------------------------------------------
class TangramRuntimeError(TangramError, RuntimeError):
    """Something went wrong while running environments or actions."""


class ActionError(TangramRuntimeError):
    """An action ended without a value: its result carries the reason.

    ``error_type`` is the result's failure type (``error``, ``timeout``, ``rejected``, ...),
    ``remote_traceback`` the traceback text from where it ran, if any.
    """

    def __init__(
        self, message: str, *, action_id: str = "", error_type: str = "error", remote_traceback: str = ""
    ) -> None:
        super().__init__(message, action_id, error_type, remote_traceback)
        self.message = message
        self.action_id = action_id
        self.error_type = error_type
        self.remote_traceback = remote_traceback

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (
            _rebuild_action_error,
            (type(self), self.message, self.action_id, self.error_type, self.remote_traceback),
        )

    def __str__(self) -> str:
        return (
            f"{self.message} (action {self.action_id}, {self.error_type})" if self.action_id else self.message
        )


def _rebuild_action_error(
    cls: type[ActionError], message: str, action_id: str, error_type: str, remote_traceback: str
) -> ActionError:
    return cls(message, action_id=action_id, error_type=error_type, remote_traceback=remote_traceback)


class ActionTimeout(ActionError, TimeoutError):
    """An action ran past its time limit and was killed, or its result did not arrive in time."""


class ActionRejected(ActionError):
    """The orchestrator refused an action (unknown kind, invalid payload, over a limit)."""


class ActionCancelled(ActionError):
    """The action was cancelled before it finished."""


class RewardUnavailable(TangramRuntimeError):
    """A step's reward could not be determined for a reason outside the agent's control.

    The sandbox died, no sandbox could be had, the grader timed out, the reward model failed: the
    step earned no reward and must not be trained on. ``cause`` is the failed action's
    ``error_type`` (or a short word of the env's), ``action_id`` the action, if one failed.
    An env built with ``invalid_reward="flag"`` (vector envs by default) reports the step instead,
    with ``info["reward_valid"] = False``, ``info["reward_error"]`` and a NaN reward.
    """

    def __init__(self, reason: str, *, cause: str = "error", action_id: str = "") -> None:
        super().__init__(reason, cause, action_id)
        self.reason = reason
        self.cause = cause
        self.action_id = action_id

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_rebuild_reward_unavailable, (type(self), self.reason, self.cause, self.action_id))

    def __str__(self) -> str:
        return f"no reward for this step ({self.cause}): {self.reason}"


def _rebuild_reward_unavailable(
    cls: type[RewardUnavailable], reason: str, cause: str, action_id: str
) -> RewardUnavailable:
    return cls(reason, cause=cause, action_id=action_id)


class ServerUnavailable(TangramRuntimeError, ConnectionError):
    """No orchestrator answered at the configured address."""


def no_answer(address: str, timeout_s: float, keyed: bool) -> ServerUnavailable:
    """The error of an orchestrator that did not answer, with what to check: a keyed one never hears
    a peer without its public key, and a peer with the wrong one is dropped just as silently.
    """
    check = (
        "is TANGRAM_CURVE_SERVER_KEY its public key?"
        if keyed
        else "if it uses CurveZMQ keys, set TANGRAM_CURVE_SERVER_KEY to its public key"
    )
    said = f"no orchestrator answered at {address} within {timeout_s:g}s"
    host = (
        address.removeprefix("tcp://").rpartition(":")[0].strip("[]") if address.startswith("tcp://") else ""
    )
    if host and host != "*":
        try:  # ZeroMQ resolves in the background and never says a name does not resolve
            socket.getaddrinfo(host, None)
        except (OSError, UnicodeError):
            return ServerUnavailable(f"{said}: the host name {host!r} does not resolve here")
    return ServerUnavailable(f"{said} (is tangram-server running there? {check})")


class ClosedEnvError(TangramRuntimeError):
    """An operation on an environment or client that has been closed."""


class ForkedClientError(ClosedEnvError):
    """A client (or an env on it) used in a process forked from the one that made it: its connection
    and IO thread stayed in the parent, so it is closed here; make a new one in the child.
    """


class AlreadyPendingCallError(TangramRuntimeError):
    """``step_async`` (or ``reset_async``) called while another call is still pending."""


class NoAsyncCallError(TangramRuntimeError):
    """``step_wait`` (or ``reset_wait``) called without a pending async call."""


class LoopInUseError(TangramRuntimeError):
    """An ``AsyncClient`` was used from an event loop while another one, on another thread, runs it."""


class ApiThrottled(TangramRuntimeError):
    """Raised by a tool whose API answered 429 (rate limited): the orchestrator requeues the action.

    ``retry_after_s`` is the API's ``Retry-After``; the key the action used pauses that long and the
    action runs again (same id) on a key with quota, so the agent never sees the refusal.
    """

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message, retry_after_s)
        self.message = message
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_rebuild_throttled, (self.message, self.retry_after_s))


def _rebuild_throttled(message: str, retry_after_s: float) -> ApiThrottled:
    return ApiThrottled(message, retry_after_s=retry_after_s)


#: Maps a result's ``error_type`` to the client-side exception raised for it.
ERROR_TYPES: dict[str, type[ActionError]] = {
    "error": ActionError,
    "timeout": ActionTimeout,
    "deadline": ActionTimeout,
    "rejected": ActionRejected,
    "cancelled": ActionCancelled,
    "sandbox_died": ActionError,
    "model_error": ActionError,
    "throttled": ActionError,
}
