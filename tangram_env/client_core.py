"""What a connection to the orchestrator knows, with no socket, thread or clock of its own.

:class:`ClientCore` is the one place for the client's rules: which actions are outstanding (and the
future each resolves), retries as new attempts, "busy" answers resubmitted after a growing wait
(backpressure), acknowledgements that ride on the next submission or leave on their own, heartbeats
while work is outstanding, a silent orchestrator failing what waits on it, and resubmission after a
restart. It takes frames and ``now`` and leaves messages in :attr:`ClientCore.outbox`; the shells own
the socket and the clock: the thread-safe :class:`~tangram_env.client.Client` (an IO thread) and the
asyncio :class:`~tangram_env.aio.AsyncClient` (a reader on the caller's event loop). Futures are
duck-typed (``done``/``set_result``/``set_exception``), so each shell brings its own kind.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

import zmq
from pydantic import BaseModel

from tangram_env import wire
from tangram_env.errors import ProtocolError, ServerUnavailable
from tangram_env.protocol import (
    MAX_IDS_PER_MESSAGE,
    Ack,
    Action,
    CloseSessions,
    Error,
    Heartbeat,
    Result,
    Results,
    Submit,
    id_batches,
)
from tangram_env.settings import ClientSettings

log = logging.getLogger("tangram_env.client")

SUBMIT_BATCH = 512  # actions per Submit message: bounds message size, amortises encoding
ACK_DELAY_S = 0.05  # acknowledgements wait this long for a Submit to carry them


def connect_dealer(
    ctx: zmq.Context[Any], address: str, identity: bytes, settings: ClientSettings
) -> zmq.Socket[bytes]:
    """A DEALER socket connected to the orchestrator at ``address`` (raises on a bad address or key)."""
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * settings.max_body)
        if settings.curve_server_key:
            from tangram_env.curve import configure_client_curve

            configure_client_curve(sock, settings.curve_server_key)
        sock.connect(address)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


class FutureLike(Protocol):
    """What the core needs of a future: a ``concurrent.futures.Future`` or an ``asyncio.Future``."""

    def done(self) -> bool: ...  # noqa: D102

    def set_result(self, result: Any, /) -> None: ...  # noqa: D102

    def set_exception(self, exception: BaseException, /) -> None: ...  # noqa: D102


F = TypeVar("F", bound=FutureLike)


def submissions(actions: Sequence[Action]) -> Iterator[Submit]:
    """``actions`` as Submit messages of at most :data:`SUBMIT_BATCH` actions each."""
    for start in range(0, len(actions), SUBMIT_BATCH):
        yield Submit(actions=list(actions[start : start + SUBMIT_BATCH]))


def _same_work(a: Action, b: Action) -> bool:
    """Whether ``b``, sent under ``a``'s id, asks for the same work (a resubmission, not a reused id)."""
    return a.kind == b.kind and a.affinity == b.affinity and a.payload == b.payload


def _refused(fut: F, action: Action, holder: Action) -> F:
    why = (
        f"action id {action.id!r} is outstanding for a different {holder.kind!r} action (its payload or "
        "session differs); give each action its own id (the default), or wait for the first result"
    )
    fut.set_result(Result.failure(action.id, "rejected", why))
    return fut


