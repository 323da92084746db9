"""The GPU runner: hosts reward models on devices, batches their requests, loads, evicts, replicates.

One background thread per device slot, and one per model of the host lane (where models that need
no accelerator run, so that one that hangs holds up no other), does all model work; one more fails
requests at their time limit, whatever the devices are doing. Torch releases the GIL while it
computes, so ``start`` and ``collect`` on the worker's loop never wait for a forward pass. All shared
state sits behind one condition variable; user code (load, score, unload) always runs outside it.

    runner = GpuRunner()                      # every CUDA device, else one "cpu" device
    runner.start(grant)                       # never blocks
    select.select(runner.wait_fds(), [], [])  # readable when a result is ready
    results = runner.collect()
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from tangram_env.errors import UnknownNameError, describe_validation_error
from tangram_env.kinds import KindRegistry, KindSpec, kind_registry
from tangram_env.protocol import Grant, Resources, Result
from tangram_env.server.gpu.batching import Job, Piece, Share, split_job
from tangram_env.server.gpu.devices import DeviceSlot, allocated_mb, host_slot, is_out_of_memory, make_slots
from tangram_env.server.gpu.figures import device_figures, model_figures
from tangram_env.server.gpu.models import (
    ModelEntry,
    Replica,
    RewardModelError,
    check_memory_mb,
    missing_requirements,
)
from tangram_env.server.gpu.policy import Load, LruReplicaPolicy, Retire, RunBatch, Step, Unplaceable, Wait

log = logging.getLogger("tangram_env.server.gpu")

_TRACEBACK_CHARS = 8000
#: A device still in a model's forward pass (or load) this long after the time limit of the last
#: request it serves is stuck: nothing in the process can stop it (a thread cannot be killed, a hung
#: CUDA kernel holds its device), so the worker exits and its supervisor starts it afresh.
STUCK_AFTER_S = 300.0


@dataclass
class _BatchWork:
    model: ModelEntry
    replica: Replica
    pieces: list[Piece]


@dataclass
class _LoadWork:
    model: ModelEntry
    replica: Replica
    evicted: list[tuple[ModelEntry, Replica]] = field(default_factory=list)


@dataclass
class _UnloadWork:
    model: ModelEntry
    replica: Replica


_Work = _BatchWork | _LoadWork | _UnloadWork


@dataclass
class _Outcome:
    """What scoring one piece gave: scores, or an error message (and whether it was out of memory)."""

    scores: list[float] | None = None
    error: str = ""
    traceback: str = ""
    oom: bool = False


class GpuRunner:
    """A :class:`~tangram_env.server.runner.Runner` for reward-model actions.

    ``devices``: torch device names (default: every CUDA device, else ``["cpu"]``; the same name may
    repeat, e.g. ``["cpu", "cpu"]``, to simulate several devices on one host). ``mem_budget_mb``: the
    memory each device lends to models (default: 90% of a CUDA device, a quarter of host memory up to
    8 GiB for CPU). ``policy``: placement (:class:`LruReplicaPolicy` by default, or
    :class:`~tangram_env.server.gpu.policy.StaticPolicy`). ``cpu``/``mem_mb``: the host share announced
    for the actions' own CPU demand (default: one core per device, a quarter of host memory).
    ``stuck_after_s``: how long past its requests' last time limit a device may stay in one model's
    code before :meth:`unrecoverable` says so.
    """

    name = "gpu"

    def __init__(
        self,
        devices: list[str] | None = None,
        mem_budget_mb: int | None = None,
        registry: KindRegistry = kind_registry,
        *,
        policy: LruReplicaPolicy | None = None,
        cpu: float | None = None,
        mem_mb: int | None = None,
        worker_id: str = "gpu",
        stuck_after_s: float = STUCK_AFTER_S,
    ) -> None:
        self._slots = make_slots(devices, mem_budget_mb)
        self._stuck_after_s = stuck_after_s
        self._policy = policy or LruReplicaPolicy()
        self._policy.check(self._slots)
        self._registry = registry
        # One core per device by default: the thread that feeds it. The host's other cores belong to
        # its CPU worker; announcing them here too would count them twice in the pool.
        feeders = sum(1 for slot in self._slots if slot.lane == "device")
        self._cpu = float(cpu) if cpu is not None else float(max(1, feeders))
        self._mem_mb = int(mem_mb) if mem_mb is not None else int(_host_quarter_mb())
        self.worker_id = worker_id
        self._models: dict[str, ModelEntry] = {}
        # Models whose entry could not be built (a memory_mb of "1GB", say): spec -> why. Left out
        # rather than ending the worker, which would take every other model down with them.
        self._broken: dict[str, tuple[KindSpec, str]] = {}
        self._jobs: dict[str, Job] = {}
        self._deadlines: list[tuple[float, int, Job]] = []
        self._seq = 0
        self._results: list[Result] = []
        self._cond = threading.Condition()
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._threads: list[threading.Thread] = []
        self._start_thread(self._watch_deadlines, "deadlines")
        for slot in self._slots:
            self._start_thread(self._loop, slot.label, slot)

    def _start_thread(self, target: Any, label: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=f"tangram-gpu-{label}", daemon=True)
        self._threads.append(thread)
        thread.start()

    # --- Runner protocol --------------------------------------------------------------------------
    def capacity(self) -> Resources:
        """``gpu`` = number of devices (a CPU fallback counts as one), ``gpu_mem_mb`` = their budgets."""
        devices = [s for s in self._slots if s.lane == "device"]
        return Resources(
            cpu=self._cpu,
            mem_mb=self._mem_mb,
            gpu=float(len(devices)),
            gpu_mem_mb=sum(s.budget_mb for s in devices),
        )

    def kinds(self) -> frozenset[str] | None:
        """List the registered reward models whose declared requirements are importable here.

        A model whose settings are unusable stays listed: its requests fail with the reason rather
        than wait for a worker that never comes.
        """
        out = set()
        for spec in self._registry:
            if spec.role == "reward_model" and not missing_requirements(spec):
                with contextlib.suppress(RewardModelError):
                    self._entry(spec)  # logs a broken model once
                out.add(spec.name)
        return frozenset(out)

    def start(self, grant: Grant) -> None:
        """Queue ``grant``'s items for scoring (``grant.parallelism`` replicas may share them)."""
        action = grant.action
        now = time.monotonic()
        try:
            spec = self._registry.get(action.kind)
            if spec.role != "reward_model":
                raise UnknownNameError(f"{action.kind!r} is a tool, not a reward model")
        except UnknownNameError as exc:
            self._emit(Result.failure(action.id, "rejected", str(exc), worker=self.worker_id))
            return
        try:
            args = spec.validate_payload(action.payload)
        except ValidationError as exc:
            message = f"bad payload for {spec.name!r}: {describe_validation_error(exc)}"
            self._emit(Result.failure(action.id, "rejected", message, worker=self.worker_id))
            return
        raw = args.get("items") if isinstance(args, dict) else getattr(args, "items", None)
        if not isinstance(raw, list):
            message = f"bad payload for {spec.name!r}: expected {{'items': [...]}}"
            self._emit(Result.failure(action.id, "rejected", message, worker=self.worker_id))
            return
        items = list(raw)
        missing = missing_requirements(spec)
        if missing:
            hint = " (torch: pip install 'tangram-env[torch]')" if "torch" in missing else ""
            message = (
                f"reward model {spec.name!r} needs {', '.join(missing)}, which this worker cannot import: "
                f"install {' '.join(missing)} in its environment{hint}"
            )
            self._emit(Result.failure(action.id, "model_error", message, worker=self.worker_id))
            return
        try:
            entry = self._entry(spec)
        except RewardModelError as exc:
            self._emit(Result.failure(action.id, "model_error", str(exc), worker=self.worker_id))
            return
        job = Job(
            action.id,
            spec.name,
            len(items),
            max(1, grant.parallelism),
            now,
            now + grant.timeout_s,
            queued_s=grant.queued_s,
        )
        with self._cond:
            if self._closed:
                job.finish_error("cancelled", "the GPU runner is closed", now, self.worker_id)
            elif action.id in self._jobs:
                log.warning("action %s is already running here; ignoring the duplicate", action.id)
                return
            elif not items:
                job.finish_ok(self.worker_id)
            else:
                self._jobs[action.id] = job
                heapq.heappush(self._deadlines, (job.deadline, self._seq, job))
                self._seq += 1
                entry.queue.push(split_job(job, items, now))
                entry.observe_arrival(len(items), now)
                self._cond.notify_all()
                return
        assert job.result is not None
        self._emit(job.result)

    def wait_fds(self) -> list[int]:
        """Return a pipe that turns readable when results are ready."""
        return [self._wake_r]

    def collect(self) -> list[Result]:
        """Results finished since the last call, in completion order (never blocks)."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        with self._cond:
            out, self._results = self._results, []
        return out

    def cancel(self, action_ids: list[str]) -> None:
        """A scoring request ends with its batch, on a device that cannot be interrupted: it runs on."""

    def end_sessions(self, sessions: list[str]) -> None:
        """Reward models hold no sandbox sessions."""

    def maintain(self) -> None:
        """Models are loaded and evicted as requests come: nothing to keep up."""

    def stats(self) -> dict[str, object]:
        """Per model: where it is loaded, replicas, queue, loads, evictions, load time; per device: memory."""
        for spec in self._registry:
            if spec.role == "reward_model":
                with contextlib.suppress(RewardModelError):  # a broken model is logged, not shown
                    self._entry(spec)
        with self._cond:
            now = time.monotonic()
            labels = {s.index: s.label for s in self._slots}
            models = {name: model_figures(m, labels) for name, m in self._models.items()}
            devices = [device_figures(s, self._models, now) for s in self._slots]
            return {
                "policy": self._policy.name,
                "actions": len(self._jobs),
                "devices": devices,
                "models": models,
            }

    def loaded_models(self) -> frozenset[str]:
        """Models with at least one replica loaded (the warm state a scheduler may prefer)."""
        with self._cond:
            return frozenset(n for n, m in self._models.items() if m.ready_replicas())

    def unrecoverable(self) -> str | None:
        """Why this runner can serve nothing more until its process starts afresh: a device (or a
        host-lane model's thread) still in a model's code ``stuck_after_s`` past the time limit of
        the last request it serves. None while every device is well.
        """
        with self._cond:
            return self._stuck(time.monotonic())

    def _stuck(self, now: float) -> str | None:
        for slot in self._slots:
            past = slot.past_limit_s(now)
            if past is not None and past > self._stuck_after_s:
                return (
                    f"{slot.label} is stuck in reward model {slot.work_of!r}: its {slot.work_what} has run "
                    f"{now - slot.work_since:.0f}s, {past:.0f}s past the time limit of the last request it "
                    "serves"
                )
        return None

    def close(self) -> None:
        """Stop the device threads, fail what is still queued, unload every model."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            now = time.monotonic()
            stuck = self._stuck(now) is not None
            for job in list(self._jobs.values()):
                self._finish(job.finish_error("cancelled", "the GPU runner closed", now, self.worker_id))
            self._cond.notify_all()
        give_up_at = time.monotonic() + (1.0 if stuck else 30.0)  # a stuck thread never returns
        for thread in self._threads:
            thread.join(timeout=max(0.0, give_up_at - time.monotonic()))
        for model in self._models.values():
            for slot_index, replica in list(model.replicas.items()):
                if replica.ready and not replica.busy:
                    self._unload(model, replica, self._slots[slot_index])
                    del model.replicas[slot_index]
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> GpuRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- state helpers (called with the lock held unless noted) -----------------------------------
    def _entry(self, spec: KindSpec) -> ModelEntry:
        """The runner's entry of ``spec``; :class:`RewardModelError` saying why when it cannot host it."""
        with self._cond:
            entry = self._models.get(spec.name)
            if entry is None:
                broken = self._broken.get(spec.name)
                if broken is not None and broken[0] is spec:
                    raise RewardModelError(broken[1])
                try:
                    entry = ModelEntry(spec)
                except Exception as exc:
                    why = f"reward model {spec.name!r} cannot be hosted: {type(exc).__name__}: {exc}"
                    if isinstance(exc, RewardModelError):
                        why = str(exc)  # it names the model and the field
                    self._broken[spec.name] = (spec, why)
                    log.error("%s; its requests here fail with this reason", why)
                    raise RewardModelError(why) from None
                self._broken.pop(spec.name, None)
                self._models[spec.name] = entry
                if entry.lane == "host":  # a thread of its own (see DeviceSlot)
                    slot = host_slot(len(self._slots), spec.name)
                    self._slots.append(slot)
                    self._start_thread(self._loop, slot.label, slot)
            elif entry.spec is not spec:
                entry.spec = spec  # re-registered (a plugin reloaded)
            return entry

    def _emit(self, result: Result) -> None:
        with self._cond:
            self._finish(result)

    def _finish(self, result: Result) -> None:
        self._jobs.pop(result.action_id, None)
        self._results.append(result)
        # A full pipe already holds a pending wake-up; a closed one means we are shutting down.
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\x01")

    def _expire(self, now: float) -> float | None:
        """Time out overdue jobs; return the next deadline still pending."""
        while self._deadlines:
            deadline, _, job = self._deadlines[0]
            if job.over:
                heapq.heappop(self._deadlines)
            elif deadline <= now:
                heapq.heappop(self._deadlines)
                message = f"not scored within its {deadline - job.submitted:.3g}s limit"
                self._finish(job.finish_error("timeout", message, now, self.worker_id))
            else:
                return deadline
        return None

    def _fail_queued(self, model: ModelEntry, message: str, tb: str = "") -> None:
        now = time.monotonic()
        for job in model.queue.jobs():
            if not job.over:
                self._finish(job.finish_error("model_error", message, now, self.worker_id, tb))
        model.queue.prune()

    # --- the threads ------------------------------------------------------------------------------
    def _watch_deadlines(self) -> None:
        """Fail requests at their time limit, even while every device is busy (or stuck in a model)."""
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                nxt = self._expire(now)
                self._cond.wait(max(0.0, (nxt if nxt is not None else now + 3600.0) - now) + 1e-4)

    def _loop(self, slot: DeviceSlot) -> None:
        while True:
            with self._cond:
                work: _Work | None = None
                while work is None:
                    if self._closed:
                        return
                    now = time.monotonic()
                    next_deadline = self._expire(now)
                    try:
                        step = self._policy.next_step(slot, self._slots, self._models, now)
                    except Exception:  # a policy bug must not kill the device
                        log.exception("placement policy failed on %s", slot.label)
                        step = Wait(now + 1.0)
                    if isinstance(step, Wait):
                        until = min(t for t in (step.until, next_deadline, now + 3600.0) if t is not None)
                        self._cond.wait(max(0.0, until - now) + 1e-4)
                        continue
                    work = self._claim(slot, step, now)
                    if work is not None:
                        self._cond.notify_all()  # a device turned busy: others may now want a replica
            try:
                self._run(slot, work)
            except Exception:
                log.exception("device %s failed running %s", slot.label, type(work).__name__)
                self._abandon(slot, work, traceback.format_exc()[-_TRACEBACK_CHARS:])
            with self._cond:
                slot.work_until = None

    def _abandon(self, slot: DeviceSlot, work: _Work, tb: str) -> None:
        """Release what ``work`` held after the runner's own code failed running it: a replica left
        loading would book its memory and hold its requests for good, a batch's requests wait on it.
        """
        what = {_LoadWork: "load", _BatchWork: "batch", _UnloadWork: "unload"}[type(work)]
        message = (
            f"the GPU runner failed on {slot.label} running a {what} of reward model {work.model.name!r}"
        )
        if isinstance(work, _LoadWork) and not work.replica.ready:
            self._load_failed(slot, work.model, work.replica, message, tb)
            return
        with self._cond:
            now = time.monotonic()
            if isinstance(work, _BatchWork):
                for piece in work.pieces:
                    if not piece.job.over:
                        self._finish(piece.job.finish_error("model_error", message, now, self.worker_id, tb))
                work.model.queue.prune()
            work.replica.busy = False
            slot.set_busy(False, now)
            self._cond.notify_all()

    def _claim(self, slot: DeviceSlot, step: Step, now: float) -> _Work | None:
        """Book the resources ``step`` uses (under the lock); None when it turns out to be moot."""
        if isinstance(step, Unplaceable):
            self._fail_queued(self._models[step.model], step.reason)
            return None
        assert not isinstance(step, Wait)
        model = self._models[step.model]
        if isinstance(step, RunBatch):
            replica = model.replicas[slot.index]
            pieces = model.queue.take_batch(model.max_batch)
            if not pieces:
                return None
            replica.busy = True
            slot.set_busy(True, now)
            replica.last_used = now
            for piece in pieces:
                job = piece.job
                if job.first_run is None:
                    job.first_run = now
                if replica.loaded_at > piece.enqueued:  # it waited for this replica's load
                    job.setup_s = max(job.setup_s, min(replica.load_s, replica.loaded_at - piece.enqueued))
            _working(slot, model.name, "forward pass", now, max(p.job.deadline for p in pieces))
            return _BatchWork(model, replica, pieces)
        if isinstance(step, Load):
            evicted = []
            for name in step.evict:
                victim = self._models[name]
                evicted.append((victim, victim.replicas.pop(slot.index)))
                victim.stats.evictions += 1
            replica = Replica(model.name, slot.index, model.memory_mb, load_started=now, busy=True)
            model.replicas[slot.index] = replica
            slot.set_busy(True, now)
            waiting = [job.deadline for job in model.queue.jobs() if not job.over]
            _working(slot, model.name, "load", now, max(waiting, default=None))
            return _LoadWork(model, replica, evicted)
        assert isinstance(step, Retire)
        replica = model.replicas.pop(slot.index)
        model.stats.retirements += 1
        replica.busy = True
        slot.set_busy(True, now)
        return _UnloadWork(model, replica)

    def _run(self, slot: DeviceSlot, work: _Work) -> None:
        """Do ``work`` (outside the lock), then record what came of it."""
        if isinstance(work, _BatchWork):
            self._run_batch(slot, work)
        elif isinstance(work, _LoadWork):
            for victim, replica in work.evicted:
                self._unload(victim, replica, slot)
            self._run_load(slot, work)
        else:
            self._unload(work.model, work.replica, slot)
            with self._cond:
                slot.set_busy(False, time.monotonic())
                self._cond.notify_all()

    def _unload(self, model: ModelEntry, replica: Replica, slot: DeviceSlot) -> None:
        t0 = time.monotonic()
        try:
            model.unload(replica, slot.name)
        except BaseException:  # the model's own code: it must not end this device's thread
            log.exception("unloading %s from %s failed (dropped anyway)", model.name, slot.label)
        with self._cond:
            model.stats.unload_s += time.monotonic() - t0

    def _run_load(self, slot: DeviceSlot, work: _LoadWork) -> None:
        model, replica = work.model, work.replica
        before = allocated_mb(slot.name)
        t0 = time.monotonic()
        instance: Any = None
        try:
            instance = model.build_and_load(slot.name)
            load_s = time.monotonic() - t0
            measured = allocated_mb(slot.name) - before
            # What load() set is the model's code too: a memory_mb of "512 MiB" (or NaN, or negative)
            # fails the load, as a raise would, rather than leave the replica loading for good.
            declared = getattr(instance, "memory_mb", None) if model.is_class else None
            declared = (
                0.0 if declared is None else check_memory_mb(model.name, declared, where=" after load()")
            )
        # BaseException: a model's SystemExit or KeyboardInterrupt would end this device's thread
        except BaseException as exc:  # torch.cuda.OutOfMemoryError and MemoryError are Exceptions too
            what = "ran out of memory loading" if is_out_of_memory(exc) else "could not load"
            message = f"{what} reward model {model.name!r} on {slot.label}: {type(exc).__name__}: {exc}"
            tb = traceback.format_exc()[-_TRACEBACK_CHARS:]
            if instance is not None:  # loaded: give its memory back
                replica.instance = instance
                self._unload(model, replica, slot)
            self._load_failed(slot, model, replica, message, tb)
            return
        with self._cond:
            replica.instance = instance
            replica.state = "ready"
            replica.busy = False
            slot.set_busy(False, time.monotonic())
            replica.loaded_at = replica.last_used = time.monotonic()
            replica.load_s = load_s
            model.observe_load(load_s)
            memory = measured if measured > 0 else declared
            if memory > 0:
                replica.memory_mb = model.memory_mb = memory
            self._cond.notify_all()

    def _load_failed(
        self, slot: DeviceSlot, model: ModelEntry, replica: Replica, message: str, tb: str
    ) -> None:
        """Drop ``replica``, whose load failed, and its booking; fail the queue if nothing else serves it."""
        log.warning("%s", message)
        replica.instance = None
        with self._cond:
            if model.replicas.get(slot.index) is replica:
                del model.replicas[slot.index]
            model.stats.load_failures += 1
            model.load_failed_at[slot.index] = time.monotonic()
            if not model.replicas:  # another device's replica (ready or loading) serves the queue
                self._fail_queued(model, message, tb)
            replica.busy = False
            slot.set_busy(False, time.monotonic())
            self._cond.notify_all()

    def _run_batch(self, slot: DeviceSlot, work: _BatchWork) -> None:
        model, replica, pieces = work.model, work.replica, work.pieces
        items = [item for piece in pieces for item in piece.items]
        t0 = time.monotonic()
        whole = self._score(model, replica, items, slot)
        elapsed = time.monotonic() - t0
        # Out of memory with more than one item: smaller batches may fit, so the pieces go back to the
        # front of the queue (an outcome of None) rather than fail (down to one item, which fails alone).
        outcomes: list[_Outcome | None]
        oom_error, oom_items = "", 0  # the call that ran out of memory with more than one item
        oom = whole.oom
        if whole.scores is not None:
            outcomes, offset = [], 0
            for piece in pieces:
                outcomes.append(_Outcome(scores=whole.scores[offset : offset + len(piece.items)]))
                offset += len(piece.items)
        elif whole.oom and len(items) > 1:
            outcomes = [None] * len(pieces)
            oom_error, oom_items = whole.error, len(items)
        elif len(pieces) > 1 and not whole.oom:
            # Score each action's part alone so one action's bad items fail only that action; a part
            # that runs out of memory is retried as the whole batch would be (the bad items of another
            # action must not fail it), and once one has the rest wait for the replica's reload.
            outcomes = []
            for piece in pieces:
                if oom:
                    outcomes.append(None)
                    continue
                part = self._score(model, replica, piece.items, slot)
                oom = part.oom
                if part.oom and len(piece.items) > 1:
                    oom_error, oom_items = part.error, len(piece.items)
                    outcomes.append(None)
                else:
                    outcomes.append(part)
        else:
            outcomes = [whole] * len(pieces)
        if oom:  # its state on the device is suspect: drop it, the next request reloads it
            self._unload(model, replica, slot)
        now = time.monotonic()
        with self._cond:
            if whole.scores is not None:
                model.observe_batch(len(items), elapsed)
            if oom_items:
                model.halve_batches(oom_items)
                log.warning("%s; scoring them again in batches of at most %d", oom_error, model.max_batch)
            back: list[Share] = []
            for piece, outcome in zip(pieces, outcomes, strict=True):
                job = piece.job
                job.in_flight -= 1
                if outcome is None:
                    if not job.over:
                        back.append(Share(job, piece.start, piece.items, piece.enqueued))
                    continue
                job.last_end = now
                if job.over:
                    continue  # timed out meanwhile
                if outcome.scores is None:
                    model.stats.errors += 1
                    self._finish(
                        job.finish_error("model_error", outcome.error, now, self.worker_id, outcome.traceback)
                    )
                    continue
                job.scores[piece.start : piece.start + len(piece.items)] = outcome.scores
                job.remaining -= len(piece.items)
                if job.remaining == 0:
                    self._finish(job.finish_ok(self.worker_id))
            model.queue.push_front(back)
            model.queue.prune()
            if oom:
                model.stats.ooms += 1
                model.replicas.pop(slot.index, None)
            replica.busy = False
            slot.set_busy(False, time.monotonic())
            replica.last_used = now
            self._cond.notify_all()

    def _score(self, model: ModelEntry, replica: Replica, items: Sequence[Any], slot: DeviceSlot) -> _Outcome:
        try:
            return _Outcome(scores=model.score(replica.instance, list(items)))
        except BaseException as exc:  # a model's SystemExit would end this device's thread
            oom = is_out_of_memory(exc)
            if oom:
                reason = f"ran out of memory on {slot.label} scoring {len(items)} items ({exc}); reloading it"
            else:
                reason = f"failed on {slot.label} scoring {len(items)} items: {type(exc).__name__}: {exc}"
            return _Outcome(
                error=f"reward model {model.name!r} {reason}",
                traceback=traceback.format_exc()[-_TRACEBACK_CHARS:],
                oom=oom,
            )


def _working(slot: DeviceSlot, model: str, what: str, now: float, until: float | None) -> None:
    """Note what ``slot`` starts now, and the last time limit of the requests that wait on it."""
    slot.work_of, slot.work_what, slot.work_since, slot.work_until = model, what, now, until


def _host_quarter_mb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 / 4
    except (ValueError, OSError, AttributeError):
        return 4096.0
