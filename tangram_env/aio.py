"""``AsyncClient``: the asyncio face of :class:`~tangram_env.client.Client`, native to the event loop.

One event loop drives thousands of trajectories without a thread each, and an action costs no thread
hand-off: the client's DEALER socket is read by a reader on the caller's event loop (``add_reader`` on
the socket's file descriptor), and results resolve asyncio futures where they are read. The rules
(retries, backpressure, acknowledgements, heartbeats, resubmission after a restart) and the wire format
are not duplicated: they are :class:`~tangram_env.client_core.ClientCore`'s, which the sync client uses
too. Two things are the event loop's own:

- actions submitted during one turn of the loop leave together, as one ``submit`` (thousands of
  coroutines each asking for one action cost a handful of messages, not thousands);
- the socket follows the event loop that uses it: one running loop at a time (a second loop running on
  another thread gets a clear error; make one ``AsyncClient`` per loop), and a later loop (another
  ``asyncio.run``) takes it over once the earlier one has stopped, so sessions keep their owner.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import zmq

from tangram_env.client import Client, score_items
from tangram_env.client_core import ClientCore, connect_dealer, submissions
from tangram_env.errors import ClosedEnvError, LoopInUseError, no_answer
from tangram_env.protocol import (
    Action,
    Cancel,
    CloseSessions,
    Heartbeat,
    ListKinds,
    Result,
    Stats,
    id_batches,
)

if TYPE_CHECKING:
    from pydantic import BaseModel

    from tangram_env.session import AsyncSandboxSession

_SEND_RETRY_S = 0.005  # the socket's send queue was full: try again this much later


class AsyncClient:
    """An orchestrator connection for asyncio code; every method that waits is a coroutine.

    ``AsyncClient(address)`` opens its own connection (``address=None``: ``TANGRAM_ADDRESS``, else an
    embedded orchestrator); ``AsyncClient(client=c)`` (or :meth:`wrap`) talks to ``c``'s orchestrator
    with ``c``'s settings, so sync and async code can share one, and keeps ``c`` as :attr:`sync`. Each
    ``AsyncClient`` has its own socket, driven by one running event loop at a time.
    """

    def __init__(self, address: str | None = None, *, client: Client | None = None, **overrides: Any):
        self.sync: Client = client if client is not None else Client(address, **overrides)
        self._owns_sync = client is None
        self.address = self.sync.address
        self.settings = self.sync.settings
        # Its sync client's, then its own part: the orchestrator lets both use the same sessions.
        self.identity = self.sync.identity + b"/" + uuid.uuid4().hex[:12].encode()
        now = time.monotonic()
        self._core: ClientCore[asyncio.Future[Any]] = ClientCore(
            self.settings, self.address, now, server_id=self.sync.server_id
        )
        self._sock: zmq.Socket[bytes] | None = None
        self._fd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop whose reader reads the socket
        self._batch: list[Action] = []  # submitted during this turn of the loop, not sent yet
        self._unsent: collections.deque[bytes] = collections.deque()  # the socket's queue was full
        # The socket is the loop's; another thread sends on it only while no loop runs (see _post),
        # and a loop that starts meanwhile must wait for that send: a ZeroMQ socket is not thread-safe.
        self._sock_lock = threading.RLock()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._closed = False
        self.sync._on_close.append(self.close)  # the connection it borrows from ends: so does this one

    @classmethod
    def wrap(cls, client: Client) -> AsyncClient:
        """The async twin of ``client`` for the calling thread (made on first use; closed with ``client``).

        One per thread, so that event loops on several threads each drive their own socket.
        """
        twins = _TWINS.setdefault(client, {})
        twin = twins.get(threading.get_ident())
        if twin is None or twin._closed:
            twin = twins[threading.get_ident()] = cls(client=client)
        return twin

    # --- actions ----------------------------------------------------------------------------------
    def submit(self, actions: Sequence[Action]) -> list[asyncio.Future[Result]]:
        """Queue ``actions`` (they leave at the end of this turn of the loop); one future per action.

        An id already outstanding shares its future (an action never runs twice).
        """
        self._check_open()
        self.sync._check_reachable()
        loop = self._attach()
        futures, new = self._core.register(actions, loop.create_future, time.monotonic())
        if new:
            # Its sync client heartbeats for them too: a trainer's loop may end between batches.
            self.sync.keep_alive(a.affinity for a in new if a.affinity)
            if not self._batch:
                loop.call_soon(self._flush)
            self._batch.extend(new)
        return futures

    async def gather(self, actions: Sequence[Action]) -> list[Result]:
        """Run ``actions`` together and return their results in order (failures are ``ok=False`` data).

        If the awaiting task is cancelled, the actions not done are cancelled too (running ones stopped).
        """
        futures = self.submit(actions)
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            left = [a.id for a, f in zip(actions, futures, strict=True) if f.cancelled() or not f.done()]
            if left and not self._closed:
                self.cancel(left)
            raise

    async def run(self, kind: str, payload: dict[str, Any] | None = None, **fields: Any) -> Result:
        """Run one action and return its :class:`Result` (``ok`` tells whether it succeeded)."""
        (result,) = await self.gather([Action(kind=kind, payload=payload or {}, **fields)])
        return result

    async def call(self, kind: str, payload: dict[str, Any] | None = None, **fields: Any) -> Any:
        """Run one action and return its value, raising its typed error if it failed."""
        return (await self.run(kind, payload, **fields)).unwrap()

    async def score(self, model: str, items: Sequence[Any], **fields: Any) -> list[float]:
        """Scores of ``items`` from the reward model ``model``, in order."""
        return list(await self.call(model, {"items": score_items(model, items)}, **fields))

    def sandbox(self, image: str = "default", **options: Any) -> AsyncSandboxSession:
        """A sandbox session: ``async with client.sandbox(image=...) as box: await box.bash("ls")``.

        See :class:`~tangram_env.session.AsyncSandboxSession` for the options.
        """
        from tangram_env.session import AsyncSandboxSession

        return AsyncSandboxSession(self, image=image, **options)

    def cancel(self, action_ids: Sequence[str]) -> None:
        """Cancel actions, from any thread: as :meth:`Client.cancel` (running ones are stopped)."""
        if action_ids:
            for ids in id_batches(list(action_ids)):
                self._post(Cancel(action_ids=ids))

    def close_sessions(self, session_ids: Sequence[str]) -> None:
        """End sandbox sessions: their sandboxes are reset and go back to the warm pool (from any thread)."""
        if session_ids and not self._closed:
            for ids in id_batches(list(session_ids)):
                self._post(CloseSessions(session_ids=ids))
            self.sync.keep_alive(session_ids, alive=False)

    # --- requests ---------------------------------------------------------------------------------
    async def kinds(self, timeout_s: float = 10.0) -> dict[str, dict[str, Any]]:
        """The tools and reward models the orchestrator serves."""
        reply = await self._request(ListKinds(), "list_kinds", timeout_s)
        assert isinstance(reply, ListKinds)
        return reply.kinds

    async def stats(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The orchestrator's figures."""
        reply = await self._request(Stats(), "stats", timeout_s)
        assert isinstance(reply, Stats)
        return reply.figures

    async def ping(self, timeout_s: float = 5.0) -> str:
        """Round trip a heartbeat; the orchestrator's id, or :class:`ServerUnavailable`."""
        try:
            reply = await self._request(Heartbeat(), "heartbeat", timeout_s)
        except TimeoutError:
            raise no_answer(self.address, timeout_s, bool(self.settings.curve_server_key)) from None
        assert isinstance(reply, Heartbeat)
        return reply.server_id

    @property
    def outstanding(self) -> int:
        """Actions submitted and not yet answered (those still waiting for this turn included)."""
        return len(self._core.pending)

    # --- life -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Close this client's socket (from any thread) and the sync client too if this one opened it.

        What is still outstanding fails with :class:`ClosedEnvError`.
        """
        if self._closed:
            return
        self._closed = True
        if self.sync.forked:  # its socket and loop are the parent's: nothing here to close
            self.sync.close()
            return
        self._core.end_sessions()  # sent by _shut, as the socket closes
        loop = self._loop
        if loop is not None and _driven_elsewhere(loop):
            loop.call_soon_threadsafe(self._shut)
        else:
            self._shut()
        if self._owns_sync:
            self.sync.close()
        elif self.close in self.sync._on_close:  # the sync client lives on: it need not remember this one
            self.sync._on_close.remove(self.close)

    async def aclose(self) -> None:
        """:meth:`close`, from the event loop."""
        self.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- the socket on the event loop --------------------------------------------------------------
    def _check_open(self) -> None:
        if self.sync.forked:
            self.sync._check_open()  # says where it was made, and what to do instead
        if self._closed:
            raise ClosedEnvError("this client is closed")

    def _attach(self) -> asyncio.AbstractEventLoop:
        """The running loop, now the one that reads the socket (opened on first use)."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return loop
        old = self._loop
        if old is not None:
            if _driven_elsewhere(old):
                raise LoopInUseError(
                    "this AsyncClient is in use by an event loop running on another thread; "
                    "make one AsyncClient per event loop (AsyncClient(client=...) shares a sync client's "
                    "orchestrator), or use AsyncClient.wrap(client) on each thread"
                )
            if not old.is_closed() and self._fd is not None:
                old.remove_reader(self._fd)
            self._disarm()
            self._batch = []  # its flush was scheduled on the old loop; those actions are abandoned below
            if self._core.pending:  # futures of a loop that no longer runs: nobody can await them
                self._core.outbox.extend(
                    Cancel(action_ids=ids) for ids in id_batches(list(self._core.pending))
                )
                self._abandon(old, "the event loop that awaited this action stopped")
        if self._sock is None:
            self._sock = connect_dealer(zmq.Context.instance(), self.address, self.identity, self.settings)
        self._fd = int(self._sock.getsockopt(zmq.FD))
        loop.add_reader(self._fd, self._pump)
        self._loop = loop
        return loop

    def _flush(self) -> None:
        """Send the actions queued during this turn of the loop as one submission."""
        batch, self._batch = self._batch, []
        if self._closed:
            return
        live = [a for a in batch if a.id in self._core.pending]
        self._core.outbox.extend(submissions(live))
        self._pump()

    def _post(self, message: BaseModel) -> None:
        """Send ``message`` from whichever thread: on the loop's turn if another thread runs it."""
        loop = self._loop
        if self._closed or loop is None:  # nothing was ever sent, so nothing to cancel or close
            return
        self._core.outbox.append(message)
        if _driven_elsewhere(loop):
            loop.call_soon_threadsafe(self._pump)
        elif loop.is_running():
            self._pump()
        else:  # no loop reads the socket now: send it from here, and read when the loop runs again
            self._send_all()
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._pump)

    def _pump(self) -> None:
        """Send what is queued, read what arrived, and set the timer (the loop's reader and timer)."""
        with self._sock_lock:
            self._pump_locked()

    def _pump_locked(self) -> None:
        if self._closed or self._sock is None:
            return
        sock, core = self._sock, self._core
        while True:
            self._send_all()
            # The descriptor is edge-triggered: read until the socket says nothing is left, and look
            # again after sending (a send can take in messages without signalling the descriptor).
            received = False
            while int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                core.receive(sock.recv_multipart(zmq.NOBLOCK), time.monotonic())
                received = True
            if not received and not core.outbox:
                break
        self._arm()

    def _send_all(self) -> None:
        with self._sock_lock:
            self._send_all_locked()

    def _send_all_locked(self) -> None:
        sock = self._sock
        if sock is None:
            return
        self._unsent.extend(self._core.outgoing())
        while self._unsent:
            try:
                sock.send(self._unsent[0], zmq.NOBLOCK)
            except zmq.Again:  # the queue to the orchestrator is full: the timer tries again
                return
            self._unsent.popleft()

    def _arm(self) -> None:
        """Wake for the core's timers (acknowledgements, heartbeats, resubmissions) or a full queue."""
        core = self._core
        now = time.monotonic()
        when = core.next_wake()
        if self._unsent:
            when = min(when or float("inf"), now + _SEND_RETRY_S)
        if when is None:
            if core.quiet:
                core.idle(now)
            self._disarm()
            return
        if self._timer is not None and self._timer_at <= when:
            return
        self._disarm()
        assert self._loop is not None
        self._timer = self._loop.call_later(max(0.0, when - now), self._on_timer)
        self._timer_at = when

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, float("inf")

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        if not self._closed:
            self._core.tick(time.monotonic())
            self.sync.fail_if_embedded_exited(self._core)
            self._pump()

    async def _request(self, message: BaseModel, reply_kind: str, timeout_s: float) -> BaseModel:
        self._check_open()
        loop = self._attach()
        fut: asyncio.Future[Any] = loop.create_future()
        self._core.expect(reply_kind, fut)
        self._core.outbox.append(message)
        self._pump()
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            self._core.forget_request(reply_kind, fut)
            raise

    def _shut(self) -> None:
        """Stop reading, close the socket, fail what waits (on the loop's thread, or with no loop)."""
        loop, sock = self._loop, self._sock
        self._disarm()
        if loop is not None and not loop.is_closed() and self._fd is not None:
            loop.remove_reader(self._fd)
        with self._sock_lock:
            if sock is not None:
                self._send_all()  # a last CloseSessions or Cancel still leaves
                sock.close(linger=1000)  # the context's IO thread flushes it; close itself does not wait
            self._sock = None
        self._abandon(loop, "the client was closed")

    def _abandon(self, loop: asyncio.AbstractEventLoop | None, why: str) -> None:
        """Fail what is outstanding; on a closed loop just forget it (its futures cannot call back)."""
        if loop is not None and loop.is_closed():
            with self._core.lock:
                self._core.pending.clear()
                self._core.requests.clear()
        else:
            self._core.fail_all(ClosedEnvError(why))


def _driven_elsewhere(loop: asyncio.AbstractEventLoop) -> bool:
    """``loop`` is running, on a thread other than this one."""
    if not loop.is_running():
        return False
    try:
        return asyncio.get_running_loop() is not loop
    except RuntimeError:
        return True


_TWINS: weakref.WeakKeyDictionary[Client, dict[int, AsyncClient]] = weakref.WeakKeyDictionary()
