"""The ZeroMQ client: submit actions, get one future per action.

One background thread owns the DEALER socket (ZeroMQ sockets are not thread-safe); callers on any
thread hand it messages through a queue and wake it through a pipe, and a caller of :meth:`Client.run`
that finds the socket free does its round trip itself. The rules (retries, backpressure, acknowledgements,
heartbeats, resubmission after a restart) live in :class:`~tangram_env.client_core.ClientCore`, which
the asyncio client shares. Results resolve futures;
failures arrive as :class:`~tangram_env.protocol.Result` data (``ok=False``) and become typed exceptions
only in :meth:`Client.call` / :meth:`Result.unwrap`.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import zmq
from pydantic import BaseModel

from tangram_env.client_core import ClientCore, connect_dealer, submissions
from tangram_env.errors import ClosedEnvError, ForkedClientError, ServerUnavailable, no_answer
from tangram_env.protocol import (
    Action,
    Cancel,
    CloseSessions,
    Heartbeat,
    ListKinds,
    Result,
    Stats,
    Submit,
    id_batches,
)
from tangram_env.settings import ClientSettings, check_address

if TYPE_CHECKING:
    from tangram_env.session import SandboxSession

log = logging.getLogger(__name__)

_DIRECT_WAIT_S = 0.005  # run() waits this long on the socket itself before handing over to the IO thread
_TURN_S = 0.05  # longest poll of the IO thread while it holds the socket
_EXIT_CHECK_S = 0.5  # how often the IO thread looks whether an embedded orchestrator exited


def score_items(model: str, items: Sequence[Any]) -> list[Any]:
    """``items`` as the list a reward model scores, refusing a lone string, bytes or mapping: ``list()``
    would split it into characters or keys and score each, one score per character.
    """
    if isinstance(items, str | bytes | bytearray | Mapping):
        raise TypeError(
            f"score({model!r}, items) takes a sequence of items, got one {type(items).__name__}: "
            f"pass [item] to score a single item"
        )
    return list(items)


#: Forks between the process that imported this module and this one: a client knows the count it
#: was made at, and a forked child, which has none of its connection, refuses to use it.
_forks = 0
#: Every client open in this process: closed at exit, so that their sandboxes end then, not a minute
#: later (an interpreter's exit does not wait for the IO thread, a daemon).
_open_clients: weakref.WeakSet[Client] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for client in list(_open_clients):
        with contextlib.suppress(Exception):
            client.close()


def _count_fork() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_count_fork)


class Client:
    """A connection to an orchestrator. Thread-safe; use one per process (or per env, as you like).

    ``address=None`` reads ``TANGRAM_ADDRESS``; when that is unset too, an embedded orchestrator is
    started for this process (see :mod:`tangram_env.embedded`) and stopped when its last client closes.
    """

    def __init__(
        self, address: str | None = None, *, settings: ClientSettings | None = None, **overrides: Any
    ):
        self.settings = settings or ClientSettings.resolve(**overrides)
        self._embedded = None
        address = check_address(address) if address else self.settings.address
        if address is None:
            from tangram_env.embedded import acquire_embedded

            self._embedded = acquire_embedded()
            address = self._embedded.address
        self.address: str = address
        self._forks, self._pid = _forks, os.getpid()
        self.identity = uuid.uuid4().hex.encode()
        # Ids of actions this client makes up: a random prefix no other client can guess, then a count.
        self._id_prefix = f"{uuid.uuid4().hex}-"
        self._id_counter = itertools.count()
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._wake_r, self._wake_w = os.pipe()  # callers wake the IO thread; cheaper than a socket
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # The socket belongs to whoever holds this lock: the IO thread while it has work, or a caller of
        # run()/call() that finds it free (a direct round trip, no thread hop: the fast path).
        self._sock_lock = threading.Lock()
        self._sock: zmq.Socket[bytes] | None = None
        self._sock_poller = zmq.Poller()  # the socket alone; made once (Socket.poll builds one per call)
        self._work = threading.Event()  # the parked IO thread waits on this
        self._core: ClientCore[Future[Any]] = ClientCore(self.settings, address, time.monotonic())
        self._next_exit_check = 0.0  # when the IO thread next looks whether the embedded child exited
        self._closed = False
        self._on_close: list[Callable[[], None]] = []  # its asyncio twins close with it
        self._thread = threading.Thread(target=self._run, name="tangram-client", daemon=True)
        self._ready = threading.Event()
        self._thread_error: BaseException | None = None
        self._thread.start()
        _open_clients.add(self)
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
        self._check_reachable()
        futures, new = self._core.register(actions, _running_future, time.monotonic())
        if new:
            self._core.outbox.extend(submissions(new))
            self._wake()
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
        self._check_reachable()
        # A parked IO thread must learn of a new session, or it never heartbeats for it.
        opens_session = action.affinity is not None and action.affinity not in self._core.sessions
        # The future is never shown to the caller, so never cancelled.
        (fut,), new = self._core.register([action], Future, time.monotonic())
        if not new:  # the same id is outstanding: same outcome
            return _wait(fut, timeout, action)
        if not self._sock_lock.acquire(blocking=False):
            self._send(Submit(actions=[action]))
            return _wait(fut, timeout, action)
        try:
            sock = self._sock
            if sock is None:
                raise ClosedEnvError("this client is closed")
            self._core.outbox.append(Submit(actions=[action]))  # after anything queued, in order
            self._send_outbox(sock)
            end = time.monotonic() + _DIRECT_WAIT_S
            while not fut.done():
                left_ms = int((end - time.monotonic()) * 1000)
                if left_ms <= 0 or not self._sock_poller.poll(left_ms):
                    break
                self._drain(sock, ready=True)
                self._send_outbox(sock)
        finally:
            self._sock_lock.release()
        if opens_session or not fut.done() or self._core.outbox or self._core.pending:
            self._wake()  # the IO thread takes over the waits (and sends anything left), or heartbeats
        return _wait(fut, timeout, action)

    def call(
        self, kind: str, payload: dict[str, Any] | None = None, *, timeout: float | None = None, **fields: Any
    ) -> Any:
        """Run one action and return its value, raising its typed error if it failed."""
        return self.run(kind, payload, timeout=timeout, **fields).unwrap()

    def score(
        self, model: str, items: Sequence[Any], *, timeout: float | None = None, **fields: Any
    ) -> list[float]:
        """Scores of ``items`` from the reward model ``model``, in order."""
        return list(self.call(model, {"items": score_items(model, items)}, timeout=timeout, **fields))

    def sandbox(self, image: str = "default", **options: Any) -> SandboxSession:
        """A sandbox session: ``with client.sandbox(image=...) as box: box.bash("ls")``.

        See :class:`~tangram_env.session.SandboxSession` for the options.
        """
        from tangram_env.session import SandboxSession

        return SandboxSession(self, image=image, **options)

    def cancel(self, action_ids: Sequence[str]) -> None:
        """Cancel actions: one that has not started never runs, one that runs is stopped (its result is
        ``cancelled``; a reward model's batch on a device ends as it would).
        """
        for ids in id_batches(list(action_ids)):
            self._send(Cancel(action_ids=ids))

    @property
    def server_id(self) -> str | None:
        """The id of the orchestrator this client last heard from (a new one: it restarted)."""
        return self._core.server_id

    def close_sessions(self, session_ids: Sequence[str]) -> None:
        """End sandbox sessions: their sandboxes are reset and go back to the warm pool."""
        if session_ids and not self._closed:
            for ids in id_batches(list(session_ids)):
                self._send(CloseSessions(session_ids=ids))

    def keep_alive(self, session_ids: Iterable[str], alive: bool = True) -> None:
        """Heartbeat for these sandbox sessions while they are open (an :class:`AsyncClient` made from
        this client, whose loop may not run between a trainer's batches, asks), or stop to.
        """
        sessions = self._core.sessions
        with self._core.lock:
            if not alive:
                sessions.difference_update(session_ids)
                return
            opened = set(session_ids) - sessions
            sessions.update(opened)
        if opened:
            self._wake()  # a parked IO thread computes its next wake-up again

    def close_trajectories(self, trajectory_ids: Sequence[str]) -> None:
        """Say that trajectories ended: a policy that binds resources to a trajectory frees them."""
        if trajectory_ids and not self._closed:
            for ids in id_batches(list(trajectory_ids)):
                self._send(CloseSessions(session_ids=[], trajectory_ids=ids))

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
            raise no_answer(self.address, timeout_s, bool(self.settings.curve_server_key)) from None
        assert isinstance(reply, Heartbeat)
        return reply.server_id

    @property
    def outstanding(self) -> int:
        """Actions submitted and not yet answered."""
        return len(self._core.pending)

    def close(self) -> None:
        """Stop the IO thread and fail what is still outstanding with :class:`ClosedEnvError`."""
        if self._closed:
            return
        self._closed = True
        if self.forked:  # the connection, the IO thread and the embedded server are the parent's
            self._embedded = None
            os.close(self._wake_r)
            os.close(self._wake_w)
            return
        self._core.end_sessions()  # sent by the IO thread as it stops
        self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        self._core.fail_all(ClosedEnvError("the client was closed"))
        for close_twin in list(self._on_close):
            close_twin()
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
    @property
    def forked(self) -> bool:
        """Whether this process was forked from the one that made this client (which it cannot use)."""
        return self._forks != _forks

    def _check_open(self) -> None:
        if self.forked:
            raise ForkedClientError(
                f"this Client was made in process {self._pid}, and process {os.getpid()} was forked from "
                "it: its connection stayed in the parent. Make a new Client (or env) in this process "
                f"(a subprocess's own: gymnasium's AsyncVectorEnv makes its envs there); address="
                f"{self.address!r} reaches the same orchestrator while its process serves it"
            )
        if self._closed:
            raise ClosedEnvError("this client is closed")

    def _check_reachable(self) -> None:
        """Raise at once for work no orchestrator will ever answer (its embedded child exited)."""
        gone = self.embedded_exit()
        if gone is not None:
            raise ServerUnavailable(gone)

    def embedded_exit(self) -> str | None:
        """Why the embedded orchestrator of this client is gone, if it exited (None otherwise)."""
        return self._embedded.exited() if self._embedded is not None else None

    def fail_if_embedded_exited(self, core: ClientCore[Any]) -> None:
        """Fail what ``core`` waits for, saying why, if the embedded orchestrator exited: at once, not
        after ``server_timeout_s`` of silence.
        """
        gone = self.embedded_exit()
        if gone is not None:
            core.fail_all(ServerUnavailable(gone))

    def _send(self, message: BaseModel) -> None:
        self._check_open()
        self._core.outbox.append(message)
        self._wake()

    def _wake(self) -> None:
        self._work.set()
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (the IO thread is awake anyway) or closed

    def _request(self, message: BaseModel, reply_kind: str, timeout_s: float) -> BaseModel:
        fut: Future[Any] = Future()
        self._core.expect(reply_kind, fut)
        self._send(message)
        try:
            return fut.result(timeout_s)
        except TimeoutError:
            self._core.forget_request(reply_kind, fut)
            raise

    def _run(self) -> None:
        try:
            sock = connect_dealer(self._ctx, self.address, self.identity, self.settings)
        except (zmq.ZMQError, ValueError) as exc:  # a malformed address, a bad key: say so, do not hang
            self._thread_error = exc
            self._ready.set()
            return
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        self._sock_poller.register(sock, zmq.POLLIN)
        self._sock = sock
        self._ready.set()
        core = self._core
        try:
            while not self._closed:
                if core.quiet:
                    # Park without the socket, so run() can use it directly; wake for work, to
                    # acknowledge results that no Submit carried, or to heartbeat for open sessions.
                    wake_at = core.next_wake()
                    self._work.wait(None if wake_at is None else max(0.0, wake_at - time.monotonic()))
                    self._work.clear()
                    now = time.monotonic()
                    if wake_at is not None and now >= wake_at and core.quiet:
                        with self._sock_lock:
                            core.tick(now)
                            self._send_outbox(sock)
                            self._drain(sock)  # the orchestrator's answers to those heartbeats
                    if not core.sessions:
                        core.idle(now)
                    continue
                with self._sock_lock:
                    if not core.quiet:  # a direct run() may have done the work while we waited
                        self._turn(sock, poller)
        except Exception:  # never die silently: whoever waits must hear of it
            if not self._closed:
                log.exception("tangram client IO thread crashed")
                core.fail_all(ServerUnavailable("the client's IO thread crashed; see the log"))
        finally:
            with self._sock_lock:
                self._sock = None
                core.queue_acks()  # else the orchestrator keeps the last results result_ttl_s for nobody
                with contextlib.suppress(zmq.ZMQError):
                    self._send_outbox(sock)  # what close found queued (a session's end) still goes
                sock.close(linger=1000)  # the context's IO thread flushes it; close itself does not wait

    def _turn(self, sock: zmq.Socket[bytes], poller: zmq.Poller) -> None:
        """One round of the IO thread while it has work: send, wait a little, receive, timers."""
        self._send_outbox(sock)
        wake_at = self._core.next_wake()
        left = _TURN_S if wake_at is None else min(wake_at - time.monotonic(), _TURN_S)
        # Short waits: the socket lock is held meanwhile, and run() on another thread wants it.
        events = dict(poller.poll(int(max(0.0, left) * 1000)))
        if self._wake_r in events:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        self._drain(sock)
        now = time.monotonic()
        self._core.tick(now)
        if self._embedded is not None and now >= self._next_exit_check:
            self._next_exit_check = now + _EXIT_CHECK_S
            self.fail_if_embedded_exited(self._core)

    def _drain(self, sock: zmq.Socket[bytes], ready: bool = False) -> None:
        """Handle every message waiting on the socket (the caller holds the socket lock).

        ``ready``: the caller's poll just said a message is there (saves asking again).
        """
        while ready or self._sock_poller.poll(0):
            ready = False
            self._core.receive(sock.recv_multipart(), time.monotonic())

    def _send_outbox(self, sock: zmq.Socket[bytes]) -> None:
        for frame in self._core.outgoing():
            sock.send(frame)


def _running_future() -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_running_or_notify_cancel()  # a caller's cancel() cannot take it back: the action is sent
    return fut


def _wait(fut: Future[Result], timeout: float | None, action: Action) -> Result:
    """The action's result, or a ``TimeoutError`` that says which one and that it goes on."""
    try:
        return fut.result(timeout)
    except FutureTimeout:
        raise TimeoutError(
            f"no result for {action.kind!r} (id {action.id}) within {timeout:g}s; the action goes on "
            "(client.cancel([id]) stops it)"
        ) from None
