"""The life of every action in the orchestrator: a pure state machine, as the scheduler is.

:class:`Lifecycle` takes what happens (a decoded message from a peer, results from a runner, the
timer) with ``now`` and returns *effects* for the shell (:mod:`~.orchestrator`) to carry out: send a
message, run a grant, persist a change, end sandbox sessions. It owns the scheduler (another pure
state machine) and feeds it the events of one loop turn at once (:meth:`Lifecycle.flush`). No
sockets, no clock reads, no threads: the tests drive it with plain calls and check
:meth:`Lifecycle.validate_state` after each.

An action's stages and every legal move between them are listed once, in :data:`TRANSITIONS`:
admitted (NEW to QUEUED, or to RUNNING for inline kinds), started (QUEUED to RUNNING), requeued when
its worker is lost (RUNNING to QUEUED), given its one result (to DONE: finished, rejected, cancelled,
expired), and forgotten once acknowledged or expired unread (DONE to FORGOTTEN).
"""

from __future__ import annotations

import collections
import enum
import heapq
import hmac
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack
from pydantic import BaseModel, ValidationError

from tangram_env.errors import UnknownNameError, describe_validation_error
from tangram_env.kinds import KindRegistry, KindSpec
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
    Resources,
    Result,
    Results,
    Stats,
    Submit,
    id_batches,
)
from tangram_env.server.admission import arrival, resolve
from tangram_env.server.backpressure import BusyRetries, is_busy
from tangram_env.server.effects import (
    Effect,
    EndSessions,
    KeepWarm,
    Observe,
    Persist,
    Run,
    RunInline,
    Send,
    SendFigures,
    Stop,
)
from tangram_env.server.metrics import Metrics
from tangram_env.server.quota_hooks import quota_figures, quota_starved, throttle_of
from tangram_env.server.scheduler.events import (
    ActionArrived,
    ActionCancelled,
    ActionFinished,
    Event,
    Reject,
    Requeue,
    ScalePool,
    Scheduler,
    SessionClosed,
    Start,
    Tick,
    TrajectoryClosed,
    WorkerAdded,
    WorkerRemoved,
)
from tangram_env.server.scheduler.story import IllegalTransition
from tangram_env.wire import DEFAULT_MAX_BODY

__all__ = [  # the effects and the admission helpers are re-exported: the shell and tests import them here
    "INLINE",
    "Effect",
    "EndSessions",
    "Entry",
    "KeepWarm",
    "Lifecycle",
    "Limits",
    "Observe",
    "Persist",
    "Run",
    "RunInline",
    "Send",
    "SendFigures",
    "Stage",
    "Stop",
    "arrival",
    "resolve",
]

log = logging.getLogger(__name__)

INLINE = "orchestrator"  # the worker id inline actions report: they run on the loop itself
ACKED_IDS_KEPT = 100_000  # about 10 MB; an id acknowledged longer ago than that may run again
RESULTS_PER_MESSAGE = 512
#: A stored result goes out again for a resubmitted id at most this often: a client that resubmits
#: without reading its socket would otherwise have the server queue copy after copy for it. The first
#: resubmission always gets it: the first copy may never have left (a ROUTER drops what it sends to a
#: client that is not connected, as every client is for a moment after the orchestrator restarts).
RESEND_GAP_S = 1.0
LOST_SESSIONS_KEPT = 100_000  # sessions remembered as lost until their clients end them
#: Identities of workers taken out while they may live on (silent past worker_timeout_s, a grant held
#: past its limit, removed by a cluster manager): their heartbeats are answered ``not_registered``, which
#: makes a worker register again, instead of as if they were still in the books (they would idle for good).
DROPPED_WORKERS_KEPT = 10_000
STARVING_WARN_S = 30.0  # nothing running while new sandbox sessions wait this long: a warning
UNSERVED_WARN_S = 30.0  # how often queued actions of kinds no live worker serves are reported


def client_family(identity: bytes) -> bytes:
    """The client a connection belongs to: an AsyncClient's identity is its sync client's, then
    ``/`` and its own part; both may use the sandbox sessions either opened, nobody else may.
    """
    return identity.partition(b"/")[0]


class Stage(str, enum.Enum):
    """Where an action is in the orchestrator's books."""

    NEW = "new"  # not known yet (the origin of the first transition)
    QUEUED = "queued"  # admitted; the scheduler decides when and where
    RUNNING = "running"  # granted to a worker (or running inline)
    DONE = "done"  # has its result, kept until acknowledged or expired
    FORGOTTEN = "forgotten"  # the result was acknowledged or expired; only the id is remembered


_S = Stage
#: Every legal move, listed once.
TRANSITIONS: frozenset[tuple[Stage, Stage]] = frozenset(
    {
        (_S.NEW, _S.QUEUED),  # admitted
        (_S.NEW, _S.RUNNING),  # an inline kind, run on the loop at once
        (_S.NEW, _S.DONE),  # restored from the state file with its result
        (_S.QUEUED, _S.RUNNING),  # the scheduler started it
        (_S.QUEUED, _S.DONE),  # rejected, cancelled, expired, or its client went away
        (_S.RUNNING, _S.QUEUED),  # requeued: its worker was lost
        (_S.RUNNING, _S.DONE),  # finished, whatever the outcome
        (_S.DONE, _S.FORGOTTEN),  # acknowledged, or expired unread
    }
)


def _gone_on_restart(session: str) -> str:
    return (
        f"the orchestrator restarted: the sandbox of session {session!r} is gone with its files; close "
        "the session and open a new one"
    )


def _lost_message(session: str | None, why: str) -> str:
    return (
        f"sandbox session {session!r} lost its sandbox ({why}) with its files and processes; "
        "end the session (reset the env) to start again"
    )


# --- books ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Entry:
    """One action the orchestrator knows of, from admission until its result is forgotten."""

    action: Action  # resolved: demand, elasticity, image and timeout filled in from its kind
    spec: KindSpec
    args: Any  # the validated payload (None when restored: validated again where it runs)
    owner: bytes
    submitted: float
    stage: Stage = Stage.NEW
    worker: str | None = None
    api_key: str | None = None  # the API key its grant holds (see quota_hooks)
    result: Result | None = None
    done_at: float = 0.0
    deadline: float = float("inf")
    parallelism: int = 1
    attempts: int = 0  # times it was requeued after losing its worker
    throttles: int = 0  # times its API answered 429 (each requeued it)
    retry_at: float | None = None  # queued but out of the scheduler: waiting out a provider's backpressure
    ends_by: float = float("inf")  # running: when its grant's time limit ends (start + grant timeout)
    sent_at: float = float("-inf")  # when its result last went out to its owner
    stopping: bool = False  # running, and its worker was asked to stop it (its owner cancelled it)


#: The most a worker's figures may take: every Stats reply carries every worker's, and a reply past
#: the clients' message limit would reach no one.
MAX_WORKER_FIGURES_BYTES = 256 * 1024


def _bounded_figures(worker_id: str, figures: dict[str, Any]) -> dict[str, Any]:
    """``figures`` if they fit :data:`MAX_WORKER_FIGURES_BYTES` once packed, else a note saying why not."""
    size = len(msgpack.packb(figures, default=str))
    if size <= MAX_WORKER_FIGURES_BYTES:
        return figures
    log.warning(
        "worker %s sent %d bytes of figures; dropped (the limit is %d)",
        worker_id,
        size,
        MAX_WORKER_FIGURES_BYTES,
    )
    return {"dropped": f"{size} bytes of figures, over the {MAX_WORKER_FIGURES_BYTES} a worker may report"}


