"""``AsyncClient``: the asyncio face of :class:`~tangram_env.client.Client`.

One event loop drives thousands of trajectories without a thread each. The wire is not duplicated: an
``AsyncClient`` rides on a sync client's IO thread (retries, backpressure, heartbeats and resubmission
after a restart stay in one place) and adds two things an event loop needs:

- actions submitted during one turn of the loop leave together, as one ``submit`` (thousands of
  coroutines each asking for one action cost a handful of messages, not thousands);
- results come back to the loop in batches: the IO thread queues finished futures and wakes the loop
  once per batch, not once per result.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from tangram_env.client import Client
from tangram_env.protocol import Action, Result

if TYPE_CHECKING:
    from tangram_env.session import AsyncSandboxSession


class _LoopBridge:
    """One event loop's side of an :class:`AsyncClient`: the actions it queued during this turn, and
    the finished concurrent futures it is to resolve, delivered once per batch.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.batch: list[tuple[Action, asyncio.Future[Result]]] = []
        self._done: collections.deque[tuple[Future[Result], asyncio.Future[Result]]] = collections.deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def link(self, cfut: Future[Result], afut: asyncio.Future[Result]) -> None:
        """Resolve ``afut`` (on the loop) when ``cfut`` resolves (on any thread)."""
        cfut.add_done_callback(lambda f: self._finished(f, afut))

    def _finished(self, cfut: Future[Result], afut: asyncio.Future[Result]) -> None:
        self._done.append((cfut, afut))
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _deliver(self) -> None:
        with self._lock:
            self._scheduled = False
        done = self._done
        while done:
            cfut, afut = done.popleft()
            if afut.done():  # cancelled by its awaiter
                continue
            exc = cfut.exception()
            if exc is not None:
                afut.set_exception(exc)
            else:
                afut.set_result(cfut.result())


class AsyncClient:
    """An orchestrator connection for asyncio code; every method that waits is a coroutine.

    ``AsyncClient(address)`` opens its own connection (``address=None``: ``TANGRAM_ADDRESS``, else an
    embedded orchestrator); ``AsyncClient(client=c)`` (or :meth:`wrap`) shares a sync client's, so
    sync and async code can use one connection. Use it from one event loop at a time.
    """

    def __init__(self, address: str | None = None, *, client: Client | None = None, **overrides: Any):
        self.sync: Client = client if client is not None else Client(address, **overrides)
        self._owns_sync = client is None
        self._bridges: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopBridge] = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def wrap(cls, client: Client) -> AsyncClient:
        """The async twin of ``client`` (one per client, made on first use; closing it leaves ``client``)."""
        twin = _TWINS.get(client)
        if twin is None:
            twin = _TWINS[client] = cls(client=client)
        return twin

    # --- actions ----------------------------------------------------------------------------------
    def submit(self, actions: Sequence[Action]) -> list[asyncio.Future[Result]]:
        """Queue ``actions`` (they leave at the end of this turn of the loop); one future per action."""
        self.sync._check_open()
        loop = asyncio.get_running_loop()
        bridge = self._bridge(loop)
        futures = [loop.create_future() for _ in actions]
        if not bridge.batch:
            loop.call_soon(self._flush, bridge)
        bridge.batch.extend(zip(actions, futures, strict=True))
        return futures

    async def gather(self, actions: Sequence[Action]) -> list[Result]:
        """Run ``actions`` together and return their results in order (failures are ``ok=False`` data).

        If the awaiting task is cancelled, the actions that have not started are cancelled too.
        """
        futures = self.submit(actions)
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            left = [a.id for a, f in zip(actions, futures, strict=True) if f.cancelled() or not f.done()]
            if left and not self.sync._closed:
                self.sync.cancel(left)
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
        return list(await self.call(model, {"items": list(items)}, **fields))

    def sandbox(self, image: str = "default", **options: Any) -> AsyncSandboxSession:
        """A sandbox session: ``async with client.sandbox(image=...) as box: await box.bash("ls")``.

        See :class:`~tangram_env.session.AsyncSandboxSession` for the options.
        """
        from tangram_env.session import AsyncSandboxSession

        return AsyncSandboxSession(self, image=image, **options)

    def cancel(self, action_ids: Sequence[str]) -> None:
        """Cancel actions that have not started."""
        self.sync.cancel(action_ids)

    def close_sessions(self, session_ids: Sequence[str]) -> None:
        """End sandbox sessions: their sandboxes are reset and go back to the warm pool."""
        self.sync.close_sessions(session_ids)

    # --- requests that wait on the orchestrator (run off the loop) --------------------------------
    async def kinds(self, timeout_s: float = 10.0) -> dict[str, dict[str, Any]]:
        """The tools and reward models the orchestrator serves."""
        return await asyncio.to_thread(self.sync.kinds, timeout_s)

    async def stats(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The orchestrator's figures."""
        return await asyncio.to_thread(self.sync.stats, timeout_s)

    async def ping(self, timeout_s: float = 5.0) -> str:
        """Round trip a heartbeat; the orchestrator's id, or :class:`ServerUnavailable`."""
        return await asyncio.to_thread(self.sync.ping, timeout_s)

    @property
    def outstanding(self) -> int:
        """Actions submitted and not yet answered (those still waiting for this turn included)."""
        return self.sync.outstanding + sum(len(b.batch) for b in list(self._bridges.values()))

    # --- life -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the connection if this client opened it (a wrapped sync client stays open)."""
        if self._owns_sync:
            self.sync.close()

    async def aclose(self) -> None:
        """:meth:`close`, off the loop (closing joins the IO thread)."""
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- internals --------------------------------------------------------------------------------
    def _bridge(self, loop: asyncio.AbstractEventLoop) -> _LoopBridge:
        bridge = self._bridges.get(loop)
        if bridge is None:
            bridge = self._bridges[loop] = _LoopBridge(loop)
        return bridge

    def _flush(self, bridge: _LoopBridge) -> None:
        """Send the actions queued during this turn of the loop as one submission."""
        batch, bridge.batch = bridge.batch, []
        live = [(a, f) for a, f in batch if not f.cancelled()]
        if not live:
            return
        try:
            cfuts = self.sync.submit([a for a, _ in live])
        except Exception as exc:  # closed client: every waiter hears why
            for _, afut in live:
                if not afut.done():
                    afut.set_exception(exc)
            return
        for (_, afut), cfut in zip(live, cfuts, strict=True):
            bridge.link(cfut, afut)


_TWINS: weakref.WeakKeyDictionary[Client, AsyncClient] = weakref.WeakKeyDictionary()
