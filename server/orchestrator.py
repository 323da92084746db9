"""The orchestrator: one ROUTER socket for clients and workers, a scheduler, and the local executor.

Single-threaded: every message, result and timer is handled on one loop, so the state below needs no
locks. Each message type has one handler in ``_handlers``; anything malformed gets an ``Error`` reply and
is counted, and the loop carries on serving everyone else.
"""

from __future__ import annotations

import collections
import heapq
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
)
from tangram_env.server.config import ServerSettings
from tangram_env.server.executor import LocalRunner, to_wire_value
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
    SessionClosed,
    Start,
    Tick,
    TrajectoryClosed,
    WorkerAdded,
    WorkerRemoved,
)
from tangram_env.server.security import check_bind_allowed, configure_server_curve
from tangram_env.server.state import StateStore

log = logging.getLogger(__name__)

_TICK_S = 0.5
_SNDMORE, _NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)  # plain ints: pyzmq's enum flags cost on each send
_ACKED_IDS_KEPT = 100_000  # about 10 MB; an id acknowledged longer ago than that may run again if resubmitted


@dataclass(slots=True)
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
    deadline: float = float("inf")
    parallelism: int = 1
    attempts: int = 0  # times it was requeued after losing its worker


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
        check_bind_allowed(
            settings.bind,
            curve=settings.curve_secret_key_file is not None,
            allow_remote=settings.allow_remote,
        )
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
        self._authenticator = None
        if settings.curve_secret_key_file:
            self._authenticator = configure_server_curve(
                self._sock, settings.curve_secret_key_file, settings.curve_clients_dir, self._ctx
            )
        self.address = self._bind(settings.bind)
        self._entries: dict[str, _Entry] = {}
        # Ids whose results were acknowledged: remembered (bounded) so they never run again.
        self._acked: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._workers: dict[str, _Worker] = {}
        self._events: list[Event] = []
        self._outgoing: dict[bytes, list[Result]] = collections.defaultdict(list)
        self._outstanding: collections.Counter[bytes] = collections.Counter()  # per client, not yet done
        self._clients_seen: dict[bytes, float] = {}
        self._sessions: dict[bytes, set[str]] = collections.defaultdict(set)  # sandbox sessions per client
        self._session_trajectory: dict[str, str] = {}  # session -> the trajectory it belongs to
        self._deadlines: list[tuple[float, str]] = []  # heap of queued actions' deadlines
        self._next_tick = 0.0
        self.exporter: Any = None
        if settings.metrics_port is not None:
            from tangram_env.server.prometheus import PrometheusExporter

            self.exporter = PrometheusExporter()
            self.metrics_port = self.exporter.start(settings.metrics_port)
            log.info("Prometheus metrics on http://127.0.0.1:%d/metrics", self.metrics_port)
        self._stop_r, self._stop_w = os.pipe()
        os.set_blocking(self._stop_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._sock_ready = zmq.Poller()
        self._sock_ready.register(self._sock, zmq.POLLIN)
        self._poller.register(self._stop_r, zmq.POLLIN)
        self._polled_fds: list[int] = []
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
        self.store = StateStore(settings.state_db) if settings.state_db else None
        if self.store is not None:
            self._restore(self.store)
        # Attachments (the Ray backend): run on the loop at each tick, their figures reported by name.
        self._attached: list[tuple[str, Callable[[Orchestrator, float], None], Callable[[], Any]]] = []

    def attach(
        self, housekeep: Callable[[Orchestrator, float], None], figures: Callable[[], Any], *, name: str
    ) -> None:
        """Call ``housekeep(self, now)`` on the loop every tick; report ``figures()`` under ``name``."""
        self._attached.append((name, housekeep, figures))

    def queued_demands(self) -> list[Resources]:
        """What each queued action waits for: its demand times its least parallelism."""
        out = []
        for entry in self._entries.values():
            if entry.state == "queued" and entry.spec.placement != "inline":
                arrival = self._arrival(entry)
                out.append(arrival.demand.scaled(arrival.min_par))
        return out

    def remove_worker(self, worker_id: str, why: str) -> bool:
        """Take a remote worker out now, as if it had gone silent (its running actions are requeued)."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.identity is None:
            return False
        self._remove_worker(worker, why)
        return True

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
        log.info(
            "orchestrator %s serving on %s with scheduler %s",
            self.server_id[:8],
            self.address,
            self.scheduler.name,
        )
        try:
            while not self._stopping:
                self.run_once(_TICK_S)
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
        fds = self.local.wait_fds()
        if fds != self._polled_fds:  # re-register only when the running children change
            for fd in self._polled_fds:
                self._poller.unregister(fd)
            for fd in fds:
                self._poller.register(fd, zmq.POLLIN)
            self._polled_fds = fds
        deadline = self.local.next_deadline()
        wait = max_wait_s if deadline is None else max(0.0, min(max_wait_s, deadline - time.monotonic()))
        ready = dict(self._poller.poll(int(wait * 1000)))
        if self._sock in ready:
            self._drain_socket()
        now = time.monotonic()
        if len(ready) > (self._sock in ready) + (self._stop_r in ready) or (
            deadline is not None and now >= deadline
        ):
            self._collect_local()
        if now >= self._next_tick:
            self._next_tick = now + _TICK_S
            self._housekeeping(now)
        self._schedule(now)
        if self.store is not None:
            self.store.commit()  # durable before any client sees it
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
        if self._authenticator is not None:
            self._authenticator.stop()
        if self.store is not None:
            self.store.close()
        if self.exporter is not None:
            self.exporter.stop()
        os.close(self._stop_r)
        os.close(self._stop_w)
        log.info("orchestrator %s stopped", self.server_id[:8])

    # --- input ------------------------------------------------------------------------------------
    def _drain_socket(self, budget: int = 10_000) -> None:
        """Handle the messages waiting on the socket (the caller's poll said there is at least one)."""
        now = time.monotonic()
        for i in range(budget):
            if i and not self._sock_ready.poll(0):  # cheaper than reading zmq.EVENTS, no exception
                return
            frames = self._sock.recv_multipart()
            identity = frames[0]  # the ROUTER puts it there: never missing
            self._clients_seen[identity] = now
            try:
                message = wire.decode_frames(frames[1:], self.settings.max_body)
            except ProtocolError as exc:
                self.metrics.protocol_errors[exc.code] += 1
                log.debug("bad message from %s: %s", identity.hex(), exc)
                self._send(identity, Error(code=exc.code, message=exc.message))
                continue
            handler = self._handlers.get(type(message))
            if handler is None:
                self.metrics.protocol_errors["unexpected_type"] += 1
                self._send(
                    identity,
                    Error(
                        code="unexpected_type",
                        message=f"the orchestrator does not accept {getattr(message, 'kind', '?')!r} "
                        "messages",
                    ),
                )
                continue
            try:
                handler(identity, message)
            except Exception as exc:  # a bug in one handler must not stop the loop
                log.exception("handling %s from %s failed", type(message).__name__, identity.hex())
                self.metrics.protocol_errors["internal"] += 1
                self._send(identity, Error(code="internal", message=f"{type(exc).__name__}: {exc}"))

    def _on_submit(self, identity: bytes, msg: Submit) -> None:
        if msg.acks:
            self._forget(identity, msg.acks)
        now = time.monotonic()
        busy: list[str] = []
        for action in msg.actions:
            entry = self._entries.get(action.id)
            if entry is not None:  # a resubmitted id never runs twice
                if entry.owner != identity:
                    self._send(
                        identity,
                        Error(
                            code="conflict",
                            action_ids=[action.id],
                            message="this action id belongs to another client",
                        ),
                    )
                elif entry.result is not None:
                    self._outgoing[identity].append(entry.result)
                continue
            if action.id in self._acked:
                self._reject(
                    identity,
                    action.id,
                    "duplicate",
                    "this action id already ran and its result was acknowledged; ids run at most once",
                )
                continue
            if self._outstanding[identity] >= self.settings.max_queued_per_client:
                busy.append(action.id)  # backpressure: the client resubmits these later
                continue
            self.metrics.submitted += 1
            try:
                spec = self.registry.get(action.kind)
                args = spec.validate_payload(action.payload)
            except UnknownNameError as exc:
                self._reject(identity, action.id, "unknown_kind", str(exc))
                continue
            except ValidationError as exc:
                self._reject(
                    identity,
                    action.id,
                    "bad_payload",
                    f"arguments of {action.kind!r} are invalid: {describe_validation_error(exc)}",
                )
                continue
            self._admit(
                _Entry(
                    action=action,
                    spec=spec,
                    owner=identity,
                    submitted=now,
                    timeout_s=action.timeout_s or spec.timeout_s,
                ),
                args,
            )
        if busy:
            self.metrics.errors["busy"] += len(busy)
            self._send(
                identity,
                Error(
                    code="busy",
                    action_ids=busy,
                    message=(
                        f"more than {self.settings.max_queued_per_client} actions outstanding; resubmit later"
                    ),
                ),
            )

    def _admit(self, entry: _Entry, args: Any) -> None:
        """Take a validated action in: run it inline, or queue it for the scheduler."""
        action = entry.action
        self._entries[action.id] = entry
        self._outstanding[entry.owner] += 1
        if action.affinity:
            self._sessions[entry.owner].add(action.affinity)
            if action.trajectory_id:
                self._session_trajectory[action.affinity] = action.trajectory_id
        if entry.spec.placement == "inline":
            self._run_inline(entry, args)
            return
        if action.deadline_s is not None:
            entry.deadline = entry.submitted + action.deadline_s
            heapq.heappush(self._deadlines, (entry.deadline, action.id))
        if self.store is not None:
            self.store.added(action, entry.owner)
        self._events.append(self._arrival(entry))

    def _restore(self, store: StateStore) -> None:
        """Resume from the state file: queue what was queued, fail what was running, keep results."""
        stored, acked = store.load()
        self._acked.update(dict.fromkeys(acked, b""))
        now = time.monotonic()
        counts: collections.Counter[str] = collections.Counter()
        for item in stored:
            counts[item.state] += 1
            try:
                spec = self.registry.get(item.action.kind)
            except UnknownNameError:
                # Its plugin is gone: a resubmission is rejected as an unknown kind, nothing runs.
                log.warning(
                    "not restoring action %s: kind %r is not registered", item.action.id, item.action.kind
                )
                continue
            result = item.result
            entry = _Entry(
                action=item.action,
                spec=spec,
                owner=item.owner,
                submitted=now,
                timeout_s=item.action.timeout_s or spec.timeout_s,
            )
            if result is None and item.state == "queued":
                self._admit(entry, None)
                continue
            if result is None:  # running when the orchestrator died: it may have had side effects
                result = Result.failure(
                    item.action.id,
                    "error",
                    "lost: the orchestrator stopped while this action ran; not rerun, "
                    "since it may have had effects already",
                )
                store.finished(result)
            self._entries[item.action.id] = entry
            entry.state, entry.result, entry.done_at = "done", result, now
        store.commit()
        if stored:
            log.info("restored from %s: %s", store.path, dict(counts))

    @staticmethod
    def _arrival(entry: _Entry) -> ActionArrived:
        """The scheduler's view of a queued action: its resolved demand and elasticity."""
        action, spec = entry.action, entry.spec
        demand = action.demand or spec.demand
        elastic = action.elastic or spec.elastic
        return ActionArrived(
            action_id=action.id,
            kind=action.kind,
            demand=Resources(demand.cpu, demand.mem_mb, demand.gpu, demand.gpu_mem_mb),
            min_par=elastic.min_par,
            max_par=elastic.max_par,
            trajectory_id=action.trajectory_id,
            env_id=action.env_id,
            affinity=action.affinity,
            image=action.image or spec.image,
            priority=action.priority,
        )

    def _reject(self, identity: bytes, action_id: str, code: str, message: str) -> None:
        self.metrics.errors["rejected"] += 1
        self._send(identity, Error(code=code, message=message, action_ids=[action_id]))

    def _run_inline(self, entry: _Entry, args: Any) -> None:
        """Trivial built-ins run on the loop itself: no scheduling, no process."""
        t0 = time.monotonic()
        action_id = entry.action.id
        try:
            if entry.spec.takes_ctx:
                value = entry.spec.target(
                    args, ctx=ActionContext(action=entry.action, deadline=t0 + entry.timeout_s)
                )
            else:
                value = entry.spec.target(args)
            ok, value, error = True, to_wire_value(value), ""
        except Exception as exc:
            ok, value, error = False, None, f"{type(exc).__name__}: {exc}"
        result = Result(
            action_id=action_id,
            ok=ok,
            value=value,
            error_type=None if ok else "error",
            message=error,
            timing={"run_s": time.monotonic() - t0},  # validated into Timing; cheaper than building one
            worker="orchestrator",
        )
        self._complete(entry, result, notify_scheduler=False)

    def _on_ack(self, identity: bytes, msg: Ack) -> None:
        self._forget(identity, msg.action_ids)

    def _forget(self, identity: bytes, action_ids: list[str]) -> None:
        """The client has these results: drop them, remembering only that the ids ran."""
        for action_id in action_ids:
            entry = self._entries.get(action_id)
            if entry is not None and entry.owner == identity and entry.state == "done":
                del self._entries[action_id]
                self._acked[action_id] = identity
                if len(self._acked) > _ACKED_IDS_KEPT:
                    self._acked.popitem(last=False)
                if self.store is not None:
                    self.store.acknowledged(action_id)

    def _on_cancel(self, identity: bytes, msg: Cancel) -> None:
        for action_id in msg.action_ids:
            entry = self._entries.get(action_id)
            if entry is None or entry.owner != identity or entry.state != "queued":
                continue  # not yours, unknown, or already started: deferred, never preempted
            self._events.append(ActionCancelled(action_id))
            self._complete(
                entry,
                Result.failure(action_id, "cancelled", "cancelled before it started"),
                notify_scheduler=False,
            )

    def _on_close_sessions(self, identity: bytes, msg: CloseSessions) -> None:
        owned = self._sessions.get(identity, set())
        mine = [s for s in msg.session_ids if s in owned]  # nobody ends another client's sessions
        owned.difference_update(mine)
        self._end_sessions(mine)

    def _on_heartbeat(self, identity: bytes, msg: Heartbeat) -> None:
        worker = self._worker_by_identity(identity)
        if worker is not None:
            worker.last_seen = time.monotonic()
            if msg.figures is not None:
                worker.figures = msg.figures
        self._send(identity, Heartbeat(server_id=self.server_id))

    def _on_register(self, identity: bytes, msg: Register) -> None:
        old = self._workers.get(msg.worker_id)
        if old is not None:
            self._remove_worker(old, "re-registered")
        kinds = frozenset(msg.kinds) if msg.kinds else None
        self._add_worker(
            _Worker(
                msg.worker_id,
                Resources(msg.cpu, msg.mem_mb, msg.gpu, msg.gpu_mem_mb),
                kinds,
                identity=identity,
            )
        )
        log.info(
            "worker %s joined: %s cpu, %s MiB, %s gpu, kinds %s",
            msg.worker_id,
            msg.cpu,
            msg.mem_mb,
            msg.gpu,
            sorted(kinds) if kinds else "all",
        )
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
        self._send(identity, Stats(figures=self.figures()))

    def figures(self) -> dict[str, Any]:
        """Everything ``Stats`` reports: counters, queue, and each worker's capacity and use."""
        figures = self.metrics.snapshot()
        figures.update(
            server_id=self.server_id,
            scheduler=self.scheduler.name,
            pending=self.scheduler.pending(),
            running=self.scheduler.running(),
            entries=len(self._entries),
            metrics_port=self.exporter.port if self.exporter is not None else None,
            workers={w.worker_id: self._worker_figures(w) for w in self._workers.values()},
        )
        for name, _, attached_figures in self._attached:
            figures[name] = attached_figures()
        return figures

    def _worker_figures(self, worker: _Worker) -> dict[str, Any]:
        used = Resources()
        for action_id in worker.running:
            entry = self._entries.get(action_id)
            if entry is not None:
                arrival = self._arrival(entry)
                used = used + arrival.demand.scaled(entry.parallelism)
        return {
            "capacity": vars(worker.capacity),
            "used": vars(used),
            "running": len(worker.running),
            "kinds": sorted(worker.kinds) if worker.kinds else None,
            "figures": worker.runner.stats() if worker.runner else worker.figures,
        }

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
        log.warning(
            "worker %s left (%s); %d running actions go back to the queue",
            worker.worker_id,
            why,
            len(worker.running),
        )
        del self._workers[worker.worker_id]
        self._events.append(WorkerRemoved(worker.worker_id))  # the scheduler requeues what ran there
        for action_id in worker.running:
            entry = self._entries.get(action_id)
            if entry is None or entry.state != "running":
                continue
            entry.state, entry.worker = "queued", None
            entry.attempts += 1
            if entry.attempts > self.settings.max_retries:
                self._events.append(ActionCancelled(action_id))
                self._complete(
                    entry,
                    Result.failure(
                        action_id,
                        "error",
                        f"its worker was lost {entry.attempts} times (last: {worker.worker_id}, "
                        f"{why}); not retried again",
                    ),
                    notify_scheduler=False,
                )
            elif self.store is not None:
                self.store.requeued(action_id)
        worker.running.clear()

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
            left = entry.deadline - now
            if left <= 0:  # it can no longer finish in time: fail fast instead of starting
                self._events.append(ActionFinished(decision.action_id, 0.0, ok=False))
                self._complete(entry, self._deadline_result(entry), notify_scheduler=False)
                return
            entry.state, entry.worker, entry.parallelism = "running", worker.worker_id, decision.parallelism
            worker.running.add(decision.action_id)
            if self.store is not None:  # durable before it starts: a crash now must not rerun it
                self.store.started(decision.action_id)
                self.store.commit()
            grant = Grant(
                action=entry.action,
                parallelism=decision.parallelism,
                timeout_s=min(entry.timeout_s, left),
                queued_s=now - entry.submitted,
            )
            if worker.runner is not None:
                worker.runner.start(grant)
            else:
                assert worker.identity is not None
                self._send(worker.identity, Dispatch(grants=[grant]))
        elif isinstance(decision, Reject):
            entry = self._entries.get(decision.action_id)
            if entry is not None:
                self._complete(
                    entry,
                    Result.failure(decision.action_id, "rejected", decision.reason),
                    notify_scheduler=False,
                )
        elif isinstance(decision, Requeue):
            entry = self._entries.get(decision.action_id)
            if entry is not None and entry.state == "running":
                entry.state, entry.worker = "queued", None
        elif isinstance(decision, ScalePool) and self.sandbox_pool is not None:
            self.sandbox_pool.keep(decision.image, decision.size)

    def _collect_local(self) -> None:
        for result in self.local.collect():
            entry = self._entries.get(result.action_id)
            if entry is None:
                continue
            self._workers["local"].running.discard(result.action_id)
            self._complete(entry, result)

    def _complete(self, entry: _Entry, result: Result, notify_scheduler: bool = True) -> None:
        if entry.state == "done":
            return  # exactly one result per action
        now = time.monotonic()
        if notify_scheduler:
            self._events.append(
                ActionFinished(
                    entry.action.id, result.timing.run_s, ok=result.ok, setup_s=result.timing.setup_s
                )
            )
        # The orchestrator's own clock decides queueing time: arrival to start, whoever ran it.
        result.timing.queued_s = max(
            0.0, (now - entry.submitted) - result.timing.setup_s - result.timing.run_s
        )
        entry.state, entry.result, entry.done_at = "done", result, now
        self._outstanding[entry.owner] -= 1
        self.metrics.record_result(
            entry.action.kind, result.ok, result.error_type, result.timing.act_s, result.timing.queued_s
        )
        if self.exporter is not None:
            self.exporter.observe_result(
                entry.action.kind, result.ok, result.error_type, result.timing.act_s, result.timing.queued_s
            )
        if self.store is not None:
            self.store.finished(result)
        self._outgoing[entry.owner].append(result)

    @staticmethod
    def _deadline_result(entry: _Entry) -> Result:
        return Result.failure(
            entry.action.id,
            "deadline",
            f"its deadline of {entry.action.deadline_s:g}s passed before it could finish",
        )

    def _housekeeping(self, now: float) -> None:
        self._events.append(Tick())
        for worker in list(self._workers.values()):
            if worker.identity is not None and now - worker.last_seen > self.settings.worker_timeout_s:
                self._remove_worker(worker, f"silent for {now - worker.last_seen:.0f}s")
        while self._deadlines and self._deadlines[0][0] <= now:
            _, action_id = heapq.heappop(self._deadlines)
            entry = self._entries.get(action_id)
            if entry is not None and entry.state == "queued":
                self._events.append(ActionCancelled(action_id))
                self._complete(entry, self._deadline_result(entry), notify_scheduler=False)
        self._drop_silent_clients(now)
        for name, housekeep, _ in self._attached:
            try:
                housekeep(self, now)
            except Exception:  # an attachment's trouble (Ray unreachable) must not stop the loop
                log.exception("the %s attachment failed this tick", name)
        if self.sandbox_pool is not None:
            self.sandbox_pool.maintain(now)  # retire warm sandboxes idle too long
        ttl = self.settings.result_ttl_s
        for action_id in [i for i, e in self._entries.items() if e.state == "done" and now - e.done_at > ttl]:
            self._acked[action_id] = self._entries.pop(action_id).owner  # expired unread: still never reruns
        if self.exporter is not None:
            self.exporter.update(self.figures())
        if self.settings.parent_pid is not None and os.getppid() != self.settings.parent_pid:
            log.warning("parent process %d is gone; stopping", self.settings.parent_pid)
            self.stop()

    def _drop_silent_clients(self, now: float) -> None:
        """A client that went silent with work outstanding crashed: cancel its queue, free its sandboxes."""
        limit = self.settings.client_timeout_s
        silent = [c for c, seen in self._clients_seen.items() if now - seen > limit]
        for identity in silent:
            del self._clients_seen[identity]
            if self._outstanding[identity] <= 0 and not self._sessions.get(identity):
                continue
            log.warning(
                "client %s silent for %.0fs: cancelling its queued actions", identity.hex()[:12], limit
            )
            for entry in [e for e in self._entries.values() if e.owner == identity and e.state == "queued"]:
                self._events.append(ActionCancelled(entry.action.id))
                self._complete(
                    entry,
                    Result.failure(entry.action.id, "cancelled", "its client went away"),
                    notify_scheduler=False,
                )
            self._end_sessions(self._sessions.pop(identity, set()))

    def _end_sessions(self, sessions: set[str] | list[str]) -> None:
        for session in sessions:  # the scheduler frees the session's caps and its trajectory's slot
            self._events.append(SessionClosed(session))
            trajectory = self._session_trajectory.pop(session, None)
            if trajectory is not None:
                self._events.append(TrajectoryClosed(trajectory))
        if self.sandbox_pool is None:
            return
        for session in sessions:
            try:
                self.sandbox_pool.end_session(session)
            except Exception:
                log.exception("ending sandbox session %s failed", session)

    # --- output -----------------------------------------------------------------------------------
    def _send(self, identity: bytes, message: BaseModel) -> None:
        try:
            self._sock.send(identity, _SNDMORE)
            self._sock.send(wire.encode(message), _NOBLOCK)
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