@dataclass(slots=True)
class WorkerBook:
    """A place actions run: an in-process runner (``identity`` None) or a remote worker."""

    worker_id: str
    capacity: Resources
    kinds: frozenset[str] | None
    identity: bytes | None = None
    last_seen: float = 0.0
    running: set[str] = field(default_factory=set)
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Limits:
    """The settings the core obeys (resolved at the edge from ``ServerSettings``)."""

    max_queued_per_client: int = 20_000
    max_unacked_per_client: int = 100_000  # results kept for a client until it acknowledges them
    max_sessions_per_client: int | None = None  # live sessions per client family (None: no limit)
    max_retries: int = 2
    max_throttles: int = 10  # 429s one action takes before it fails as `throttled` (a key out for good)
    worker_timeout_s: float = 10.0
    client_timeout_s: float = 60.0
    result_ttl_s: float = 600.0
    busy_first_s: float = 0.5  # a provider's backpressure: the first wait before a retry (then doubled)
    busy_max_s: float = 15.0  # the longest wait between retries
    busy_tries: int = 12  # refusals in a row before the action fails (as an infrastructure failure)
    max_body: int = DEFAULT_MAX_BODY  # the wire's limit, told each worker that registers
    session_idle_s: float | None = 3600.0  # a sandbox session with nothing in flight this long ends


