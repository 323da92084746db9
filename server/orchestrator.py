"""The orchestrator: one ROUTER socket for clients and workers, a scheduler, and the local executor.

Single-threaded: every message, result and timer is handled on one loop, so the state below needs no
locks. Each message type has one handler in ``_handlers``; anything malformed gets an ``Error`` reply and
is counted, and the loop carries on serving everyone else.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import zmq
from pydantic import BaseModel, ValidationError

from tangram_env import wire
from tangram_env.errors import ProtocolError, UnknownNameError, describe_validation_error
from tangram_env.kinds import ActionContext, KindRegistry, KindSpec, kind_registry
from tangram_env.protocol import (
    Ack,
    Action,
    Cancel,
    CloseSessions,
    Dispatch,
    Error,
    Grant,
    Heartbeat,
    ListKinds,
    Register,
    Result,
    Results,
    Stats,
    Submit,
    Timing,
)
from tangram_env.server.config import ServerSettings
from tangram_env.server.executor import LocalRunner, run_kind, to_wire_value
from tangram_env.server.metrics import Metrics
from tangram_env.server.runner import Runner
from tangram_env.server.scheduler import DEFAULT_SCHEDULER, make_scheduler
from tangram_env.server.scheduler.events import (
    ActionArrived,
    ActionCancelled,
    ActionFinished,
    Decision,
    Event,
    Reject,
    Requeue,
    Resources,
    ScalePool,
    Scheduler,
    Start,
    Tick,
    WorkerAdded,
    WorkerRemoved,
)

log = logging.getLogger(__name__)

_TICK_S = 0.5
_ACKED_IDS_KEPT = 1_000_000  # about 100 MB at worst; older ids may run again if resubmitted


@dataclass
class _Entry:
    """One action the orchestrator knows of, from arrival until its result is acknowledged."""

    action: Action
    spec: KindSpec
    owner: bytes
    submitted: float
    timeout_s: float
    state: str = "queued"  # queued -> running -> done (or queued -> done when rejected or cancelled)
    worker: str | None = None
    result: Result | None = None
    done_at: float = 0.0


@dataclass
class _Worker:
    """A place actions run: the in-process local runner, or a remote worker known by its identity."""

    worker_id: str
    capacity: Resources
    kinds: frozenset[str] | None
    identity: bytes | None = None  # None: in-process runner
    runner: Runner | None = None
    last_seen: float = field(default_factory=time.monotonic)
    running: set[str] = field(default_factory=set)
    figures: dict[str, Any] = field(default_factory=dict)


def check_bind_allowed(bind: str, allow_remote: bool) -> None:
    """Refuse a non-loopback TCP bind unless remote access was enabled explicitly."""
    if not bind.startswith("tcp://"):
        return
    host = urlsplit(bind).hostname or ""
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not allow_remote:
        raise PermissionError(
            f"refusing to bind {bind}: only loopback addresses are allowed without authentication "
            "(pass --allow-remote to accept remote clients)"
        )


class Orchestrator:
    """Serves clients and workers on ``settings.bind`` until :meth:`stop` (or SIGINT/SIGTERM)."""

    def __init__(
        self,
        settings: ServerSettings,
        *,
        registry: KindRegistry = kind_registry,
        scheduler: Scheduler | None = None,
        sandbox_pool: Any = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        check_bind_allowed(settings.bind, settings.allow_remote)
        self.settings = settings
        self.registry = registry
        self.server_id = uuid.uuid4().hex
        self.scheduler = scheduler or make_scheduler(settings.scheduler or DEFAULT_SCHEDULER)
        self.metrics = Metrics()
        self.sandbox_pool = sandbox_pool
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its identity
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 4 * settings.max_body)  # beyond this: drop the peer
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        self.address = self._bind(settings.bind)
        self._entries: dict[str, _Entry] = {}
        # Ids whose results were acknowledged: remembered (bounded) so they never run again.
        self._acked: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._workers: dict[str, _Worker] = {}
        self._events: list[Event] = []
        self._outgoing: dict[bytes, list[Result]] = collections.defaultdict(list)
        self._stop_r, self._stop_w = os.pipe()
        os.set_blocking(self._stop_w, False)
        self._stopping = False
        self._handlers: dict[type[BaseModel], Callable[[bytes, Any], None]] = {
            Submit: self._on_submit,
            Ack: self._on_ack,
            Cancel: self._on_cancel,
            CloseSessions: self._on_close_sessions,
            Heartbeat: self._on_heartbeat,
            Register: self._on_register,
            Results: self._on_worker_results,
            Stats: self._on_stats,
            ListKinds: self._on_list_kinds,
            Error: self._on_peer_error,
        }
        self.local = LocalRunner(settings.cpus, settings.mem_mb, registry=registry, sandbox_pool=sandbox_pool)
        self._add_worker(_Worker("local", self.local.capacity(), self.local.kinds(), runner=self.local))

    def _bind(self, address: str) -> str:
        if address.endswith(":0") and address.startswith("tcp://"):
            port = self._sock.bind_to_random_port(address.rsplit(":", 1)[0])
            return f"{address.rsplit(':', 1)[0]}:{port}"
        self._sock.bind(address)
        return address

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
        log.info("orchestrator %s serving on %s with scheduler %s", self.server_id[:8], self.address,
                 self.scheduler.name)
        try:
            while not self._stopping:
                self.run_once(_TICK_S)
        finally:
            self.close()

    def run_once(self, max_wait_s: float) -> None:
        """One loop iteration: wait for input (at most ``max_wait_s``), handle it, schedule, reply."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        for fd in self.local.wait_fds():
            poller.register(fd, zmq.POLLIN)
        deadline = self.local.next_deadline()
        wait = max_wait_s if deadline is None else max(0.0, min(max_wait_s, deadline - time.monotonic()))
        ready = dict(poller.poll(wait * 1000))
        if self._sock in ready:
            self._drain_socket()
        self._collect_local()
        now = time.monotonic()
        if now >= getattr(self, "_next_tick", 0.0):
            self._next_tick = now + _TICK_S
            self._housekeeping(now)
        self._schedule(now)
        self._flush()

    def close(self) -> None:
        """Kill running actions, close the socket and the sandbox pool."""
        self.local.close()
        if self.sandbox_pool is not None:
            try:
                self.sandbox_pool.close()
            except Exception:
                log.exception("closing the sandbox pool failed")
        self._sock.close(linger=0)
        os.close(self._stop_r)
        os.close(self._stop_w)
        log.info("orchestrator %s stopped", self.server_id[:8])

    # --- input ------------------------------------------------------------------------------------
    def _drain_socket(self, budget: int = 10_000) -> None:
        for _ in range(budget):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            identity, body = frames[0], frames[1:]
            try:
                message = wire.decode(body, self.settings.max_body)
            except ProtocolError as exc:
                self.metrics.protocol_errors[exc.code] += 1
                log.debug("bad message from %s: %s", identity.hex(), exc)
                self._send(identity, Error(code=exc.code, message=exc.message))
                continue
            handler = self._handlers.get(type(message))
            if handler is None:
                self.metrics.protocol_errors["unexpected_type"] += 1
                self._send(identity, Error(code="unexpected_type",
                                           message=f"the orchestrator does not accept {message.kind!r} messages"))  # type: ignore[attr-defined]
                continue
            try:
                handler(identity, message)
            except Exception as exc:  # a bug in one handler must not stop the loop
                log.exception("handling %s from %s failed", type(message).__name__, identity.hex())
                self.metrics.protocol_errors["internal"] += 1
                self._send(identity, Error(code="internal", message=f"{type(exc).__name__}: {exc}"))

    def _on_submit(self, identity: bytes, msg: Submit) -> None:
        now = time.monotonic()
        for action in msg.actions:
            entry = self._entries.get(action.id)
            if entry is not None:  # a resubmitted id never runs twice
                if entry.owner != identity:
                    self._send(identity, Error(code="conflict", action_ids=[action.id],
                                               message="this action id belongs to another client"))
                elif entry.result is not None:
                    self._outgoing[identity].append(entry.result)
                continue
            if action.id in self._acked:
                self._reject(identity, action.id, "duplicate",
                             "this action id already ran and its result was acknowledged; ids run at most once")
                continue
            self.metrics.submitted += 1
            try:
                spec = self.registry.get(action.kind)
                args = spec.validate_payload(action.payload)
            except UnknownNameError as exc:
                self._reject(identity, action.id, "unknown_kind", str(exc))
                continue
            except ValidationError as exc:
                self._reject(identity, action.id, "bad_payload",
                             f"arguments of {action.kind!r} are invalid: {describe_validation_error(exc)}")
                continue
            timeout_s = action.timeout_s or spec.timeout_s
            entry = _Entry(action=action, spec=spec, owner=identity, submitted=now, timeout_s=timeout_s)
            self._entries[action.id] = entry
            if spec.placement == "inline":
                self._run_inline(entry, args)
                continue
            self._events.append(self._arrival(entry))

    @staticmethod
    def _arrival(entry: _Entry) -> ActionArrived:
        """The scheduler's view of a queued action: its resolved demand and elasticity."""
        action, spec = entry.action, entry.spec
        demand = action.demand or spec.demand
        elastic = action.elastic or spec.elastic
        return ActionArrived(
            action_id=action.id, kind=action.kind,
            demand=Resources(demand.cpu, demand.mem_mb, demand.gpu, demand.gpu_mem_mb),
            min_par=elastic.min_par, max_par=elastic.max_par, trajectory_id=action.trajectory_id,
            env_id=action.env_id, affinity=action.affinity, image=action.image or spec.image,
            priority=action.priority,
        )

    def _reject(self, identity: bytes, action_id: str, code: str, message: str) -> None:
        self.metrics.errors["rejected"] += 1
        self._send(identity, Error(code=code, message=message, action_ids=[action_id]))

    def _run_inline(self, entry: _Entry, args: Any) -> None:
        """Trivial built-ins run on the loop itself: no scheduling, no process."""
        t0 = time.monotonic()
        ctx = ActionContext(action=entry.action, deadline=t0 + entry.timeout_s)
        try:
            value = to_wire_value(entry.spec.target(args, ctx=ctx) if entry.spec.takes_ctx else entry.spec.target(args))
            result = Result(action_id=entry.action.id, ok=True, value=value)
        except Exception as exc:
            result = Result.failure(entry.action.id, "error", f"{type(exc).__name__}: {exc}")
        result.timing = Timing(run_s=time.monotonic() - t0)
        result.worker = "orchestrator"
        self._complete(entry, result, notify_scheduler=False)

    def _on_ack(self, identity: bytes, msg: Ack) -> None:
        for action_id in msg.action_ids:
            entry = self._entries.get(action_id)
            if entry is not None and entry.owner == identity and entry.state == "done":
                del self._entries[action_id]
                self._acked[action_id] = identity
                if len(self._acked) > _ACKED_IDS_KEPT:
                    self._acked.popitem(last=False)

    def _on_cancel(self, identity: bytes, msg: Cancel) -> None:
        for action_id in msg.action_ids:
            entry = self._entries.get(action_id)
            if entry is None or entry.owner != identity or entry.state != "queued":
                continue  # not yours, unknown, or already started: deferred, never preempted
            self._events.append(ActionCancelled(action_id))
            self._complete(entry, Result.failure(action_id, "cancelled", "cancelled before it started"),
                           notify_scheduler=False)

    def _on_close_sessions(self, identity: bytes, msg: CloseSessions) -> None:
        if self.sandbox_pool is None:
            return
        for session in msg.session_ids:
            try:
                self.sandbox_pool.end_session(session)
            except Exception:
                log.exception("ending sandbox session %s failed", session)

    def _on_heartbeat(self, identity: bytes, msg: Heartbeat) -> None:
        worker = self._worker_by_identity(identity)
        if worker is not None:
            worker.last_seen = time.monotonic()
        self._send(identity, Heartbeat(server_id=self.server_id))

    def _on_register(self, identity: bytes, msg: Register) -> None:
        old = self._workers.get(msg.worker_id)
        if old is not None:
            self._remove_worker(old, "re-registered")
        kinds = frozenset(msg.kinds) if msg.kinds else None
        self._add_worker(_Worker(msg.worker_id, Resources(msg.cpu, msg.mem_mb, msg.gpu, msg.gpu_mem_mb), kinds,
                                 identity=identity))
        log.info("worker %s joined: %s cpu, %s MiB, %s gpu, kinds %s", msg.worker_id, msg.cpu, msg.mem_mb,
                 msg.gpu, sorted(kinds) if kinds else "all")
        self._send(identity, Heartbeat(server_id=self.server_id))

    def _on_worker_results(self, identity: bytes, msg: Results) -> None:
        worker = self._worker_by_identity(identity)
        if worker is None:
            self._send(identity, Error(code="not_registered", message="register before sending results"))
            return
        worker.last_seen = time.monotonic()
        for result in msg.results:
            entry = self._entries.get(result.action_id)
            if entry is None or entry.state != "running" or entry.worker != worker.worker_id:
                continue  # a late answer for an action that was requeued elsewhere
            worker.running.discard(result.action_id)
            self._complete(entry, result)

    def _on_stats(self, identity: bytes, msg: Stats) -> None:
        figures = self.metrics.snapshot()
        figures.update(
            server_id=self.server_id,
            scheduler=self.scheduler.name,
            pending=self.scheduler.pending(),
            running=self.scheduler.running(),
            entries=len(self._entries),
            workers={
                w.worker_id: {"capacity": vars(w.capacity), "running": len(w.running),
                              "kinds": sorted(w.kinds) if w.kinds else None,
                              "figures": w.runner.stats() if w.runner else w.figures}
                for w in self._workers.values()
            },
        )
        self._send(identity, Stats(figures=figures))

    def _on_list_kinds(self, identity: bytes, msg: ListKinds) -> None:
        self._send(identity, ListKinds(kinds={s.name: s.describe() for s in self.registry}))

    def _on_peer_error(self, identity: bytes, msg: Error) -> None:
        log.warning("peer %s reported an error: %s: %s", identity.hex(), msg.code, msg.message)

    # --- workers ----------------------------------------------------------------------------------
    def _worker_by_identity(self, identity: bytes) -> _Worker | None:
        for worker in self._workers.values():
            if worker.identity == identity:
                return worker
        return None

    def _add_worker(self, worker: _Worker) -> None:
        self._workers[worker.worker_id] = worker
        self._events.append(WorkerAdded(worker.worker_id, worker.capacity, worker.kinds))

    def _remove_worker(self, worker: _Worker, why: str) -> None:
        log.warning("worker %s left (%s); %d running actions go back to the queue", worker.worker_id, why,
                    len(worker.running))
        del self._workers[worker.worker_id]
        for action_id in worker.running:
            entry = self._entries.get(action_id)
            if entry is not None and entry.state == "running":
                entry.state, entry.worker = "queued", None
        self._events.append(WorkerRemoved(worker.worker_id))

    # --- scheduling and results -------------------------------------------------------------------
    def _schedule(self, now: float) -> None:
        if not self._events:
            return
        events, self._events = self._events, []
        for decision in self.scheduler.handle(events, now):
            self._apply(decision, now)

    def _apply(self, decision: Decision, now: float) -> None:
        if isinstance(decision, Start):
            entry = self._entries.get(decision.action_id)
            worker = self._workers.get(decision.worker_id)
            if entry is None or entry.state != "queued":
                # Already done (cancelled while the decision was made): free its grant at once.
                self._events.append(ActionFinished(decision.action_id, 0.0, ok=False))
                return
            if worker is None:  # it left between the events and this decision: queue the action again
                self._events.append(ActionFinished(decision.action_id, 0.0, ok=False))
                self._events.append(self._arrival(entry))
                return
            entry.state, entry.worker = "running", worker.worker_id
            worker.running.add(decision.action_id)
            grant = Grant(action=entry.action, parallelism=decision.parallelism, timeout_s=entry.timeout_s,
                          queued_s=now - entry.submitted)
            if worker.runner is not None:
                worker.runner.start(grant)
            else:
                assert worker.identity is not None
                self._send(worker.identity, Dispatch(grants=[grant]))
        elif isinstance(decision, Reject):
            entry = self._entries.get(decision.action_id)
            if entry is not None:
                self._complete(entry, Result.failure(decision.action_id, "rejected", decision.reason),
                               notify_scheduler=False)
        elif isinstance(decision, Requeue):
            entry = self._entries.get(decision.action_id)
            if entry is not None and entry.state == "running":
                entry.state, entry.worker = "queued", None
        elif isinstance(decision, ScalePool):
            if self.sandbox_pool is not None:
                self.sandbox_pool.scale(decision.image, decision.size)

    def _collect_local(self) -> None:
        for result in self.local.collect():
            entry = self._entries.get(result.action_id)
            if entry is None:
                continue
            self._workers["local"].running.discard(result.action_id)
            self._complete(entry, result)

    def _complete(self, entry: _Entry, result: Result, notify_scheduler: bool = True) -> None:
        now = time.monotonic()
        if notify_scheduler:
            self._events.append(ActionFinished(entry.action.id, result.timing.run_s, ok=result.ok))
        # The orchestrator's own clock decides queueing time: arrival to start, whoever ran it.
        result.timing.queued_s = max(0.0, (now - entry.submitted) - result.timing.setup_s - result.timing.run_s)
        entry.state, entry.result, entry.done_at = "done", result, now
        self.metrics.record_result(entry.action.kind, result.ok, result.error_type, result.timing.act_s,
                                   result.timing.queued_s)
        self._outgoing[entry.owner].append(result)

    def _housekeeping(self, now: float) -> None:
        self._events.append(Tick())
        for worker in list(self._workers.values()):
            if worker.identity is not None and now - worker.last_seen > self.settings.worker_timeout_s:
                self._remove_worker(worker, f"silent for {now - worker.last_seen:.0f}s")
        ttl = self.settings.result_ttl_s
        for action_id in [i for i, e in self._entries.items() if e.state == "done" and now - e.done_at > ttl]:
            self._acked[action_id] = self._entries.pop(action_id).owner  # expired unread: still never reruns
        if self.settings.parent_pid is not None and os.getppid() != self.settings.parent_pid:
            log.warning("parent process %d is gone; stopping", self.settings.parent_pid)
            self.stop()

    # --- output -----------------------------------------------------------------------------------
    def _send(self, identity: bytes, message: BaseModel) -> None:
        try:
            self._sock.send_multipart([identity, *wire.encode(message)], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.warning("dropping a %s to %s: its queue is full", type(message).__name__, identity.hex())
        except zmq.ZMQError as exc:
            log.debug("cannot send to %s: %s", identity.hex(), exc)

    def _flush(self) -> None:
        if not self._outgoing:
            return
        outgoing, self._outgoing = self._outgoing, collections.defaultdict(list)
        for identity, results in outgoing.items():
            for start in range(0, len(results), 512):
                self._send(identity, Results(results=results[start : start + 512]))
