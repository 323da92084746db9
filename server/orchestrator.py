"""The orchestrator's shell: one ROUTER socket, the in-process runners, and the effects of the core.

Every action's life is decided by the pure core (:class:`~.lifecycle.Lifecycle`); this shell decodes
what arrives, hands it to the core with the time, and carries out the effects it returns: it sends,
starts grants on in-process runners, runs inline kinds, writes the state file, and passes slow sandbox
work (ending sessions, resizing warm pools, retiring idle sandboxes) to a small thread pool, so that
no client waits on another's sandbox. It is built at the edge (:func:`tangram_env.server.cli.build`),
which opens the socket, CURVE, metrics and the state file and hands them in.

Single-threaded: every message, result and timer is handled on one loop, so the core needs no locks.
Anything malformed gets an ``Error`` reply and is counted, and the loop carries on serving everyone.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import zmq
from pydantic import BaseModel

from tangram_env import wire
from tangram_env.errors import ProtocolError
from tangram_env.kinds import ActionContext
from tangram_env.protocol import Error, Heartbeat, Resources, Result, Stats
from tangram_env.server.executor import started_pool
from tangram_env.server.lifecycle import (
    INLINE,
    Effect,
    EndSessions,
    KeepWarm,
    Lifecycle,
    Observe,
    Persist,
    Run,
    RunInline,
    Send,
    SendFigures,
    Stop,
)
from tangram_env.server.runner import Runner
from tangram_env.server.state import StateStore, StateWriteError

log = logging.getLogger(__name__)

TICK_S = 0.5
#: The exit status of an orchestrator that stopped because its state file could not be written (EX_IOERR).
EXIT_STATE_WRITE_FAILED = 74
_SNDMORE, _NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)  # plain ints: pyzmq's enum flags cost on each send
#: Peers whose message counts are kept (the most recently heard). One forgotten starts again from zero,
#: which its next heartbeat shows as lost messages: it resubmits what it waits for (ids dedupe).
PEERS_COUNTED = 100_000


class MessageCounts:
    """Messages heard from and sent to each peer, as the socket carried them: what a client's heartbeat
    is answered with, so that it sees messages a broken connection lost (see ``Heartbeat``).
    """

    def __init__(self, limit: int = PEERS_COUNTED) -> None:
        self.limit = limit
        self._counts: collections.OrderedDict[bytes, list[int]] = collections.OrderedDict()

    def of(self, peer: bytes) -> list[int]:
        """``[heard, sent]`` for ``peer`` (a mutable pair)."""
        counts = self._counts.get(peer)
        if counts is None:
            counts = self._counts[peer] = [0, 0]
            if len(self._counts) > self.limit:
                self._counts.popitem(last=False)
        else:
            self._counts.move_to_end(peer)
        return counts


class Orchestrator:
    """Serves clients and workers on ``sock`` until :meth:`stop` (or SIGINT/SIGTERM)."""

    def __init__(
        self,
        core: Lifecycle,
        sock: zmq.Socket[Any],
        address: str,
        *,
        runners: dict[str, Runner],
        max_body: int,
        sandbox_pool: Any = None,
        store: StateStore | None = None,
        exporter: Any = None,
        on_close: Sequence[Callable[[], None]] = (),
        parent_pid: int | None = None,
        setup_threads: int = 4,
    ) -> None:
        self.core = core
        self.address = address
        self.runners = runners
        self.sandbox_pool = sandbox_pool
        self.store = store
        self.exporter = exporter
        self._sock = sock
        self._max_body = max_body
        self._on_close = on_close
        self._parent_pid = parent_pid
        # Sandbox work that can take seconds (provider calls) never runs on the loop.
        self._setup = started_pool(setup_threads, "sandbox-setup")
        self._maintaining: Future[None] | None = None
        self._inline_done: list[Result] = []  # results of inline runs, handed to the core together
        # Attachments (the Ray backend): run on the loop at each tick, their figures reported by name.
        self._attached: list[tuple[str, Callable[[Orchestrator, float], None], Callable[[], Any]]] = []
        self._stop_r, self._stop_w = os.pipe()
        os.set_blocking(self._stop_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._stop_r, zmq.POLLIN)
        self._sock_ready = zmq.Poller()
        self._sock_ready.register(self._sock, zmq.POLLIN)
        self._polled_fds: list[int] = []
        self._counts = MessageCounts()
        self._stopping = False
        self._next_tick = 0.0
        self._effects: dict[type, Callable[[Any], None]] = {
            Send: self._do_send,
            Run: self._do_run,
            Stop: self._do_stop,
            RunInline: self._do_run_inline,
            Persist: self._do_persist,
            Observe: self._do_observe,
            EndSessions: self._do_end_sessions,
            KeepWarm: self._do_keep_warm,
            SendFigures: self._do_send_figures,
        }

    @property
    def metrics(self) -> Any:
        """The core's counters."""
        return self.core.metrics

    # --- lifecycle --------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to finish (safe from signal handlers and other threads)."""
        self._stopping = True
        try:
            os.write(self._stop_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def install_signal_handlers(self) -> None:
        """SIGINT and SIGTERM stop the loop cleanly."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stop())

    def serve_forever(self) -> None:
        """Run the loop until stopped, then close everything."""
        log.info(
            "orchestrator %s serving on %s with scheduler %s",
            self.core.server_id[:8],
            self.address,
            self.core.scheduler.name,
        )
        try:
            while not self._stopping:
                self.run_once(TICK_S)
        except StateWriteError as exc:
            # Fail-stop, without a traceback: the cause is outside the program (a full disk, say).
            log.critical("%s", exc)
            raise SystemExit(EXIT_STATE_WRITE_FAILED) from None
        except Exception:
            # Fail-stop: going on with half-applied scheduler state could lose actions silently.
            log.critical(
                "the orchestrator's loop failed and stops; clients reconnect to a restarted server and "
                "resubmit what is unanswered (--state-db also keeps the queue and the results)",
                exc_info=True,
            )
            raise
        finally:
            self.close()

    def run_once(self, max_wait_s: float) -> None:
        """One loop iteration: wait for input (at most ``max_wait_s``), handle it, schedule, reply."""
        fds = [fd for runner in self.runners.values() for fd in runner.wait_fds()]
        if fds != self._polled_fds:  # re-register only when the running children change
            for fd in self._polled_fds:
                self._poller.unregister(fd)
            for fd in fds:
                self._poller.register(fd, zmq.POLLIN)
            self._polled_fds = fds
        deadline = self._next_runner_deadline()
        wake = min((t for t in (deadline, self.core.wake_at) if t is not None), default=None)
        wait = max_wait_s if wake is None else max(0.0, min(max_wait_s, wake - time.monotonic()))
        ready = dict(self._poller.poll(int(wait * 1000)))
        if self._sock in ready:
            self._drain_socket()
        now = time.monotonic()
        if len(ready) > (self._sock in ready) + (self._stop_r in ready) or (
            deadline is not None and now >= deadline
        ):
            for worker_id, runner in self.runners.items():
                results = runner.collect()
                if results:
                    self._carry_out(self.core.finished(worker_id, results, now))
        if now >= self._next_tick:
            self._next_tick = now + TICK_S
            self._housekeeping(now)
        self.core.wake(now)
        self._carry_out(self.core.flush(now))
        self._commit()  # durable before the next turn (results were committed before being sent)

    def close(self) -> None:
        """Kill running actions, finish sandbox work, close the socket, the pool and the state file."""
        for runner in self.runners.values():
            runner.close()
        self._setup.shutdown(wait=True, cancel_futures=True)
        if self.sandbox_pool is not None:
            try:
                self.sandbox_pool.close()
            except Exception:
                log.exception("closing the sandbox pool failed")
        self._sock.close(linger=0)
        for closer in self._on_close:
            closer()
        if self.store is not None:
            try:
                self.store.close()
            except StateWriteError as exc:  # the last turn's changes: lost with the write, said so
                log.critical("%s", exc)
        os.close(self._stop_r)
        os.close(self._stop_w)
        log.info("orchestrator %s stopped", self.core.server_id[:8])

    def restore(self, stored: list[Any], acked: Sequence[str]) -> None:
        """Resume from what the state file remembered (see :meth:`Lifecycle.restore`)."""
        self._carry_out(self.core.restore(stored, acked, time.monotonic()))
        self._commit()
        if stored:
            log.info("restored %d actions from %s", len(stored), getattr(self.store, "path", "?"))

    def figures(self) -> dict[str, Any]:
        """Everything ``Stats`` reports: the core's books and counters, and each runner's own figures."""
        figures = self.core.figures()
        for worker_id, runner in self.runners.items():
            figures["workers"][worker_id]["figures"] = runner.stats()
        figures["metrics_port"] = self.exporter.port if self.exporter is not None else None
        for name, _, attached_figures in self._attached:
            figures[name] = attached_figures()
        return figures

    # --- what a cluster manager (the Ray backend) uses, on the loop's thread ------------------------
    @property
    def scheduler(self) -> Any:
        """The scheduling policy (read-only use: ``pending()``, ``running()``)."""
        return self.core.scheduler

    def attach(
        self, housekeep: Callable[[Orchestrator, float], None], figures: Callable[[], Any], *, name: str
    ) -> None:
        """Call ``housekeep(self, now)`` on the loop every tick; report ``figures()`` under ``name``."""
        self._attached.append((name, housekeep, figures))

    def queued_demands(self) -> list[Resources]:
        """What each queued action waits for: its demand times its least parallelism."""
        return self.core.queued_demands()

    def remove_worker(self, worker_id: str, why: str) -> bool:
        """Take a remote worker out now, as if it had gone silent (its running actions are requeued);
        False if there is no such remote worker.
        """
        worker = self.core.workers.get(worker_id)
        if worker is None or worker.identity is None:
            return False
        self._carry_out(self.core.remove_worker(worker_id, why, time.monotonic()))
        return True

    # --- input ------------------------------------------------------------------------------------
    def _drain_socket(self, budget: int = 10_000) -> None:
        """Handle the messages waiting on the socket (the caller's poll said there is at least one)."""
        core = self.core
        for i in range(budget):
            if i and not self._sock_ready.poll(0):  # cheaper than reading zmq.EVENTS, no exception
                return
            frames = self._sock.recv_multipart()
            identity = frames[0]  # the ROUTER puts it there: never missing
            self._counts.of(identity)[0] += 1
            try:
                message = wire.decode_frames(frames[1:], self._max_body)
            except ProtocolError as exc:
                core.metrics.protocol_errors[exc.code] += 1
                log.debug("bad message from %s: %s", identity.hex(), exc)
                self._send(identity, Error(code=exc.code, message=exc.message))
                continue
            if not core.accepts(message):
                core.metrics.protocol_errors["unexpected_type"] += 1
                kind = getattr(message, "kind", "?")
                self._send(
                    identity,
                    Error(
                        code="unexpected_type", message=f"the orchestrator does not accept {kind!r} messages"
                    ),
                )
                continue
            try:
                self._carry_out(core.receive(identity, message, time.monotonic()))
            except StateWriteError:
                raise  # the state file could not be written: the orchestrator stops (serve_forever)
            except Exception as exc:  # a bug in one handler must not stop the loop
                log.exception("handling %s from %s failed", type(message).__name__, identity.hex())
                core.metrics.protocol_errors["internal"] += 1
                self._send(identity, Error(code="internal", message=f"{type(exc).__name__}: {exc}"))

    def _next_runner_deadline(self) -> float | None:
        deadlines = [
            d for r in self.runners.values() if (d := getattr(r, "next_deadline", _none)()) is not None
        ]
        return min(deadlines, default=None)

    def _housekeeping(self, now: float) -> None:
        self._carry_out(self.core.tick(now))
        for name, housekeep, _ in self._attached:
            try:
                housekeep(self, now)
            except StateWriteError:
                raise
            except Exception:  # an attachment's failure must not stop the loop
                log.exception("the %s attachment failed", name)
        if self.sandbox_pool is not None and (self._maintaining is None or self._maintaining.done()):
            self._maintaining = self._setup.submit(self.sandbox_pool.maintain)  # retire idle sandboxes
        if self.exporter is not None:
            self.exporter.update(self.figures())
        if self._parent_pid is not None and os.getppid() != self._parent_pid:
            log.warning("parent process %d is gone; stopping", self._parent_pid)
            self.stop()

    # --- effects ----------------------------------------------------------------------------------
    def _carry_out(self, effects: list[Effect]) -> None:
        handlers = self._effects
        inline: list[RunInline] = []
        for effect in effects:
            if type(effect) is RunInline:
                inline.append(effect)  # run after the rest, once all their admissions are durable
            else:
                handlers[type(effect)](effect)
        if inline:
            self._commit()  # one write for the batch; a crash while they run reports them lost, not rerun
            for effect in inline:
                self._do_run_inline(effect)
        if self._inline_done:  # the inline actions these effects ran: their results in one go
            results, self._inline_done = self._inline_done, []
            self._carry_out(self.core.finished(INLINE, results, time.monotonic()))

    def _commit(self) -> None:
        """Make the changes so far durable. A failed write raises :class:`StateWriteError` (and so does
        every later commit): the loop stops, since serving on would have memory and file disagree.
        """
        if self.store is not None:
            self.store.commit()

    def _do_send(self, effect: Send) -> None:
        self._commit()  # nobody hears of a change, nor runs a started action, before it is durable
        self._send(effect.peer, effect.message)

    def _do_run(self, effect: Run) -> None:
        self._commit()
        self.runners[effect.worker_id].start(effect.grant)

    def _do_stop(self, effect: Stop) -> None:
        self.runners[effect.worker_id].cancel(list(effect.action_ids))

    def _do_run_inline(self, effect: RunInline) -> None:
        """Trivial built-ins run on the loop itself: no scheduling, no process."""
        spec, action = effect.spec, effect.action
        t0 = time.monotonic()
        try:
            if spec.takes_ctx:
                value = spec.target(
                    effect.args, ctx=ActionContext(action=action, deadline=t0 + effect.timeout_s)
                )
            else:
                value = spec.target(effect.args)
            ok, error = True, ""  # pydantic values are dumped once, when the result is encoded
        except Exception as exc:
            ok, value, error = False, None, f"{type(exc).__name__}: {exc}"
        result = Result(
            action_id=action.id,
            ok=ok,
            value=value,
            error_type=None if ok else "error",
            message=error,
            timing={"run_s": time.monotonic() - t0},  # validated into Timing; cheaper than building one
            worker=INLINE,
        )
        self._inline_done.append(result)

    def _do_persist(self, effect: Persist) -> None:
        if self.store is not None:
            getattr(self.store, effect.op)(*effect.args)

    def _do_observe(self, effect: Observe) -> None:
        if self.exporter is not None:
            r = effect.result
            self.exporter.observe_result(effect.kind, r.ok, r.error_type, r.timing.act_s, r.timing.queued_s)

    def _do_end_sessions(self, effect: EndSessions) -> None:
        if self.sandbox_pool is not None:
            self.sandbox_pool.end_sessions_soon(list(effect.sessions), self._setup.submit)

    def _do_keep_warm(self, effect: KeepWarm) -> None:
        if self.sandbox_pool is not None:
            self._setup.submit(_logged, self.sandbox_pool.keep, effect.image, effect.size, effect.expire)

    def _do_send_figures(self, effect: SendFigures) -> None:
        self._send(effect.peer, Stats(figures=self.figures()))

    def _send(self, identity: bytes, message: BaseModel) -> None:
        counts = self._counts.of(identity)
        if type(message) is Heartbeat and message.sent is not None:  # the answer to a client's beat
            message = message.model_copy(update={"heard": counts[0], "answered": counts[1]})
        for data in wire.frames(message, self._max_body):  # a client's limit too, by default
            counts[1] += 1  # a message dropped below (a full queue) counts: the client sees it lost
            try:
                self._sock.send(identity, _SNDMORE)
                self._sock.send(data, _NOBLOCK)
            except zmq.Again:
                log.warning("dropping a %s to %s: its queue is full", type(message).__name__, identity.hex())
            except zmq.ZMQError as exc:
                log.debug("cannot send to %s: %s", identity.hex(), exc)


def _none() -> None:
    return None


def _logged(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn`` on a set-up thread; a failure is logged (nobody waits for it)."""
    try:
        fn(*args)
    except Exception:
        log.exception("sandbox work %s%r failed", getattr(fn, "__name__", fn), args)