class ClientCore(Generic[F]):
    """The client's state and rules (see the module's docstring); ``now`` is ``time.monotonic()``.

    ``lock`` guards :attr:`pending` and :attr:`requests`, which callers on other threads touch; the
    rest belongs to whoever holds the socket.
    """

    def __init__(
        self, settings: ClientSettings, address: str, now: float, server_id: str | None = None
    ) -> None:
        self.settings = settings
        self.address = address
        self.lock = threading.Lock()
        self.pending: dict[str, tuple[F, Action]] = {}
        self.requests: dict[str, collections.deque[F]] = collections.defaultdict(collections.deque)
        self.outbox: collections.deque[BaseModel] = collections.deque()
        self.unacked: list[str] = []  # result ids to acknowledge (sent with the next Submit, or soon)
        # Sandbox sessions this client used and has not closed: heartbeats keep them alive while the
        # trainer thinks (the orchestrator ends a silent client's sessions, files and all).
        self.sessions: set[str] = set()
        # Sessions whose sandbox ended with an orchestrator that restarted -> why; their actions fail
        # here, never to run in an empty sandbox, until the session is closed.
        self.lost_sessions: dict[str, str] = {}
        self.ack_due: float | None = None
        self.next_beat = now + settings.heartbeat_s
        self.last_heard = now  # or when work resumed after a quiet spell, if later
        self._server_id = server_id  # a twin starts with its sync client's, so it sees a restart
        self._attempts: dict[str, tuple[str, int]] = {}  # retry attempt id -> (original id, attempt number)
        self._busy: list[tuple[float, str]] = []  # (when, action id) to resubmit after a "busy" answer
        self._backoff = settings.busy_backoff_s
        # Messages this socket sent and received, and how many of each the orchestrator's last count
        # said were lost (a connection that broke and came back): more since then, and it resubmits.
        self.messages_sent = 0
        self.messages_heard = 0
        self._lost = (0, 0)

    # --- what callers ask ----------------------------------------------------------------------------
    def register(
        self, actions: Sequence[Action], new_future: Callable[[], F], now: float
    ) -> tuple[list[F], list[Action]]:
        """One future per action (an id already outstanding shares its future: it never runs twice),
        and the actions that are new and still to be sent.
        """
        futures: list[F] = []
        new: list[Action] = []
        with self.lock:
            if not self.pending:  # work resumes: silence counts from now, not from the last answer
                self.last_heard = max(self.last_heard, now)
                self.next_beat = now + self.settings.heartbeat_s
            for action in actions:
                existing = self.pending.get(action.id)
                if existing is not None:
                    if _same_work(existing[1], action):
                        futures.append(existing[0])
                    else:  # its result would be the other action's: a reused id, refused here
                        futures.append(_refused(new_future(), action, existing[1]))
                    continue
                fut = new_future()
                lost = self.lost_sessions.get(action.affinity) if action.affinity else None
                if lost is not None:
                    fut.set_result(Result.failure(action.id, "sandbox_died", lost))
                    futures.append(fut)
                    continue
                self.pending[action.id] = (fut, action)
                if action.affinity:
                    self.sessions.add(action.affinity)
                futures.append(fut)
                new.append(action)
        return futures, new

    def expect(self, reply_kind: str, fut: F) -> None:
        """``fut`` takes the next reply of ``reply_kind`` (a request: kinds, stats, heartbeat)."""
        with self.lock:
            self.requests[reply_kind].append(fut)

    def forget_request(self, reply_kind: str, fut: F) -> None:
        """Stop waiting for a request's reply (it timed out)."""
        with self.lock:
            if fut in self.requests[reply_kind]:
                self.requests[reply_kind].remove(fut)

    @property
    def quiet(self) -> bool:
        """Nothing in flight: no outstanding action, message, request or deferred resubmission."""
        return not (self.pending or self.outbox or self._busy or any(self.requests.values()))

    # --- what goes out -------------------------------------------------------------------------------
    def outgoing(self) -> Iterator[bytes]:
        """Encoded messages to send now, in order; acknowledgements ride on the first Submit."""
        while self.outbox:
            message = self.outbox.popleft()
            if isinstance(message, Submit):
                frames = self._submit_frames(message)
                self.messages_sent += len(frames)
                yield from frames
            else:
                if isinstance(message, Heartbeat):
                    message = message.model_copy(update={"sent": self.messages_sent})
                if isinstance(message, CloseSessions):
                    with self.lock:
                        self.sessions.difference_update(message.session_ids)
                        for session in message.session_ids:
                            self.lost_sessions.pop(session, None)
                try:
                    data = wire.encode(message)
                except (ValueError, TypeError, OverflowError) as exc:  # a lone surrogate in an id, say
                    log.error(
                        "cannot send a %s message: %s: %s", type(message).__name__, type(exc).__name__, exc
                    )
                    continue
                self.messages_sent += 1
                yield data

    def _submit_frames(self, message: Submit) -> list[bytes]:
        """``message`` (with the acknowledgements due) as Submits within ``max_body``; an action that
        cannot be sent, too large or not encodable, fails alone as ``rejected``, naming why: one bad
        payload must not take the others, nor stop the socket's thread.
        """
        update: dict[str, Any] = {"server_id": self._server_id or ""}  # what its sessions live on
        if self.unacked:
            update["acks"] = message.acks + self.take_acks()
        message = message.model_copy(update=update)
        frames, refused = wire.encode_within(message, "actions", self.settings.max_body)
        if refused:
            log.warning("%d action(s) cannot be sent: %s", len(refused), refused[0][1])
            self._resolve(
                [Result.failure(a.id, "rejected", f"the action cannot be sent: {why}") for a, why in refused]
            )
            if not frames and message.acks:
                frames.append(wire.encode(Ack(action_ids=message.acks)))
        return frames

    def take_acks(self) -> list[str]:
        """The acknowledgements due (as many as one message lists), for a Submit the caller builds
        itself; the rest stay due.
        """
        acks, self.unacked = self.unacked[:MAX_IDS_PER_MESSAGE], self.unacked[MAX_IDS_PER_MESSAGE:]
        if not self.unacked:
            self.ack_due = None
        return acks

    # --- what comes in -------------------------------------------------------------------------------
    def receive(self, frames: list[bytes], now: float) -> None:
        """Handle one message from the orchestrator."""
        self.last_heard = now
        self.messages_heard += 1
        try:
            message = wire.decode_frames(frames, self.settings.max_body)
        except ProtocolError as exc:
            log.warning("dropping a malformed message from the orchestrator: %s", exc)
            return
        if isinstance(message, Results):
            self._resolve(message.results)
            self.unacked.extend(r.action_id for r in message.results)
            if self.ack_due is None:
                self.ack_due = now + ACK_DELAY_S
            return
        if isinstance(message, Error):
            if message.code == "busy":
                self._defer(message.action_ids, now)
            elif message.action_ids:
                detail = f"{message.code}: {message.message}"
                self._resolve(
                    [
                        Result.failure(i, "rejected", detail + self._hint(message.code, i))
                        for i in message.action_ids
                    ]
                )
            else:
                log.warning("orchestrator reported an error: %s: %s", message.code, message.message)
            return
        if isinstance(message, Heartbeat):
            restarted = self._on_server_id(message.server_id)
            self._on_counts(message, restarted)
        with self.lock:
            waiting = self.requests.get(message.kind)  # type: ignore[attr-defined]
            fut = waiting.popleft() if waiting else None
        if fut is not None and not fut.done():
            fut.set_result(message)

    # --- timers --------------------------------------------------------------------------------------
    def next_wake(self) -> float | None:
        """When :meth:`tick` has something to do (``None``: nothing until a message or a call)."""
        times = [t for t in (self.ack_due, self._busy[0][0] if self._busy else None) if t is not None]
        if self.pending or self.sessions:
            times.append(self.next_beat)
        return min(times) if times else None

    def end_sessions(self) -> None:
        """Queue the end of every sandbox session this connection used and did not close: its client
        is closing (or the process exiting), and nobody would heartbeat for them; the orchestrator
        would keep their sandboxes for ``client_timeout_s`` first.
        """
        with self.lock:
            sessions = sorted(self.sessions)
        self.outbox.extend(CloseSessions(session_ids=ids) for ids in id_batches(sessions))

    def queue_acks(self) -> None:
        """Every acknowledgement due, as lone Ack messages in the outbox."""
        while self.unacked:
            self.outbox.append(Ack(action_ids=self.take_acks()))

    def tick(self, now: float) -> None:
        """Do what is due: resubmit deferred actions, send lone acknowledgements, heartbeat, and fail
        what waits on an orchestrator that went silent.
        """
        self._resubmit_busy(now)
        if self.ack_due is not None and now >= self.ack_due:  # no Submit came to carry them
            self.queue_acks()
        if not self.unacked:
            self.ack_due = None
        if now >= self.next_beat:
            self.next_beat = now + self.settings.heartbeat_s
            if self.pending or self.sessions:  # open sessions too: a silent client's sessions are ended
                self.outbox.append(Heartbeat())
            if self.pending and now - self.last_heard > self.settings.server_timeout_s:
                self.fail_all(
                    ServerUnavailable(
                        f"the orchestrator at {self.address} was silent for {now - self.last_heard:.0f}s"
                    )
                )

    def idle(self, now: float) -> None:
        """Nothing is outstanding: the next heartbeat is due a full interval after work resumes."""
        self.next_beat = now + self.settings.heartbeat_s

    def fail_all(self, exc: BaseException) -> None:
        """Fail every outstanding action and request with ``exc``."""
        with self.lock:
            pending, self.pending = self.pending, {}
            requests = list(itertools.chain.from_iterable(self.requests.values()))
            self.requests.clear()
        self._busy.clear()
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(exc)
        for req in requests:
            if not req.done():
                req.set_exception(exc)

    # --- internals -----------------------------------------------------------------------------------
    def _resolve(self, results: list[Result]) -> None:
        for result in results:
            original, attempt = self._attempts.pop(result.action_id, (result.action_id, 0))
            with self.lock:
                entry = self.pending.pop(result.action_id, None)
            if entry is None:
                continue
            fut, action = entry
            if not result.ok and attempt < self.settings.retries.get(result.error_type or "", 0):
                # Retry as a new attempt (a new id: ids run at most once); the same future waits for it.
                retry = action.model_copy(update={"id": f"{original}~{attempt + 1}"})
                self._attempts[retry.id] = (original, attempt + 1)
                with self.lock:
                    self.pending[retry.id] = (fut, retry)
                log.info("retrying %s after %s: %s", original, result.error_type, result.message)
                self.outbox.append(Submit(actions=[retry]))
                continue
            if not fut.done():
                fut.set_result(result.model_copy(update={"action_id": original}) if attempt else result)

    def _hint(self, code: str, action_id: str) -> str:
        """Why the orchestrator does not know a kind this process registered (``unknown_kind`` only)."""
        if code != "unknown_kind":
            return ""
        with self.lock:
            entry = self.pending.get(action_id)
        if entry is None:
            return ""
        from tangram_env.embedded import unknown_kind_hint  # only on this error: it starts nothing

        return unknown_kind_hint(entry[1].kind, self.address)

    def _defer(self, action_ids: list[str], now: float) -> None:
        """The server is too busy for these: resubmit after a growing wait (backpressure)."""
        when = now + self._backoff
        self._backoff = min(1.0, self._backoff * 2)
        self._busy.extend((when, i) for i in action_ids)
        self._busy.sort()

    def _resubmit_busy(self, now: float) -> None:
        due = [i for t, i in self._busy if t <= now]
        if not due:
            return
        self._busy = [(t, i) for t, i in self._busy if t > now]
        with self.lock:
            actions = [self.pending[i][1] for i in due if i in self.pending]
        self.outbox.extend(submissions(actions))
        if not self._busy:
            self._backoff = self.settings.busy_backoff_s

    @property
    def server_id(self) -> str | None:
        """The id of the orchestrator last heard from (None: none yet)."""
        return self._server_id

    def _on_counts(self, beat: Heartbeat, restarted: bool) -> None:
        """Resubmit everything unanswered if the orchestrator's counts show messages lost since its last
        answer: a Submit it never heard, or results it sent that never came (ZeroMQ reconnects a
        broken connection on its own, and what was in flight is gone). Ids dedupe: an action it has
        runs once, and one it finished answers again.
        """
        if beat.sent is None or beat.heard is None or beat.answered is None:
            return  # not an answer to our beat, or an orchestrator that does not count
        lost = (beat.sent + 1 - beat.heard, beat.answered - (self.messages_heard - 1))
        if not restarted and (lost[0] > self._lost[0] or lost[1] > self._lost[1]):
            with self.lock:
                actions = [action for _, action in self.pending.values()]
            log.warning(
                "%d message(s) to and %d from the orchestrator were lost (its connection broke and came "
                "back); resubmitting %d actions",
                lost[0] - self._lost[0],
                lost[1] - self._lost[1],
                len(actions),
            )
            self.outbox.extend(submissions(actions))
        self._lost = lost  # after a restart its counts start again: what was lost is resubmitted

    def _on_server_id(self, server_id: str) -> bool:
        """A new orchestrator id means it restarted: resubmit everything unanswered (ids dedupe), but
        for actions of open sandbox sessions, whose sandboxes ended with it: those fail, as will the
        sessions' next actions until they are closed. Returns whether it restarted.
        """
        restarted = self._server_id is not None and server_id != self._server_id
        if restarted:
            why = (
                f"the orchestrator restarted ({self._server_id} -> {server_id}): this session's sandbox "
                "is gone with its files; close the session and open a new one"
            )
            with self.lock:
                self.lost_sessions.update(dict.fromkeys(self.sessions, why))
                lost = [i for i, (_, a) in self.pending.items() if a.affinity in self.lost_sessions]
                failed = [(self.pending.pop(i)[0], i) for i in lost]
                actions = [action for _, action in self.pending.values()]
            log.warning(
                "orchestrator restarted (%s -> %s); resubmitting %d actions, failing %d of %d open sessions",
                self._server_id,
                server_id,
                len(actions),
                len(failed),
                len(self.sessions),
            )
            self.outbox.extend(submissions(actions))
            for fut, action_id in failed:
                original, _ = self._attempts.pop(action_id, (action_id, 0))  # a retry answers as its first
                if not fut.done():
                    fut.set_result(Result.failure(original, "sandbox_died", why))
        self._server_id = server_id
        return restarted
