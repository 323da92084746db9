"""The ZeroMQ client: submit actions, get one future per action.

One background thread owns the DEALER socket (ZeroMQ sockets are not thread-safe); callers on any
thread hand it messages through a queue and wake it through an inproc socket. Results resolve futures;
failures arrive as :class:`~tangram_env.protocol.Result` data (``ok=False``) and become typed exceptions
only in :meth:`Client.call` / :meth:`Result.unwrap`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import zmq
from pydantic import BaseModel

from tangram_env import wire
from tangram_env.errors import ClosedEnvError, ProtocolError, ServerUnavailable
from tangram_env.protocol import (
    Ack,
    Action,
    Cancel,
    CloseSessions,
    Error,
    Heartbeat,
    ListKinds,
    Result,
    Results,
    Stats,
    Submit,
)
from tangram_env.settings import ClientSettings

if TYPE_CHECKING:
    from tangram_env.session import SandboxSession

log = logging.getLogger(__name__)

_SUBMIT_BATCH = 512  # actions per Submit message: bounds message size, amortises encoding
_ACK_DELAY_S = 0.05  # acknowledgements wait this long for a Submit to carry them
_DIRECT_WAIT_S = 0.005  # run() waits this long on the socket itself before handing over to the IO thread
_TURN_S = 0.05  # longest poll of the IO thread while it holds the socket


class Client:
    """A connection to an orchestrator. Thread-safe; use one per process (or per env, as you like).

    ``address=None`` reads ``TANGRAM_ADDRESS``; when that is unset too, an embedded orchestrator is
    started for this process (see :mod:`tangram_env.embedded`) and stopped when its last client closes.
    """

    def __init__(
        self, address: str | None = None, *, settings: ClientSettings | None = None, **overrides: Any
    ):
        self.settings = settings or ClientSettings(**overrides)
        self._embedded = None
        address = address or self.settings.address
        if address is None:
            from tangram_env.embedded import acquire_embedded

            self._embedded = acquire_embedded()
            address = self._embedded.address
        self.address: str = address
        self.identity = uuid.uuid4().hex.encode()
        # Ids of actions this client makes up: a random prefix no other client can guess, then a count.
        self._id_prefix = f"{uuid.uuid4().hex}-"
        self._id_counter = itertools.count()
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._outbox: collections.deque[BaseModel] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()  # callers wake the IO thread; cheaper than a socket
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._unacked: list[str] = []  # result ids to acknowledge (sent with the next Submit, or soon)
        # The socket belongs to whoever holds this lock: the IO thread while it has work, or a caller of
        # run()/call() that finds it free (a direct round trip, no thread hop: the fast path).
        self._sock_lock = threading.Lock()
        self._sock: zmq.Socket[bytes] | None = None
        self._sock_poller = zmq.Poller()  # the socket alone; made once (Socket.poll builds one per call)
        self._work = threading.Event()  # the parked IO thread waits on this
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[Future[Result], Action]] = {}
        self._requests: dict[str, collections.deque[Future[Any]]] = collections.defaultdict(collections.deque)
        self._server_id: str | None = None
        self._attempts: dict[str, tuple[str, int]] = {}  # retry attempt id -> (original id, attempt number)
        self._busy: list[tuple[float, str]] = []  # (when, action id) to resubmit after a "busy" answer
        self._backoff = self.settings.busy_backoff_s
        self._last_heard = time.monotonic()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tangram-client", daemon=True)
        self._ready = threading.Event()
        self._thread_error: BaseException | None = None
        self._thread.start()
        self._ready.wait()
        if self._thread_error is not None:
            self.close()
            raise ServerUnavailable(f"cannot connect to {self.address!r}: {self._thread_error}")
        try:
            self.ping(timeout_s=self.settings.connect_timeout_s)
        except BaseException:
            self.close()
            raise

    # --- public API -------------------------------------------------------------------------------
    def submit(self, actions: Sequence[Action]) -> list[Future[Result]]:
        """Queue ``actions`` on the orchestrator; each future resolves to its :class:`Result`."""
        self._check_open()
        futures: list[Future[Result]] = []
        with self._lock:
            for action in actions:
                existing = self._pending.get(action.id)
                if existing is not None:  # same id again: same outcome, it never runs twice
                    futures.append(existing[0])
                    continue
                fut: Future[Result] = Future()
                fut.set_running_or_notify_cancel()
                self._pending[action.id] = (fut, action)
                futures.append(fut)
        for start in range(0, len(actions), _SUBMIT_BATCH):
            self._send(Submit(actions=list(actions[start : start + _SUBMIT_BATCH])))
        return futures

    def run(
        self, kind: str, payload: dict[str, Any] | None = None, *, timeout: float | None = None, **fields: Any
    ) -> Result:
        """Run one action and wait for its result (``ok`` tells whether it succeeded).

        When no other thread is using the connection, the calling thread does the round trip itself
        (short actions then cost one ZeroMQ round trip, no thread switch); after a few milliseconds
        without an answer it leaves the wait to the IO thread.
        """
        if "id" not in fields:  # cheaper than a random id per action, and as unique
            fields["id"] = f"{self._id_prefix}{next(self._id_counter)}"
        action = Action(kind=kind, payload=payload or {}, **fields)
        self._check_open()
        with self._lock:
            if action.id in self._pending:
                return self._pending[action.id][0].result(timeout)
            fut: Future[Result] = Future()  # never shown to the caller, so never cancelled
            self._pending[action.id] = (fut, action)
        if not self._sock_lock.acquire(blocking=False):
            self._send(Submit(actions=[action]))
            return fut.result(timeout)
        try:
            sock = self._sock
            if sock is None:
                raise ClosedEnvError("this client is closed")
            self._send_outbox(sock)  # anything queued first, in order
            acks, self._unacked = self._unacked, []
            sock.send(wire.encode(Submit(actions=[action], acks=acks)))
            end = time.monotonic() + _DIRECT_WAIT_S
            while not fut.done():
                left_ms = int((end - time.monotonic()) * 1000)
                if left_ms <= 0 or not self._sock_poller.poll(left_ms):
                    break
                self._drain(sock, ready=True)
                self._send_outbox(sock)
        finally:
            self._sock_lock.release()
        if not fut.done() or self._outbox or self._pending:
            self._wake()  # the IO thread takes over the waits (and sends anything left)
        return fut.result(timeout)

    def call(
        self, kind: str, payload: dict[str, Any] | None = None, *, timeout: float | None = None, **fields: Any
    ) -> Any:
        """Run one action and return its value, raising its typed error if it failed."""
        return self.run(kind, payload, timeout=timeout, **fields).unwrap()

    def score(
        self, model: str, items: Sequence[Any], *, timeout: float | None = None, **fields: Any
    ) -> list[float]:
        """Scores of ``items`` from the reward model ``model``, in order."""
        return list(self.call(model, {"items": list(items)}, timeout=timeout, **fields))

    def sandbox(self, image: str = "default", **options: Any) -> SandboxSession:
        """A sandbox session: ``with client.sandbox(image=...) as box: box.bash("ls")``.

        See :class:`~tangram_env.session.SandboxSession` for the options.
        """
        from tangram_env.session import SandboxSession

        return SandboxSession(self, image=image, **options)

    def cancel(self, action_ids: Sequence[str]) -> None:
        """Cancel actions that have not started (started ones run to completion or timeout)."""
        self._send(Cancel(action_ids=list(action_ids)))

    def close_sessions(self, session_ids: Sequence[str]) -> None:
        """End sandbox sessions: their sandboxes are reset and go back to the warm pool."""
        if session_ids and not self._closed:
            self._send(CloseSessions(session_ids=list(session_ids)))

    def close_trajectories(self, trajectory_ids: Sequence[str]) -> None:
        """Say that trajectories ended: a policy that binds resources to a trajectory frees them."""
        if trajectory_ids and not self._closed:
            self._send(CloseSessions(session_ids=[], trajectory_ids=list(trajectory_ids)))

    def kinds(self, timeout_s: float = 10.0) -> dict[str, dict[str, Any]]:
        """The tools and reward models the orchestrator serves (name -> description)."""
        reply = self._request(ListKinds(), "list_kinds", timeout_s)
        assert isinstance(reply, ListKinds)
        return reply.kinds

    def stats(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The orchestrator's figures (queue, running, ACT per kind, workers, errors)."""
        reply = self._request(Stats(), "stats", timeout_s)
        assert isinstance(reply, Stats)
        return reply.figures

    def ping(self, timeout_s: float = 5.0) -> str:
        """Round trip a heartbeat; returns the orchestrator's id or raises :class:`ServerUnavailable`."""
        try:
            reply = self._request(Heartbeat(), "heartbeat", timeout_s)
        except TimeoutError:
            raise ServerUnavailable(
                f"no orchestrator answered at {self.address} within {timeout_s:g}s"
            ) from None
        assert isinstance(reply, Heartbeat)
        return reply.server_id

    @property
    def outstanding(self) -> int:
        """Actions submitted and not yet answered."""
        return len(self._pending)

    def close(self) -> None:
        """Stop the IO thread and fail what is still outstanding with :class:`ClosedEnvError`."""
        if self._closed:
            return
        self._closed = True
        self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        self._fail_all(ClosedEnvError("the client was closed"))
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self._embedded is not None:
            self._embedded.release()
            self._embedded = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort: a forgotten client still frees its embedded server
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:
                pass

    # --- internals --------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedEnvError("this client is closed")

    def _send(self, message: BaseModel) -> None:
        self._check_open()
        self._outbox.append(message)
        self._wake()

    def _wake(self) -> None:
        self._work.set()
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (the IO thread is awake anyway) or closed

    def _request(self, message: BaseModel, reply_kind: str, timeout_s: float) -> BaseModel:
        fut: Future[Any] = Future()
        with self._lock:
            self._requests[reply_kind].append(fut)
        self._send(message)
        try:
            return fut.result(timeout_s)
        except TimeoutError:
            with self._lock:
                if fut in self._requests[reply_kind]:
                    self._requests[reply_kind].remove(fut)
            raise

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            requests = list(itertools.chain.from_iterable(self._requests.values()))
            self._requests.clear()
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(exc)
        for req in requests:
            if not req.done():
                req.set_exception(exc)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.ROUTING_ID, self.identity)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.settings.max_body)
            if self.settings.curve_server_key:
                from tangram_env.curve import configure_client_curve

                configure_client_curve(sock, self.settings.curve_server_key)
            sock.connect(self.address)
        except (zmq.ZMQError, ValueError) as exc:  # a malformed address, a bad key: say so, do not hang
            self._thread_error = exc
            sock.close(linger=0)
            self._ready.set()
            return
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        self._sock_poller.register(sock, zmq.POLLIN)
        self._sock = sock
        self._ready.set()
        next_beat = time.monotonic() + self.settings.heartbeat_s
        ack_due: float | None = None
        try:
            while not self._closed:
                if self._quiet():
                    # Park without the socket, so run() can use it directly; wake for work, or to
                    # acknowledge results that no Submit carried.
                    if not self._unacked:
                        ack_due = None
                    elif ack_due is None:
                        ack_due = time.monotonic() + _ACK_DELAY_S
                    self._work.wait(None if ack_due is None else max(0.0, ack_due - time.monotonic()))
                    self._work.clear()
                    if ack_due is not None and time.monotonic() >= ack_due and self._quiet():
                        with self._sock_lock:
                            if self._unacked:
                                sock.send(wire.encode(Ack(action_ids=self._unacked)))
                                self._unacked = []
                        ack_due = None
                    next_beat = time.monotonic() + self.settings.heartbeat_s
                    continue
                with self._sock_lock:
                    if not self._quiet():  # a direct run() may have done the work while we waited
                        ack_due, next_beat = self._turn(sock, poller, ack_due, next_beat)
        except Exception:  # never die silently: whoever waits must hear of it
            if not self._closed:
                log.exception("tangram client IO thread crashed")
                self._fail_all(ServerUnavailable("the client's IO thread crashed; see the log"))
        finally:
            with self._sock_lock:
                self._sock = None
                sock.close(linger=0)

    def _quiet(self) -> bool:
        """Nothing in flight: no outstanding action, message, request or deferred resubmission."""
        return not (self._pending or self._outbox or self._busy or any(self._requests.values()))

    def _turn(
        self, sock: zmq.Socket[bytes], poller: zmq.Poller, ack_due: float | None, next_beat: float
    ) -> tuple[float | None, float]:
        """One round of the IO thread while it has work: send, wait a little, receive, timers."""
        self._send_outbox(sock)
        now = time.monotonic()
        wake_at = min(next_beat, self._busy[0][0]) if self._busy else next_beat
        if ack_due is not None:
            wake_at = min(wake_at, ack_due)
        # Short waits: the socket lock is held meanwhile, and run() on another thread wants it.
        events = dict(poller.poll(int(max(0.0, min(wake_at - now, _TURN_S)) * 1000)))
        if self._wake_r in events:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        self._drain(sock)
        now = time.monotonic()
        self._resubmit_busy(now)
        if not self._unacked:
            ack_due = None
        elif ack_due is None:
            ack_due = now + _ACK_DELAY_S
        elif now >= ack_due:  # no Submit came to carry them: acknowledge on their own
            self._outbox.append(Ack(action_ids=self._unacked))
            self._unacked, ack_due = [], None
        if now >= next_beat:
            next_beat = now + self.settings.heartbeat_s
            if self._pending:
                self._outbox.append(Heartbeat())
                if now - self._last_heard > self.settings.server_timeout_s:
                    self._fail_all(
                        ServerUnavailable(
                            f"the orchestrator at {self.address} was silent for {now - self._last_heard:.0f}s"
                        )
                    )
        return ack_due, next_beat

    def _drain(self, sock: zmq.Socket[bytes], ready: bool = False) -> None:
        """Handle every message waiting on the socket (the caller holds the socket lock).

        ``ready``: the caller's poll just said a message is there (saves asking again).
        """
        while ready or self._sock_poller.poll(0):
            ready = False
            self._unacked.extend(self._on_frames(sock.recv_multipart()))

    def _send_outbox(self, sock: zmq.Socket[bytes]) -> None:
        while self._outbox:
            message = self._outbox.popleft()
            if self._unacked and isinstance(message, Submit):  # acknowledgements ride along
                message = message.model_copy(update={"acks": self._unacked})
                self._unacked = []
            sock.send(wire.encode(message))

    def _on_frames(self, frames: list[bytes]) -> list[str]:
        """Handle one message from the orchestrator; returns result ids to acknowledge."""
        self._last_heard = time.monotonic()
        try:
            message = wire.decode_frames(frames, self.settings.max_body)
        except ProtocolError as exc:
            log.warning("dropping a malformed message from the orchestrator: %s", exc)
            return []
        if isinstance(message, Results):
            return self._resolve(message.results)
        if isinstance(message, Error):
            if message.code == "busy":
                self._defer(message.action_ids)
            elif message.action_ids:
                rejected = [
                    Result.failure(i, "rejected", f"{message.code}: {message.message}")
                    for i in message.action_ids
                ]
                self._resolve(rejected)
            else:
                log.warning("orchestrator reported an error: %s: %s", message.code, message.message)
            return []
        if isinstance(message, Heartbeat):
            self._on_server_id(message.server_id)
        with self._lock:
            waiting = self._requests.get(message.kind)  # type: ignore[attr-defined]
            fut = waiting.popleft() if waiting else None
        if fut is not None and not fut.done():
            fut.set_result(message)
        return []

    def _resolve(self, results: list[Result]) -> list[str]:
        done: list[str] = []
        for result in results:
            done.append(result.action_id)
            original, attempt = self._attempts.pop(result.action_id, (result.action_id, 0))
            with self._lock:
                entry = self._pending.pop(result.action_id, None)
            if entry is None:
                continue
            fut, action = entry
            if not result.ok and attempt < self.settings.retries.get(result.error_type or "", 0):
                # Retry as a new attempt (a new id: ids run at most once); the same future waits for it.
                retry = action.model_copy(update={"id": f"{original}~{attempt + 1}"})
                self._attempts[retry.id] = (original, attempt + 1)
                with self._lock:
                    self._pending[retry.id] = (fut, retry)
                log.info("retrying %s after %s: %s", original, result.error_type, result.message)
                self._outbox.append(Submit(actions=[retry]))
                continue
            if not fut.done():
                fut.set_result(result.model_copy(update={"action_id": original}) if attempt else result)
        return done

    def _defer(self, action_ids: list[str]) -> None:
        """The server is too busy for these: resubmit after a growing wait (backpressure)."""
        when = time.monotonic() + self._backoff
        self._backoff = min(1.0, self._backoff * 2)
        self._busy.extend((when, i) for i in action_ids)
        self._busy.sort()

    def _resubmit_busy(self, now: float) -> None:
        due = [i for t, i in self._busy if t <= now]
        if not due:
            return
        self._busy = [(t, i) for t, i in self._busy if t > now]
        with self._lock:
            actions = [self._pending[i][1] for i in due if i in self._pending]
        for start in range(0, len(actions), _SUBMIT_BATCH):
            self._outbox.append(Submit(actions=actions[start : start + _SUBMIT_BATCH]))
        if not self._busy:
            self._backoff = self.settings.busy_backoff_s

    def _on_server_id(self, server_id: str) -> None:
        """A new orchestrator id means it restarted: resubmit everything unanswered (ids dedupe)."""
        if self._server_id is not None and server_id != self._server_id:
            with self._lock:
                actions = [action for _, action in self._pending.values()]
            log.warning(
                "orchestrator restarted (%s -> %s); resubmitting %d actions",
                self._server_id,
                server_id,
                len(actions),
            )
            for start in range(0, len(actions), _SUBMIT_BATCH):
                self._outbox.append(Submit(actions=actions[start : start + _SUBMIT_BATCH]))
        self._server_id = server_id