class Lifecycle:
    """Owns every action's life in the orchestrator (see the module's description)."""

    def __init__(
        self,
        registry: KindRegistry,
        scheduler: Scheduler,
        *,
        server_id: str = "",
        limits: Limits | None = None,
        persistent: bool = False,
        observed: bool = False,
        story_size: int = 100_000,
        sandbox_mem_mb: Callable[[str], float] | None = None,
        sandbox_provider: str | None = None,
        worker_token: str | None = None,
    ) -> None:
        self.registry = registry
        # Where set, only peers that know it may register as workers (and so receive actions, and
        # answer them): any client could otherwise pose as one.
        self.worker_token = worker_token
        # Which provider creates the sandboxes (its creation-rate caps apply); None: "local".
        self.sandbox_provider = sandbox_provider
        # The memory a live sandbox of an image holds (its SandboxSpec's, resolved at the edge): lent in
        # the scheduler's ledger from a session's first action to its close. None: nothing is reserved.
        self.sandbox_mem_mb = sandbox_mem_mb
        self.scheduler = scheduler
        self.wake_at: float | None = None  # when the scheduler's next timer is due (an API token, ...)
        self.server_id = server_id
        self.limits = limits or Limits()
        self.persistent = persistent
        self.observed = observed
        self.metrics = Metrics()
        self.busy = BusyRetries(self.limits.busy_first_s, self.limits.busy_max_s, self.limits.busy_tries)
        self._starving_since: float | None = None  # nothing running, actions waiting: since when
        self._unserved_check_at = 0.0
        self.entries: dict[str, Entry] = {}
        # Ids whose results were acknowledged: remembered (bounded) so they never run again.
        self.acked: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self.workers: dict[str, WorkerBook] = {}
        # Identities of workers taken out while they may live on: the reply their heartbeats get (see
        # DROPPED_WORKERS_KEPT), until they register again.
        self._dropped: collections.OrderedDict[bytes, Error] = collections.OrderedDict()
        self._events: list[Event] = []
        self._outgoing: dict[bytes, list[Result]] = {}
        self._outstanding: collections.Counter[bytes] = collections.Counter()  # per client, not done
        self._clients_seen: dict[bytes, float] = {}
        self._sessions: dict[bytes, set[str]] = collections.defaultdict(set)  # per client
        self._session_family: dict[str, bytes] = {}  # whose session it is (see client_family)
        self._family_sessions: collections.Counter[bytes] = collections.Counter()  # live ones per family
        self._session_trajectory: dict[str, str] = {}
        self._session_seen: dict[str, float] = {}  # when each session last had an action admitted or done
        self._session_running: dict[str, set[str]] = {}  # session -> its actions running now
        self._unacked: collections.Counter[bytes] = collections.Counter()  # client -> results it holds
        self._done_order: collections.deque[tuple[float, str]] = collections.deque()  # (done at, id)
        # Sessions their clients closed while a command of theirs ran: ended (reset) once it is done,
        # not under it.
        self._closing: set[str] = set()
        # Sessions whose first action started (their sandbox is held), and the worker holding it.
        self._session_worker: dict[str, str] = {}
        # Sessions ended though their clients did not (their worker was lost, they idled past
        # session_idle_s): (client family, why), until the client ends them (see _lose_sessions).
        self._lost_sessions: collections.OrderedDict[str, tuple[bytes, str]] = collections.OrderedDict()
        self._idle_check_at = 0.0
        self._deadlines: list[tuple[float, str]] = []  # heap of queued actions' deadlines
        # What happened, oldest first: (action id, from, to, why, stimulus id, now); bounded, as dask's.
        self._log: collections.deque[tuple[str, Stage, Stage, str, str, float]] = collections.deque(
            maxlen=story_size
        )
        self._stimuli = 0
        self._stimulus = ""  # what caused the transitions being made now (logged with each)
        self._handlers: dict[type[BaseModel], Callable[[bytes, Any, float, list[Effect]], None]] = {
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

    # --- stimuli -------------------------------------------------------------------------------------
    def accepts(self, message: BaseModel) -> bool:
        """Whether peers may send this message type to the orchestrator."""
        return type(message) in self._handlers

    def receive(self, peer: bytes, message: BaseModel, now: float) -> list[Effect]:
        """A decoded message from ``peer`` (a client or a worker)."""
        out: list[Effect] = []
        self._clients_seen[peer] = now
        self._stimulate(message.kind)  # type: ignore[attr-defined]
        self._handlers[type(message)](peer, message, now, out)
        return out

    def add_runner(self, worker_id: str, capacity: Resources, kinds: frozenset[str] | None) -> None:
        """An in-process runner joins (the shell starts it and calls its ``start`` on ``Run``)."""
        self._add_worker(WorkerBook(worker_id, capacity, kinds))

    def finished(self, worker_id: str, results: Iterable[Result], now: float) -> list[Effect]:
        """Results from an in-process runner (``worker_id``), or of inline actions (:data:`INLINE`)."""
        self._stimulate(f"results-from-{worker_id}")
        out: list[Effect] = []
        self._finished(worker_id, results, now, out)
        return out

    def _finished(self, worker_id: str, results: Iterable[Result], now: float, out: list[Effect]) -> None:
        worker = self.workers.get(worker_id)
        for result in results:
            entry = self.entries.get(result.action_id)
            if entry is None or entry.stage is not Stage.RUNNING or entry.worker != worker_id:
                continue  # a late answer for an action that was requeued elsewhere
            if worker is not None:
                worker.running.discard(result.action_id)
            self._complete(entry, result, now, out, "finished")

    def tick(self, now: float) -> list[Effect]:
        """The timer: silent workers and clients, expired results (deadlines go in :meth:`flush`)."""
        self._stimulate("tick")
        out: list[Effect] = []
        self._events.append(Tick())
        timeout = self.limits.worker_timeout_s
        for worker in list(self.workers.values()):
            if worker.identity is None:
                continue
            if now - worker.last_seen > timeout:
                self._remove_worker(worker, f"silent for {now - worker.last_seen:.0f}s", now, out)
                continue
            # A worker enforces each grant's time limit itself; one that still holds a grant a
            # worker_timeout_s after it is as good as lost (hung, or its result could not reach us).
            overdue = [i for i in worker.running if now > self.entries[i].ends_by + timeout]
            if overdue:
                why = f"held {overdue[0]} {timeout:.0f}s past its time limit"
                self._remove_worker(worker, why, now, out)
        self._drop_silent_clients(now, out)
        self._end_idle_sessions(now, out)
        self._warn_if_sessions_starve(now)
        self._warn_if_kinds_unserved(now)
        ttl, order = self.limits.result_ttl_s, self._done_order
        if len(order) > 2 * len(self.entries) + 1024:  # mostly acknowledged since: drop those (amortised)
            entries = self.entries
            kept = (e for e in order if (got := entries.get(e[1])) is not None and got.stage is Stage.DONE)
            order = self._done_order = collections.deque(kept)
        while order and now - order[0][0] > ttl:  # oldest first: no walk over every entry each tick
            entry = self.entries.get(order.popleft()[1])
            if entry is not None and entry.stage is Stage.DONE and now - entry.done_at > ttl:
                self._forget(entry, now, "expired unread")
                if self.persistent:  # as in memory: gone from the file, its id refused as a duplicate
                    out.append(Persist("expired", (entry.action.id,)))
        return out

    def wake(self, now: float) -> None:
        """Tell the scheduler its timer is due, if it is (the shell waits no longer than :attr:`wake_at`)."""
        if self.wake_at is not None and now >= self.wake_at:
            self.wake_at = None
            self._events.append(Tick())

    def flush(self, now: float) -> list[Effect]:
        """End of a loop turn: expire deadlines, let the scheduler decide, and send the results."""
        self._stimulate("schedule")
        out: list[Effect] = []
        if self._closing:
            done = [s for s in self._closing if s not in self._session_running]
            self._closing.difference_update(done)
            self._end_sessions(done, out)
        self._expire_deadlines(now, out)
        self._end_back_offs(now)
        if self._events:
            events, self._events = self._events, []
            decisions = self.scheduler.handle(events, now)
            # Its timers (the next API token, ...) and the end of the next provider back-off.
            timers = [t for t in (self.scheduler.next_wakeup(now), self.busy.next_due()) if t is not None]
            self.wake_at = min(timers, default=None)
            for decision in decisions:
                if type(decision) is Start:
                    self._start(decision, now, out)
                elif type(decision) is Requeue:
                    self._requeue(decision.action_id, now, out)
                elif type(decision) is Reject:
                    entry = self.entries.get(decision.action_id)
                    if entry is not None and entry.stage is Stage.QUEUED:
                        failure = Result.failure(decision.action_id, "rejected", decision.reason)
                        self._complete(entry, failure, now, out, "rejected by the scheduler")
                elif type(decision) is ScalePool:
                    out.append(KeepWarm(decision.image, decision.size, decision.expire))
        if self._outgoing:
            outgoing, self._outgoing = self._outgoing, {}
            for peer, results in outgoing.items():
                for start in range(0, len(results), RESULTS_PER_MESSAGE):
                    out.append(Send(peer, Results(results=results[start : start + RESULTS_PER_MESSAGE])))
        return out

    def restore(self, stored: Iterable[Any], acked: Iterable[str], now: float) -> list[Effect]:
        """Resume from the state file: queue what was queued, fail what was running, keep results.

        ``stored`` holds :class:`~tangram_env.server.state.Stored` records (action, owner, state, result).
        """
        self._stimulate("restore")
        out: list[Effect] = []
        self.acked.update(dict.fromkeys(acked, b""))
        while len(self.acked) > ACKED_IDS_KEPT:  # the newest are kept, as when they were acknowledged
            self.acked.popitem(last=False)
        for item in stored:
            try:
                spec = self.registry.get(item.action.kind)
            except UnknownNameError:
                # Its plugin is gone: a resubmission is rejected as an unknown kind, nothing runs.
                log.warning(
                    "not restoring action %s: kind %r is not registered", item.action.id, item.action.kind
                )
                continue
            entry = Entry(resolve(spec, item.action), spec, None, item.owner, now)
            result = item.result
            if result is None and item.state == "queued" and item.action.affinity is None:
                self._admit(entry, now, out)
                continue
            if result is None and item.state == "queued":
                # Its session's sandbox ended with the orchestrator: run now, it would find an empty one.
                result = Result.failure(
                    item.action.id, "sandbox_died", _gone_on_restart(item.action.affinity)
                )
            elif result is None:  # running when the orchestrator died: it may have had side effects
                result = Result.failure(
                    item.action.id,
                    "error",
                    "lost: the orchestrator stopped while this action ran; not rerun, "
                    "since it may have had effects already",
                )
            if item.result is None and self.persistent:
                out.append(Persist("finished", (result,)))
            self.entries[entry.action.id] = entry
            self._move(entry, Stage.DONE, now, "restored")
            entry.result, entry.done_at = result, now
        return out

    # --- messages ------------------------------------------------------------------------------------
    def _on_submit(self, peer: bytes, msg: Submit, now: float, out: list[Effect]) -> None:
        if msg.acks:
            self._forget_acked(peer, msg.acks, now, out)
        busy: list[str] = []
        # The client's sessions lived on an orchestrator before this one: their sandboxes are gone.
        restarted = bool(msg.server_id) and msg.server_id != self.server_id
        for action in msg.actions:
            entry = self.entries.get(action.id)
            if entry is not None:  # a resubmitted id never runs twice
                if entry.owner != peer:
                    out.append(
                        Send(
                            peer,
                            Error(
                                code="conflict",
                                action_ids=[action.id],
                                message="this action id belongs to another client",
                            ),
                        )
                    )
                elif entry.result is not None and now - entry.sent_at >= RESEND_GAP_S:
                    entry.sent_at = now
                    self._outgoing.setdefault(peer, []).append(entry.result)
                continue
            lost = self._lost_sessions.get(action.affinity) if action.affinity else None
            holder = lost[0] if lost else self._session_family.get(action.affinity or "")
            if holder is not None and holder != client_family(peer):
                why = (
                    f"sandbox session {action.affinity!r} belongs to another client: run its actions "
                    "through the client that opened it (or an AsyncClient made from that client)"
                )
                self._reject(peer, action.id, "conflict", why, out)
                continue
            if action.affinity in self._closing and lost is None:  # a lost one says so, below
                why = (
                    f"sandbox session {action.affinity!r} was closed and ends when its running command "
                    "does: open a new session (a new id) for more commands"
                )
                self._reject(peer, action.id, "conflict", why, out)
                continue
            if action.id in self.acked:
                self._reject(
                    peer,
                    action.id,
                    "duplicate",
                    "this action id already ran and its result was acknowledged; ids run at most once",
                    out,
                )
                continue
            if (
                self._outstanding[peer] >= self.limits.max_queued_per_client
                or self._unacked[peer] >= self.limits.max_unacked_per_client
            ):
                busy.append(action.id)  # backpressure: the client resubmits these later
                continue
            self.metrics.submitted += 1
            try:
                spec = self.registry.get(action.kind)
                args = spec.validate_payload(action.payload)
                resolve(spec, action)
                if spec.placement == "sandbox" and self.sandbox_mem_mb is not None:
                    self.sandbox_mem_mb(action.image)  # type: ignore[arg-type]  # the image's settings
            except UnknownNameError as exc:
                self._reject(peer, action.id, "unknown_kind", str(exc), out)
                continue
            except ValidationError as exc:
                why = f"arguments of {action.kind!r} are invalid: {describe_validation_error(exc)}"
                self._reject(peer, action.id, "bad_payload", why, out)
                continue
            except ValueError as exc:  # the sandbox settings refuse its image: this action alone fails
                self._reject(peer, action.id, "bad_payload", str(exc), out)
                continue
            if lost is not None:
                failure = Result.failure(action.id, "sandbox_died", _lost_message(action.affinity, lost[1]))
                self._fail_at_admission(Entry(action, spec, args, peer, now), failure, now, out)
                continue
            if restarted and holder is None and action.affinity:
                failure = Result.failure(action.id, "sandbox_died", _gone_on_restart(action.affinity))
                self._fail_at_admission(Entry(action, spec, args, peer, now), failure, now, out)
                continue
            if holder is None and action.affinity and self._at_session_limit(peer):
                why = (
                    f"this client holds {self.limits.max_sessions_per_client} live sandbox sessions, the "
                    "server's max_sessions_per_client: close the envs or sessions it is done with "
                    "(env.close(), client.close_sessions) or raise the limit"
                )
                self._reject(peer, action.id, "session_limit", why, out)
                continue
            self._admit(Entry(action, spec, args, peer, now), now, out)
        if restarted:  # tell the client at once: it fails its sessions' next actions itself
            out.append(Send(peer, Heartbeat(server_id=self.server_id)))
        if busy:
            self.metrics.errors["busy"] += len(busy)
            limit = self.limits.max_queued_per_client
            out.append(
                Send(
                    peer,
                    Error(
                        code="busy",
                        action_ids=busy,
                        message=f"more than {limit} actions outstanding, or more than "
                        f"{self.limits.max_unacked_per_client} results unacknowledged; resubmit later",
                    ),
                )
            )

    def _on_ack(self, peer: bytes, msg: Ack, now: float, out: list[Effect]) -> None:
        self._forget_acked(peer, msg.action_ids, now, out)

    def _on_cancel(self, peer: bytes, msg: Cancel, now: float, out: list[Effect]) -> None:
        stop: dict[str, list[str]] = collections.defaultdict(list)
        for action_id in msg.action_ids:
            entry = self.entries.get(action_id)
            if entry is None or entry.owner != peer:
                continue  # not yours, or unknown
            if entry.stage is Stage.QUEUED:
                failure = Result.failure(action_id, "cancelled", "cancelled before it started")
                self._withdraw(entry, failure, now, out, "cancelled")
            elif entry.stage is Stage.RUNNING and entry.worker not in (None, INLINE) and not entry.stopping:
                # Its owner's choice, not the scheduler's (which never stops one to make room): what
                # it holds would otherwise work for nobody until its time limit. Its worker says how
                # it ended (cancelled, or done first).
                entry.stopping = True
                stop[entry.worker].append(action_id)
        for worker_id, ids in stop.items():
            worker = self.workers.get(worker_id)
            if worker is None:
                continue
            if worker.identity is None:
                out.append(Stop(worker_id, tuple(ids)))
            else:
                out.append(Send(worker.identity, Cancel(action_ids=ids)))

    def _on_close_sessions(self, peer: bytes, msg: CloseSessions, now: float, out: list[Effect]) -> None:
        family = client_family(peer)
        for session in msg.session_ids:
            if self._lost_sessions.get(session, (None,))[0] == family:
                del self._lost_sessions[session]  # the client knows: the id may start afresh
        owned = self._sessions.get(peer, set())
        mine = [s for s in msg.session_ids if s in owned]  # nobody ends another client's sessions
        owned.difference_update(mine)
        if not owned:  # one empty set per client that ever opened a session would add up
            self._sessions.pop(peer, None)
        self._end_when_idle(mine, out)
        # issue 17: a trajectory with no sandbox session says it ended (trajectory-bound frees its slot)
        self._events.extend(TrajectoryClosed(t) for t in msg.trajectory_ids)

    def _on_heartbeat(self, peer: bytes, msg: Heartbeat, now: float, out: list[Effect]) -> None:
        worker = self._worker_by_identity(peer)
        if worker is None and peer in self._dropped:
            # A worker taken out that lives on: heard as usual, it would idle for good, never joining
            # again. ``not_registered`` makes it register again (``conflict``: another took its name).
            out.append(Send(peer, self._dropped[peer]))
            return
        if worker is not None:
            worker.last_seen = now
            if msg.figures is not None:
                worker.figures = _bounded_figures(worker.worker_id, msg.figures)
        # A client's count comes back with the shell's own (it counts what the socket carried).
        out.append(Send(peer, Heartbeat(server_id=self.server_id, sent=msg.sent)))

    def _on_register(self, peer: bytes, msg: Register, now: float, out: list[Effect]) -> None:
        if self.worker_token is not None and not hmac.compare_digest(
            msg.token.encode(), self.worker_token.encode()
        ):
            log.warning("refused a worker registration (%r) without the worker token", msg.worker_id[:64])
            message = (
                "this orchestrator admits only workers that give its worker token: set TANGRAM_WORKER_TOKEN "
                "for the worker to the server's TANGRAM_SERVER_WORKER_TOKEN"
            )
            out.append(Send(peer, Error(code="unauthorized", message=message)))
            return
        old = self.workers.get(msg.worker_id)
        if msg.worker_id == INLINE or (old is not None and old.identity is None):
            # The name of the loop itself or of an in-process runner: taking it would hand that
            # runner's running actions to whoever asked.
            message = f"worker id {msg.worker_id!r} is the orchestrator's own; register under another name"
            out.append(Send(peer, Error(code="conflict", message=message)))
            return
        if old is not None:
            self._remove_worker(old, "re-registered", now, out)
            if old.identity != peer:  # another process under its name: it must not take the name back
                message = (
                    f"another worker registered under your name {msg.worker_id!r} and took your place; "
                    "give each worker its own --worker-id"
                )
                self._remember_dropped(old.identity, Error(code="conflict", message=message))
        self._dropped.pop(peer, None)
        kinds = frozenset(msg.kinds) if msg.kinds else None
        self._add_worker(WorkerBook(msg.worker_id, msg.capacity, kinds, identity=peer, last_seen=now))
        log.info(
            "worker %s joined: %s, kinds %s", msg.worker_id, msg.capacity, sorted(kinds) if kinds else "all"
        )
        out.append(Send(peer, Heartbeat(server_id=self.server_id, max_body=self.limits.max_body)))

    def _on_worker_results(self, peer: bytes, msg: Results, now: float, out: list[Effect]) -> None:
        worker = self._worker_by_identity(peer)
        if worker is None:
            # One that another took the name of is told so; registering again would take it back.
            reply = self._dropped.get(peer) or Error(
                code="not_registered", message="register before sending results"
            )
            out.append(Send(peer, reply))
            return
        worker.last_seen = now
        self._finished(worker.worker_id, msg.results, now, out)

    def _on_stats(self, peer: bytes, msg: Stats, now: float, out: list[Effect]) -> None:
        out.append(SendFigures(peer))

    def _on_list_kinds(self, peer: bytes, msg: ListKinds, now: float, out: list[Effect]) -> None:
        out.append(Send(peer, ListKinds(kinds={s.name: s.describe() for s in self.registry})))

    def _on_peer_error(self, peer: bytes, msg: Error, now: float, out: list[Effect]) -> None:
        log.warning("peer %s reported an error: %s: %s", peer.hex(), msg.code, msg.message)

    # --- an action's life ----------------------------------------------------------------------------
    def _stimulate(self, cause: str) -> None:
        self._stimuli += 1
        self._stimulus = f"{cause}-{self._stimuli}"

    def _move(self, entry: Entry, new: Stage, now: float, detail: str) -> None:
        old = entry.stage
        if (old, new) not in TRANSITIONS:
            raise IllegalTransition(
                f"action {entry.action.id}: {old.value} -> {new.value} is not a legal move"
            )
        self._log.append((entry.action.id, old, new, detail, self._stimulus, now))
        entry.stage = new
        if new is Stage.DONE:
            self._unacked[entry.owner] += 1
            self._done_order.append((now, entry.action.id))  # in the order results expire
        elif old is Stage.DONE:
            self._unacked[entry.owner] -= 1
            if not self._unacked[entry.owner]:
                del self._unacked[entry.owner]
        session = entry.action.affinity
        if session is not None and Stage.RUNNING in (old, new) and old is not new:
            if new is Stage.RUNNING:
                self._session_running.setdefault(session, set()).add(entry.action.id)
            else:
                running = self._session_running[session]
                running.discard(entry.action.id)
                if not running:
                    del self._session_running[session]

    def _fail_at_admission(self, entry: Entry, result: Result, now: float, out: list[Effect]) -> None:
        """An action that can never run (its session's sandbox is gone): its result at once."""
        self.entries[entry.action.id] = entry
        self._outstanding[entry.owner] += 1
        if self.persistent:
            out.append(Persist("added", (entry.action, entry.owner)))
        self._complete(entry, result, now, out, "refused: its session lost its sandbox")

    def _admit(self, entry: Entry, now: float, out: list[Effect]) -> None:
        """Take a validated, resolved action in: run it inline, or queue it for the scheduler."""
        action = entry.action
        self.entries[action.id] = entry
        self._outstanding[entry.owner] += 1
        if action.affinity:
            self._session_seen[action.affinity] = now
            self._sessions[entry.owner].add(action.affinity)
            if action.affinity not in self._session_family:
                family = self._session_family[action.affinity] = client_family(entry.owner)
                self._family_sessions[family] += 1
            if action.trajectory_id:
                self._session_trajectory[action.affinity] = action.trajectory_id
        if entry.spec.placement == "inline":
            self._move(entry, Stage.RUNNING, now, "runs inline")
            entry.worker = INLINE
            assert action.timeout_s is not None
            if self.persistent:  # durable before it runs, as a granted action is: never run twice
                out.append(Persist("added", (action, entry.owner)))
                out.append(Persist("started", (action.id,)))
            out.append(RunInline(entry.spec, action, entry.args, action.timeout_s))
            return
        self._move(entry, Stage.QUEUED, now, "admitted")
        if action.deadline_s is not None:
            entry.deadline = entry.submitted + action.deadline_s
            heapq.heappush(self._deadlines, (entry.deadline, action.id))
        if self.persistent:
            out.append(Persist("added", (action, entry.owner)))
        self._events.append(self._arrival(entry))

    def _arrival(self, entry: Entry) -> ActionArrived:
        action, spec = entry.action, entry.spec
        held = 0.0
        if self.sandbox_mem_mb is not None and spec.placement == "sandbox" and action.affinity is not None:
            assert action.image is not None, "resolve() gives every sandbox action an image"
            held = self.sandbox_mem_mb(action.image)
        provider = self.sandbox_provider if spec.placement == "sandbox" else None
        return arrival(action, spec.api, held, provider)

    def _start(self, decision: Start, now: float, out: list[Effect]) -> None:
        entry = self.entries.get(decision.action_id)
        if entry is None or entry.stage is not Stage.QUEUED:
            raise IllegalTransition(f"the scheduler started {decision.action_id}, which is not queued")
        worker = self.workers[decision.worker_id]  # departed workers were removed from it first
        left = entry.deadline - now
        if left <= 0:  # requeued in this very turn past its deadline: ends as soon as it started
            self._move(entry, Stage.RUNNING, now, f"started on {worker.worker_id} past its deadline")
            entry.worker = worker.worker_id
            self._complete(entry, self._deadline_result(entry), now, out, "deadline passed")
            return
        assert entry.action.timeout_s is not None
        try:
            grant = Grant(
                action=entry.action,
                parallelism=decision.parallelism,
                timeout_s=min(entry.action.timeout_s, left),
                queued_s=now - entry.submitted,
                api_key=decision.api_key,
            )
        except ValueError as exc:  # a kind's limit no grant takes (NaN, inf): this action fails, not the loop
            self._move(entry, Stage.RUNNING, now, f"not started on {worker.worker_id}: no valid grant")
            entry.worker = worker.worker_id
            why = describe_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
            failure = Result.failure(
                entry.action.id,
                "rejected",
                f"{entry.action.kind!r} cannot be started: its grant is invalid ({why}); fix the timeout_s "
                "its tool or reward model registers (a finite number of seconds > 0)",
            )
            self._complete(entry, failure, now, out, "its grant is invalid")
            return
        self._move(entry, Stage.RUNNING, now, f"started on {worker.worker_id} x{decision.parallelism}")
        entry.worker, entry.parallelism = worker.worker_id, decision.parallelism
        entry.api_key = decision.api_key
        worker.running.add(decision.action_id)
        if entry.action.affinity is not None and entry.spec.placement == "sandbox":
            self._session_worker[entry.action.affinity] = worker.worker_id
        if self.persistent:  # durable before it starts: a crash now must not rerun it
            out.append(Persist("started", (decision.action_id,)))
        entry.ends_by = now + grant.timeout_s
        if worker.identity is None:
            out.append(Run(worker.worker_id, grant.carrying(entry.args)))
        else:
            out.append(Send(worker.identity, Dispatch(grants=[grant])))

    def _requeue(self, action_id: str, now: float, out: list[Effect]) -> None:
        """The scheduler put an action back in its queue: its worker was lost, or its API said 429."""
        entry = self.entries.get(action_id)
        if entry is None or entry.stage is not Stage.RUNNING:
            return  # given up on in _remove_worker (too many attempts), and cancelled with it
        why = "its API was throttled" if entry.api_key is not None else "its worker was lost"
        entry.api_key = None
        self._move(entry, Stage.QUEUED, now, f"requeued: {why}")
        if self.persistent:
            out.append(Persist("requeued", (action_id,)))

    def _complete(self, entry: Entry, result: Result, now: float, out: list[Effect], detail: str) -> None:
        """Give ``entry`` its one result; the scheduler hears of it if it was running on a worker.

        A 429 from a quota'd API is no result: the scheduler pauses the key and answers ``Requeue``
        (same id; the client never sees it). Nor is a sandbox provider at capacity: the action waits
        out a back-off and queues again (:meth:`_back_off`).
        """
        # A sandbox provider at capacity says nothing against the action's API key, if it holds one.
        if entry.stage is Stage.RUNNING and is_busy(result):
            if self._back_off(entry, result, now, out):
                return
            result = Result.failure(
                entry.action.id,
                "sandbox_died",
                f"no sandbox: its provider stayed at capacity through {self.busy.tries} tries "
                f"(last: {result.message}); raise sandbox_busy_tries or the provider's capacity",
            )
        if result.error_type == "timeout" and entry.ends_by >= entry.deadline:  # the deadline cut it short
            result = self._deadline_result(entry, timing=result.timing, worker=result.worker)
        throttle = throttle_of(result, entry.api_key) if entry.stage is Stage.RUNNING else None
        if throttle is not None:
            self._events.append(throttle)  # the key pauses, whatever becomes of the action
            entry.throttles += 1
            if entry.throttles <= self.limits.max_throttles:
                return
            # A key spent for the day, or a quota set over the provider's, would requeue it forever.
            self._move(entry, Stage.QUEUED, now, "requeued: its API was throttled")
            entry.api_key = None
            message = (
                f"its API answered 429 {entry.throttles} times (last: {result.message}); not retried again: "
                "set the API's quota (--quota) under the provider's limit, or check the key's own allowance"
            )
            self._withdraw(entry, Result.failure(entry.action.id, "throttled", message), now, out, "given up")
            return
        if entry.stage is Stage.RUNNING and entry.worker != INLINE:
            timing = result.timing
            self._events.append(
                ActionFinished(entry.action.id, timing.run_s, ok=result.ok, setup_s=timing.setup_s)
            )
        self._move(entry, Stage.DONE, now, detail)
        if entry.retry_at is not None or self.busy.refusals(entry.action.id):
            entry.retry_at = None
            self.busy.done(entry.action.id)
        # The orchestrator's own clock decides queueing time: arrival to start, whoever ran it.
        timing = result.timing
        timing.queued_s = max(0.0, (now - entry.submitted) - timing.setup_s - timing.run_s)
        entry.result, entry.done_at = result, now
        if entry.action.affinity in self._session_seen:
            self._session_seen[entry.action.affinity] = now
        self._outstanding[entry.owner] -= 1
        if not self._outstanding[entry.owner]:  # one key per client ever connected would grow forever
            del self._outstanding[entry.owner]
        kind = entry.action.kind
        self.metrics.record_result(kind, result.ok, result.error_type, timing.act_s, timing.queued_s)
        if self.observed:
            out.append(Observe(kind, result))
        if self.persistent:
            out.append(Persist("finished", (result,)))
        self._outgoing.setdefault(entry.owner, []).append(result)

    def _back_off(self, entry: Entry, result: Result, now: float, out: list[Effect]) -> bool:
        """The provider had no sandbox for ``entry`` yet (backpressure): free its grant, keep it queued
        out of the scheduler until its back-off ends (:meth:`_end_back_offs`). False: given up.
        """
        retry_at = self.busy.refused(entry.action.id, result, now)
        if retry_at is None:
            return False
        # It never started its work: the scheduler frees what it held, and hears of it again later.
        self._events.append(ActionFinished(entry.action.id, 0.0, ok=False))
        entry.worker, entry.retry_at, entry.api_key = None, retry_at, None
        self._move(entry, Stage.QUEUED, now, f"provider busy: retried in {retry_at - now:.2f}s")
        if self.persistent:
            out.append(Persist("requeued", (entry.action.id,)))
        return True

    def _end_back_offs(self, now: float) -> None:
        for action_id in self.busy.due(now):
            entry = self.entries.get(action_id)
            if entry is None or entry.stage is not Stage.QUEUED or entry.retry_at is None:
                continue  # cancelled, expired or given up meanwhile
            entry.retry_at = None
            self._events.append(self._arrival(entry))

    def _withdraw(self, entry: Entry, result: Result, now: float, out: list[Effect], detail: str) -> None:
        """A queued action leaves before it started: the scheduler drops it, the client gets why."""
        if entry.retry_at is None:  # one waiting out a back-off is not in the scheduler's books
            self._events.append(ActionCancelled(entry.action.id))
        self._complete(entry, result, now, out, detail)

    def _expire_deadlines(self, now: float, out: list[Effect]) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, action_id = heapq.heappop(self._deadlines)
            entry = self.entries.get(action_id)
            if entry is not None and entry.stage is Stage.QUEUED:
                self._withdraw(entry, self._deadline_result(entry), now, out, "deadline passed")

    @staticmethod
    def _deadline_result(entry: Entry, **fields: Any) -> Result:
        return Result.failure(
            entry.action.id,
            "deadline",
            f"its deadline of {entry.action.deadline_s:g}s passed before it could finish",
            **fields,
        )

    def _forget_acked(self, peer: bytes, action_ids: list[str], now: float, out: list[Effect]) -> None:
        """The client has these results: drop them, remembering only that the ids ran."""
        for action_id in action_ids:
            entry = self.entries.get(action_id)
            if entry is not None and entry.owner == peer and entry.stage is Stage.DONE:
                self._forget(entry, now, "acknowledged")
                if self.persistent:
                    out.append(Persist("acknowledged", (action_id,)))

    def _forget(self, entry: Entry, now: float, detail: str) -> None:
        self._move(entry, Stage.FORGOTTEN, now, detail)
        action_id = entry.action.id
        del self.entries[action_id]
        self.acked[action_id] = entry.owner
        if len(self.acked) > ACKED_IDS_KEPT:
            self.acked.popitem(last=False)

    def _at_session_limit(self, peer: bytes) -> bool:
        """Whether ``peer``'s client family holds as many live sessions as one client may."""
        limit = self.limits.max_sessions_per_client
        return limit is not None and self._family_sessions[client_family(peer)] >= limit

    def _reject(self, peer: bytes, action_id: str, code: str, message: str, out: list[Effect]) -> None:
        self.metrics.errors["rejected"] += 1
        out.append(Send(peer, Error(code=code, message=message, action_ids=[action_id])))

    # --- workers, clients, sessions ------------------------------------------------------------------
    def _worker_by_identity(self, identity: bytes) -> WorkerBook | None:
        for worker in self.workers.values():
            if worker.identity == identity:
                return worker
        return None

    def _add_worker(self, worker: WorkerBook) -> None:
        self.workers[worker.worker_id] = worker
        self._events.append(WorkerAdded(worker.worker_id, worker.capacity, worker.kinds))

    def remove_worker(self, worker_id: str, why: str, now: float) -> list[Effect]:
        """Take a remote worker out now, as if it had gone silent (a cluster manager saw its host go)."""
        worker = self.workers.get(worker_id)
        out: list[Effect] = []
        if worker is not None and worker.identity is not None:  # the local runner is never removed
            self._stimulate(f"remove-{worker_id}")
            self._remove_worker(worker, why, now, out)
        return out

    def _remember_dropped(self, identity: bytes | None, reply: Error) -> None:
        if identity is None:
            return
        self._dropped[identity] = reply
        self._dropped.move_to_end(identity)
        while len(self._dropped) > DROPPED_WORKERS_KEPT:
            self._dropped.popitem(last=False)

    def queued_demands(self) -> list[Resources]:
        """What each queued action waits for: its demand times its least parallelism."""
        starved = quota_starved(self.scheduler)  # more capacity would not start these sooner
        return [
            entry.action.demand.scaled(entry.action.elastic.min_par)
            for entry in self.entries.values()
            if entry.stage is Stage.QUEUED
            and entry.retry_at is None  # one waiting out a provider's back-off needs no capacity yet
            and entry.action.id not in starved
            and entry.action.demand is not None
            and entry.action.elastic
        ]

    def _remove_worker(self, worker: WorkerBook, why: str, now: float, out: list[Effect]) -> None:
        """The scheduler requeues what ran there (``Requeue``); actions lost too often are given up."""
        log.warning(
            "worker %s left (%s); %d running actions go back to the queue",
            worker.worker_id,
            why,
            len(worker.running),
        )
        del self.workers[worker.worker_id]
        self._events.append(WorkerRemoved(worker.worker_id))
        message = f"this orchestrator took worker {worker.worker_id!r} out ({why}): register again"
        self._remember_dropped(worker.identity, Error(code="not_registered", message=message))
        # Its sandboxes went with it: the sessions living there fail, never go on in an empty sandbox.
        lost = {s for s, w in self._session_worker.items() if w == worker.worker_id}
        why = f"its worker {worker.worker_id} was lost: {why}"
        for action_id in worker.running:
            entry = self.entries[action_id]
            entry.worker = None  # lost: no late result counts, whoever registers under its name next
            if entry.stopping:  # its owner cancelled it while it ran: it ends here, never runs again
                self._move(entry, Stage.QUEUED, now, why)
                failure = Result.failure(action_id, "cancelled", f"cancelled after it started ({why})")
                self._withdraw(entry, failure, now, out, "cancelled")
                continue
            if entry.action.affinity in lost:
                self._move(entry, Stage.QUEUED, now, why)  # failed below, in the removal's batch
                continue
            entry.attempts += 1
            if entry.attempts > self.limits.max_retries:
                # Withdrawn in the same batch as the removal, so the scheduler never starts it again.
                self._move(entry, Stage.QUEUED, now, f"its worker {worker.worker_id} was lost")
                message = (
                    f"its worker was lost {entry.attempts} times (last: {worker.worker_id}, {why}); "
                    "not retried again"
                )
                self._withdraw(entry, Result.failure(action_id, "error", message), now, out, "given up")
        worker.running.clear()
        stranded = [e for e in self.entries.values() if e.stage is Stage.QUEUED and e.action.affinity in lost]
        for entry in stranded:
            message = _lost_message(entry.action.affinity, why)
            failure = Result.failure(entry.action.id, "sandbox_died", message)
            self._withdraw(entry, failure, now, out, "its sandbox was lost")
        if lost:
            self._lose_sessions(sorted(lost), why, out)

    def _drop_silent_clients(self, now: float, out: list[Effect]) -> None:
        """A client that went silent with work outstanding crashed: cancel its queue, free its sandboxes."""
        limit = self.limits.client_timeout_s
        silent = [c for c, seen in self._clients_seen.items() if now - seen > limit]
        for peer in silent:
            del self._clients_seen[peer]
            if self._outstanding[peer] <= 0 and not self._sessions.get(peer):
                self._sessions.pop(peer, None)
                continue
            log.warning("client %s silent for %.0fs: cancelling its queued actions", peer.hex()[:12], limit)
            for entry in [e for e in self.entries.values() if e.owner == peer and e.stage is Stage.QUEUED]:
                failure = Result.failure(entry.action.id, "cancelled", "its client went away")
                self._withdraw(entry, failure, now, out, "its client went away")
            sessions = self._sessions.pop(peer, set())
            family = client_family(peer)
            heir = next((p for p in self._clients_seen if client_family(p) == family), None)
            if heir is not None:  # an AsyncClient whose loop stopped, its sync client alive: they live on
                self._sessions[heir].update(sessions)
            else:
                # Lost, not ended: a client that was only paused must learn its sandboxes are gone, not
                # go on in fresh ones. A session whose action is still running (maybe still getting its
                # sandbox) ends when that action does, as a closed one does: ended now, the sandbox its
                # set-up then finds would be lent to a session nobody ends.
                why = f"its client was silent for {limit:g}s (the server's client_timeout_s)"
                self._lose_sessions(sorted(sessions), why, out, after_running=True)

    def _end_idle_sessions(self, now: float, out: list[Effect]) -> None:
        """End the sessions that had nothing queued or running for ``session_idle_s``: a client that
        lives on but forgot an env would hold their sandboxes' memory for good, and every client's new
        sessions would wait for it.
        """
        idle_s = self.limits.session_idle_s
        if idle_s is None or now < self._idle_check_at:
            return
        self._idle_check_at = now + min(60.0, idle_s / 4)
        idle = {s for s, seen in self._session_seen.items() if now - seen > idle_s}
        if not idle:
            return
        for entry in self.entries.values():  # a run longer than idle_s keeps its session alive
            if entry.action.affinity in idle and entry.stage in (Stage.QUEUED, Stage.RUNNING):
                idle.discard(entry.action.affinity)
                self._session_seen[entry.action.affinity] = now
        if not idle:
            return
        why = f"ended after {idle_s:g}s with no action (the server's session_idle_s)"
        log.warning("%d sandbox sessions %s: %s", len(idle), why, ", ".join(sorted(idle)[:5]))
        self._lose_sessions(sorted(idle), why, out)

    def _lose_sessions(
        self, sessions: list[str], why: str, out: list[Effect], *, after_running: bool = False
    ) -> None:
        """End ``sessions`` though their clients did not. Their files and processes are gone, so their
        next actions fail as sandbox_died, naming ``why``, until their clients end them, instead of
        running in a fresh sandbox as if nothing had happened (a trajectory graded on a state its
        agent never made).
        """
        for session in sessions:
            family = self._session_family.get(session)
            if family is not None:
                self._lost_sessions[session] = (family, why)
        while len(self._lost_sessions) > LOST_SESSIONS_KEPT:
            self._lost_sessions.popitem(last=False)
        for peer, owned in list(self._sessions.items()):
            owned.difference_update(sessions)
            if not owned:
                del self._sessions[peer]
        if after_running:
            self._end_when_idle(sessions, out)
        else:
            self._closing.difference_update(sessions)
            self._end_sessions(sessions, out)

    def _end_when_idle(self, sessions: list[str], out: list[Effect]) -> None:
        """End ``sessions`` now, but one with an action running when that action ends (``flush``): its
        sandbox may still be in set-up, and one ended meanwhile would be lent to nobody's session.
        """
        self._closing.update(s for s in sessions if s in self._session_running)
        self._end_sessions([s for s in sessions if s not in self._closing], out)

    def _end_sessions(self, sessions: Iterable[str], out: list[Effect]) -> None:
        """The scheduler frees the sessions' caps and their trajectories' slots; whoever holds their
        sandboxes resets them: this process's pool, or a remote worker's (told over the wire).
        """
        here: list[str] = []
        remote: dict[bytes, list[str]] = collections.defaultdict(list)
        for session in sessions:
            self._events.append(SessionClosed(session))
            family = self._session_family.pop(session, None)
            if family is not None:
                self._family_sessions[family] -= 1
                if not self._family_sessions[family]:
                    del self._family_sessions[family]
            self._session_seen.pop(session, None)
            trajectory = self._session_trajectory.pop(session, None)
            if trajectory is not None:
                self._events.append(TrajectoryClosed(trajectory))
            worker = self.workers.get(self._session_worker.pop(session, ""))
            if worker is not None and worker.identity is not None:
                remote[worker.identity].append(session)
            else:
                here.append(session)
        if here:
            out.append(EndSessions(tuple(here)))
        for identity, ids in remote.items():
            out.extend(Send(identity, CloseSessions(session_ids=batch)) for batch in id_batches(ids))

    # --- introspection -------------------------------------------------------------------------------
    def story(self, action_id: str) -> list[tuple[float, str, str, str, str]]:
        """What happened to ``action_id``, oldest first: ``(now, from, to, why, stimulus id)`` (bounded)."""
        return [(t, a.value, b.value, why, cause) for i, a, b, why, cause, t in self._log if i == action_id]

    def figures(self) -> dict[str, Any]:
        """Counters, the queue, and each worker's capacity and use (runners' own figures: the shell)."""
        figures = self.metrics.snapshot()
        figures.update(
            server_id=self.server_id,
            scheduler=self.scheduler.name,
            pending=self.scheduler.pending(),
            running=self.scheduler.running(),
            entries=len(self.entries),
            api_quotas=quota_figures(self.scheduler),
            sandbox_busy=self.busy.figures(sum(1 for e in self.entries.values() if e.retry_at is not None)),
            sandbox_memory=self._sandbox_memory_figures(),
            sandbox_images=caps.snapshot() if (caps := getattr(self.scheduler, "caps", None)) else {},
            unserved=self._unserved_kinds(),
            workers={w.worker_id: self._worker_figures(w) for w in self.workers.values()},
        )
        return figures

    def _unserved_kinds(self) -> dict[str, int]:
        """Queued actions per kind that no live worker serves (they wait for one to join)."""
        if any(w.kinds is None for w in self.workers.values()):
            return {}
        served = set().union(*(w.kinds or () for w in self.workers.values()))
        return dict(
            collections.Counter(
                e.action.kind
                for e in self.entries.values()
                if e.stage is Stage.QUEUED and e.action.kind not in served
            )
        )

    def _warn_if_kinds_unserved(self, now: float) -> None:
        """Actions whose kinds no live worker serves wait until one joins or their deadlines pass;
        with their worker gone for good, nothing else would say why. Say so, once a while.
        """
        if now < self._unserved_check_at:
            return
        self._unserved_check_at = now + UNSERVED_WARN_S
        for kind, waiting in sorted(self._unserved_kinds().items()):
            log.warning(
                "%d actions of %r wait: no live worker serves that kind (start one that registers it, "
                "or give the actions a deadline_s)",
                waiting,
                kind,
            )

    def _warn_if_sessions_starve(self, now: float) -> None:
        """Nothing runs, yet new sessions wait: idle sandboxes hold the memory, and their clients may
        wait for the new ones before closing any (a batch stepped in lockstep). Say so, once a while.
        """
        if self.sandbox_mem_mb is None or self.scheduler.running() or not self.scheduler.pending():
            self._starving_since = None
            return
        if self._starving_since is None:
            self._starving_since = now
        elif now - self._starving_since >= STARVING_WARN_S:
            figures = self._sandbox_memory_figures()
            if figures["new_sessions_waiting"]:
                log.warning(
                    "%s, and nothing has run for %.0fs: if clients close no session until these start "
                    "(a batch stepped in lockstep), lower reserve_mb, the batch, or add runners",
                    figures["why"],
                    now - self._starving_since,
                )
            self._starving_since = now

    def _sandbox_memory_figures(self) -> dict[str, Any]:
        """Live sessions, the memory the ledger lends now, and the new sessions that wait (with why)."""
        waiting = sum(
            1
            for e in self.entries.values()
            if e.stage is Stage.QUEUED
            and e.retry_at is None
            and e.spec.placement == "sandbox"
            and e.action.affinity is not None
            and e.action.affinity not in self._session_worker
        )
        held = getattr(self.scheduler, "held", None)
        lent_mb = held().mem_mb if held is not None else 0.0
        capacity_mb = sum(w.capacity.mem_mb for w in self.workers.values())
        figures: dict[str, Any] = {
            "live_sessions": len(self._session_worker),
            "new_sessions_waiting": waiting,
            "lent_mb": lent_mb,
            "capacity_mb": capacity_mb,
        }
        if waiting and self.sandbox_mem_mb is not None:
            figures["why"] = (
                f"{waiting} new sandbox sessions wait for cores or memory: {lent_mb:.0f} of "
                f"{capacity_mb:.0f} MiB lent (live sandboxes hold theirs until their sessions close)"
            )
        return figures

    def _worker_figures(self, worker: WorkerBook) -> dict[str, Any]:
        used = Resources()
        for action_id in worker.running:
            entry = self.entries.get(action_id)
            if entry is not None and entry.action.demand is not None:
                used = used + entry.action.demand.scaled(entry.parallelism)
        return {
            "capacity": worker.capacity.as_dict(),
            "used": used.as_dict(),
            "running": len(worker.running),
            "kinds": sorted(worker.kinds) if worker.kinds else None,
            "figures": worker.figures,
        }

    def validate_state(self) -> None:
        """Assert every invariant of the books (the tests call it after each stimulus)."""
        outstanding: collections.Counter[bytes] = collections.Counter()
        running: dict[str, set[str]] = collections.defaultdict(set)
        for action_id, entry in self.entries.items():
            assert entry.action.id == action_id, f"{action_id} filed under another id"
            assert entry.stage in (Stage.QUEUED, Stage.RUNNING, Stage.DONE), f"{action_id} is {entry.stage}"
            assert action_id not in self.acked, f"{action_id} is both held and forgotten"
            assert entry.action.demand is not None and entry.action.timeout_s is not None, (
                f"{action_id} was not resolved"
            )
            if entry.stage is Stage.DONE:
                assert entry.result is not None and entry.result.action_id == action_id, (
                    f"{action_id} lacks its result"
                )
                continue
            assert entry.result is None, f"{action_id} has a result but is {entry.stage.value}"
            assert entry.retry_at is None or entry.stage is Stage.QUEUED, f"{action_id} backs off, not queued"
            outstanding[entry.owner] += 1
            if entry.stage is Stage.RUNNING and entry.worker != INLINE:
                if entry.worker is None:  # its worker was lost: the scheduler has yet to requeue it
                    assert self._events, f"{action_id} lost its worker, and the scheduler was not told"
                else:
                    assert entry.worker in self.workers, f"{action_id} runs on unknown {entry.worker}"
                    running[entry.worker].add(action_id)
        for peer, count in self._outstanding.items():
            assert count == outstanding.get(peer, 0), (
                f"client {peer.hex()} counts {count}, has {outstanding.get(peer, 0)}"
            )
        for worker_id, worker in self.workers.items():
            assert worker.running == running.get(worker_id, set()), f"{worker_id}'s running set is stale"
        by_session: dict[str, set[str]] = collections.defaultdict(set)
        for action_id, entry in self.entries.items():
            if entry.stage is Stage.RUNNING and entry.action.affinity is not None:
                by_session[entry.action.affinity].add(action_id)
        assert self._session_running == by_session, "the running actions per session are stale"
        held = collections.Counter(e.owner for e in self.entries.values() if e.stage is Stage.DONE)
        assert self._unacked == held, f"unacknowledged results per client {self._unacked}, held {held}"
        assert all(s in self._session_family for s in self._closing), "a closing session was ended"
        families = collections.Counter(self._session_family.values())
        assert self._family_sessions == families, f"sessions per client {self._family_sessions}, {families}"
        if not self._events:  # the scheduler has heard everything: its books match ours
            queued = sum(1 for e in self.entries.values() if e.stage is Stage.QUEUED and e.retry_at is None)
            started = sum(len(w.running) for w in self.workers.values())
            assert self.scheduler.pending() == queued, (
                f"scheduler has {self.scheduler.pending()} pending, we {queued}"
            )
            assert self.scheduler.running() == started, (
                f"scheduler runs {self.scheduler.running()}, we {started}"
            )
