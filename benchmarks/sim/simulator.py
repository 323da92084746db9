"""A discrete-event simulator that drives a real scheduler object with simulated time.

The simulator plays the orchestrator and the workers: it turns the workload into scheduler events,
applies the scheduler's decisions (start on this worker with k units, requeue, reject, scale a warm
pool), decides what each start really costs (creating a sandbox or taking a warm one, loading a
reward model or finding it loaded, then the hidden Amdahl run time at k units) and tells the
scheduler only what a worker would: an :class:`ActionFinished` with the measured run and set-up time.
All events of one instant go to the scheduler in one ``handle`` call, as the orchestrator batches them.

A live sandbox holds its idle footprint (``EnvKind.sandbox``) on its worker from creation to close,
and a command in it also what it may use above that while it runs (``WorkloadConfig.demand``): the
model the server's ledger books. GPU actions started in another's batch (``Start.batch_of``) run
with it as one forward pass on its devices, holding nothing of their own, and all end together: the
batch takes its longest item plus ``batch_marginal`` of each other item's run time. Reward models
are loaded per GPU device: a start on ``k`` GPUs takes ``k`` devices of its worker (those with the
model loaded first, then the emptiest) and pays the load if any of them lacks it; each device
caches models while its memory allows, least recently used evicted first.

Besides the scheduler's own ``validate_state`` (every ``validate_every`` calls and at the end), the
simulator checks from the outside that no worker ever runs more than its capacity, sandboxes' memory
included.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from benchmarks.sim.cluster import GPU_WEIGHT, MEM_WEIGHT_PER_GIB, ClusterSpec
from benchmarks.sim.workload import PlannedAction, Trajectory, WorkloadConfig, generate
from tangram_env.server.scheduler.events import (
    ActionArrived,
    ActionFinished,
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
)

_EPS = 1e-9


class SimulationError(AssertionError):
    """The simulated system broke an invariant (over-commit, a start of an unknown action, a hang)."""


@dataclass
class _Live:
    """An action in flight in the simulator."""

    plan: PlannedAction
    traj: Trajectory
    index: int
    submit: float
    demand: Resources  # per unit, while it runs
    start: float = -1.0
    end: float = -1.0
    k: int = 0
    setup: float = 0.0
    run: float = 0.0
    worker: str = ""
    generation: int = 0
    devices: tuple[int, ...] = ()  # GPU devices it runs on
    batch: list[_Live] = field(default_factory=list)  # riders in its batch (it leads one)
    rider: bool = False  # runs in another action's batch, holding nothing of its own


class _Device:
    """One GPU: what is loaded on it (LRU, with each model's memory) and how much of it is lent out."""

    __slots__ = ("busy", "loaded", "mem_mb")

    def __init__(self, mem_mb: float) -> None:
        self.mem_mb = mem_mb
        self.loaded: OrderedDict[str, float] = OrderedDict()
        self.busy: dict[str, int] = {}  # model -> actions running it here

    def load(self, model: str, mem_mb: float) -> bool:
        """Make ``model`` resident (evicting idle models, oldest first); whether it had to be loaded."""
        if model in self.loaded:
            self.loaded.move_to_end(model)
            return False
        for old in list(self.loaded):
            if sum(self.loaded.values()) + mem_mb <= self.mem_mb:
                break
            if not self.busy.get(old):
                del self.loaded[old]
        self.loaded[model] = mem_mb
        return True


@dataclass
class SimResult:
    """What one simulated run measured."""

    policy: str
    acts: list[float] = field(default_factory=list)
    acts_after_first: list[float] = field(default_factory=list)  # without each trajectory's first action
    act_by_kind: dict[str, list[float]] = field(default_factory=dict)
    wait_by_kind: dict[str, list[float]] = field(default_factory=dict)  # submit to start
    steps: list[float] = field(default_factory=list)
    held: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])  # resource-seconds held
    busy: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])  # resource-seconds running
    warm_mb_s: float = 0.0  # memory-seconds of sandboxes waiting in warm pools (part of held)
    makespan: float = 0.0
    capacity: Resources = field(default_factory=Resources)
    model_loads: int = 0
    rejected: int = 0
    handle_calls: int = 0
    mean_k: dict[str, float] = field(default_factory=dict)
    cold_starts: int = 0
    warm_starts: int = 0
    batched: int = 0  # GPU actions that ran in another one's batch

    def figures(self) -> dict[str, Any]:
        """The headline figures as JSON-able numbers."""
        acts = sorted(self.acts)
        n = len(acts)

        def q(p: float) -> float:
            return acts[min(n - 1, int(p * n))] if n else 0.0

        cap = self.capacity
        mem_w = MEM_WEIGHT_PER_GIB / 1024
        held = self.held[0] + GPU_WEIGHT * self.held[2] + mem_w * self.held[1]
        busy = self.busy[0] + GPU_WEIGHT * self.busy[2] + mem_w * self.busy[1]
        cap_eq = (cap.cpu + GPU_WEIGHT * cap.gpu + mem_w * cap.mem_mb) * self.makespan
        return {
            "actions": n,
            "mean_act_s": sum(acts) / n if n else 0.0,
            "p50_act_s": q(0.5),
            "p99_act_s": q(0.99),
            "mean_act_after_first_s": (
                sum(self.acts_after_first) / len(self.acts_after_first) if self.acts_after_first else 0.0
            ),
            "mean_step_s": sum(self.steps) / len(self.steps) if self.steps else 0.0,
            "resource_s": held,
            "core_s": self.held[0],
            "gpu_s": self.held[2],
            "mem_gib_s": self.held[1] / 1024,
            "warm_mem_gib_s": self.warm_mb_s / 1024,
            "utilisation": busy / cap_eq if cap_eq else 0.0,
            "held_fraction": held / cap_eq if cap_eq else 0.0,
            "makespan_s": self.makespan,
            "rejected": self.rejected,
            "mean_act_by_kind_s": {k: sum(v) / len(v) for k, v in sorted(self.act_by_kind.items())},
            "mean_wait_by_kind_s": {k: sum(v) / len(v) for k, v in sorted(self.wait_by_kind.items())},
            "mean_parallelism": dict(sorted(self.mean_k.items())),
            "cold_starts": self.cold_starts,
            "warm_starts": self.warm_starts,
            "model_loads": self.model_loads,
            "batched": self.batched,
        }


class Simulator:
    """Runs ``workload`` on ``cluster`` under ``scheduler`` (any :class:`Scheduler`)."""

    def __init__(
        self,
        scheduler: Scheduler,
        cluster: ClusterSpec,
        workload: WorkloadConfig,
        *,
        validate_every: int = 2000,
        check_capacity: bool = True,
        plan: list[list[Trajectory]] | None = None,
    ) -> None:
        self.sched = scheduler
        self.cluster = cluster
        self.cfg = workload
        self.plan = plan if plan is not None else generate(workload)
        self.validate_every = validate_every
        self.check_capacity = check_capacity
        self.result = SimResult(policy=getattr(scheduler, "name", type(scheduler).__name__))
        self._queue: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._live: dict[str, _Live] = {}
        self._sessions: dict[str, str] = {}  # session -> worker where its sandbox lives
        self._pool: dict[str, int] = {}  # image -> warm sandboxes
        self._pool_size: dict[str, int] = {}  # image -> size last asked for
        self._warm_mb: dict[str, float] = {}  # image -> what one of its warm sandboxes holds
        self._caps = {w.worker_id: w.capacity for w in cluster.workers()}
        self._devices = {
            w: [_Device(cluster.gpu_mem_mb_per_gpu) for _ in range(int(c.gpu))] for w, c in self._caps.items()
        }
        self._device_free = {w: [1.0] * len(d) for w, d in self._devices.items()}
        self._capacity = cluster.capacity()
        self._in_use: dict[str, list[float]] = {w: [0.0, 0.0, 0.0, 0.0] for w in self._caps}
        self._step_left = 0
        self._step_start = 0.0
        self._next_tick = float("inf")
        self._k_sum: dict[str, list[float]] = {}
        self._started: list[_Live] = []  # started by the decisions of this instant (riders joined)

    # --- the event loop -----------------------------------------------------------------------------
    def _push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self._queue, (t, next(self._seq), kind, payload))

    def run(self) -> SimResult:
        """Simulate every step; return the measurements."""
        inspect: Any = self.sched  # the Inspectable extras: held, validate_state, next_wakeup
        events: list[Event] = list(self.cluster.workers())
        self._push(0.0, "step", 0)
        now, last, held = 0.0, 0.0, Resources()
        calls = 0
        while self._queue:
            now = self._queue[0][0]
            while self._queue and self._queue[0][0] <= now + _EPS:
                _, _, kind, payload = heapq.heappop(self._queue)
                self._on[kind](self, payload, now, events)
            for i, amount in enumerate((held.cpu, held.mem_mb, held.gpu, held.gpu_mem_mb)):
                self.result.held[i] += amount * (now - last)
            warm_mb_s = self._warm_held_mb() * (now - last)
            self.result.held[1] += warm_mb_s
            self.result.warm_mb_s += warm_mb_s
            last = now
            if not events:
                continue
            decisions = self.sched.handle(events, now)
            events = []
            calls += 1
            for d in decisions:
                self._apply(d, now, events)
            self._run_started(now)
            held = inspect.held()
            self._check_held(held)
            if calls % self.validate_every == 0:
                inspect.validate_state()
            wake = inspect.next_wakeup(now)
            if wake is not None and now + 1e-6 < wake < self._next_tick:
                self._next_tick = wake
                self._push(wake, "tick", None)
            if events:  # decisions that produce events at once (none today) run at the same instant
                self._push(now, "noop", None)
        inspect.validate_state()
        if self._live or self.sched.pending() or self.sched.running():
            raise SimulationError(
                f"{self.result.policy}: the run ended with {len(self._live)} actions unfinished "
                f"({self.sched.pending()} pending, {self.sched.running()} running)"
            )
        self.result.handle_calls = calls
        self.result.makespan = now
        self.result.capacity = self.cluster.capacity()
        self.result.mean_k = {k: v[0] / v[1] for k, v in self._k_sum.items()}
        return self.result

    def _warm_held_mb(self) -> float:
        """The memory of the warm pools: a sandbox kept warm holds its idle footprint until it is taken."""
        return sum(n * self._warm_mb.get(image, 0.0) for image, n in self._pool.items())

    # --- workload events ------------------------------------------------------------------------------
    def _on_step(self, step: int, now: float, events: list[Event]) -> None:
        trajs = self.plan[step]
        self._step_left = len(trajs)
        self._step_start = now
        for traj in trajs:
            self._submit(traj, 0, now, events)

    def _submit(self, traj: Trajectory, i: int, now: float, events: list[Event]) -> None:
        plan = traj.actions[i]
        kind = self.cfg.kinds[plan.kind]
        demand = self.cfg.demand(plan.kind, traj.env)
        live = self._live[plan.action_id] = _Live(plan, traj, i, submit=now, demand=demand)
        session = traj.traj_id if self.cfg.sessions and kind.setup == "sandbox" else None
        events.append(
            ActionArrived(
                plan.action_id,
                plan.kind,
                demand,
                kind.min_par,
                kind.max_par,
                trajectory_id=traj.traj_id,
                env_id=traj.env.env_id,
                affinity=session,
                image=traj.env.image if session else None,
                sandbox_mem_mb=_idle_mb(traj) if session else 0.0,
            )
        )
        del live

    def _on_submit(self, payload: tuple[Trajectory, int], now: float, events: list[Event]) -> None:
        self._submit(payload[0], payload[1], now, events)

    def _on_finish(self, payload: tuple[str, int], now: float, events: list[Event]) -> None:
        action_id, generation = payload
        live = self._live.get(action_id)
        if live is None or live.generation != generation:
            return  # requeued meanwhile: this completion never happens
        del self._live[action_id]
        live.end = now
        self._release(live)
        res = self.result
        act = now - live.submit
        res.acts.append(act)
        if live.index:
            res.acts_after_first.append(act)
        res.act_by_kind.setdefault(live.plan.kind, []).append(act)
        res.wait_by_kind.setdefault(live.plan.kind, []).append(live.start - live.submit)
        events.append(ActionFinished(action_id, live.run, ok=True, setup_s=live.setup))
        self._advance(live, now, events)

    def _advance(self, live: _Live, now: float, events: list[Event]) -> None:
        traj, i = live.traj, live.index
        if i + 1 < len(traj.actions):
            self._push(now + traj.gaps[i + 1], "submit", (traj, i + 1))
            return
        if self.cfg.sessions:
            events.append(SessionClosed(traj.traj_id))
            if traj.traj_id in self._sessions:
                where = self._sessions.pop(traj.traj_id)
                self._in_use[where][1] -= _idle_mb(traj)
                image = traj.env.image
                if self._pool.get(image, 0) < self._pool_size.get(image, 0):
                    self._pool[image] = self._pool.get(image, 0) + 1  # reset and kept warm; else destroyed
                    self._warm_mb[image] = _idle_mb(traj)
        events.append(TrajectoryClosed(traj.traj_id))
        self._step_left -= 1
        if self._step_left == 0:
            self.result.steps.append(now - self._step_start)
            if traj.step + 1 < len(self.plan):
                self._push(now + self.cfg.update_s, "step", traj.step + 1)

    def _on_tick(self, payload: None, now: float, events: list[Event]) -> None:
        self._next_tick = float("inf")
        events.append(Tick())

    def _on_noop(self, payload: None, now: float, events: list[Event]) -> None:
        pass

    _on: ClassVar[dict[str, Callable[..., None]]] = {
        "step": _on_step,
        "submit": _on_submit,
        "finish": _on_finish,
        "tick": _on_tick,
        "noop": _on_noop,
    }

    # --- decisions --------------------------------------------------------------------------------------
    def _apply(self, d: object, now: float, events: list[Event]) -> None:
        if isinstance(d, Start):
            self._start(d, now)
        elif isinstance(d, ScalePool):
            self._pool_size[d.image] = d.size
            self._pool[d.image] = max(0, self._pool.get(d.image, 0) - d.expire)  # destroyed: idle too long
            if self._pool.get(d.image, 0) > d.size:
                self._pool[d.image] = d.size  # the extra warm sandboxes are destroyed
        elif isinstance(d, Requeue):
            live = self._live[d.action_id]
            self._release(live)
            live.generation += 1
            live.start = -1.0
        elif isinstance(d, Reject):
            live = self._live.pop(d.action_id)
            self.result.rejected += 1
            self._advance(live, now, events)  # the agent sees an error and carries on
        else:
            raise SimulationError(f"unknown decision {d!r}")

    def _start(self, d: Start, now: float) -> None:
        live = self._live.get(d.action_id)
        if live is None or live.start >= 0:
            raise SimulationError(f"start of {d.action_id}, which is not waiting")
        kind = self.cfg.kinds[live.plan.kind]
        if not kind.min_par <= d.parallelism <= kind.max_par:
            raise SimulationError(f"{d.action_id} started with k={d.parallelism} outside its elasticity")
        if d.batch_of is not None:
            self._ride(live, d, now)
            return
        setup = 0.0
        traj = live.traj
        if self.cfg.sessions and kind.setup == "sandbox":
            where = self._sessions.get(traj.traj_id)
            if where is None:
                image = traj.env.image
                if self._pool.get(image, 0) > 0:
                    self._pool[image] -= 1
                    setup = self.cfg.sandbox_reset_s
                    self.result.warm_starts += 1
                else:
                    setup = live.plan.create_s
                    self.result.cold_starts += 1
                self._sessions[traj.traj_id] = d.worker_id
                self._in_use[d.worker_id][1] += _idle_mb(traj)
            elif where != d.worker_id:
                raise SimulationError(f"{d.action_id} started on {d.worker_id}; its sandbox is on {where}")
        elif kind.setup == "model":
            setup = self._load_model(live, d)
        live.start, live.k, live.worker = now, d.parallelism, d.worker_id
        live.setup, live.run = setup, kind.run_s(live.plan.t1, d.parallelism)
        dem = live.demand
        use = self._in_use[d.worker_id]
        for i, amount in enumerate((dem.cpu, dem.mem_mb, dem.gpu, dem.gpu_mem_mb)):
            use[i] += amount * d.parallelism
            self.result.busy[i] += amount * d.parallelism * (setup + live.run)
        if self.check_capacity:
            cap = self._caps[d.worker_id]
            for used, limit in zip(use, (cap.cpu, cap.mem_mb, cap.gpu, cap.gpu_mem_mb), strict=True):
                if used > limit + 1e-6:
                    raise SimulationError(f"worker {d.worker_id} runs {use}, over its capacity {cap}")
        acc = self._k_sum.setdefault(live.plan.kind, [0.0, 0.0])
        acc[0] += d.parallelism
        acc[1] += 1
        self._started.append(live)

    def _ride(self, live: _Live, d: Start, now: float) -> None:
        """``live`` joins the batch of ``d.batch_of`` (started at this instant, on the same worker)."""
        lead = self._live.get(d.batch_of or "")
        if lead is None or lead.start != now or lead.rider or lead.worker != d.worker_id:
            raise SimulationError(f"{d.action_id} rides in {d.batch_of}, not just started on {d.worker_id}")
        if lead.plan.kind != live.plan.kind or lead.k != d.parallelism:
            raise SimulationError(f"{d.action_id} rides in {d.batch_of} with another model or width")
        live.start, live.k, live.worker, live.rider = now, d.parallelism, d.worker_id, True
        lead.batch.append(live)

    def _run_started(self, now: float) -> None:
        """Schedule the end of what started at this instant: a batch ends together, at its batch cost."""
        for lead in self._started:
            if lead.batch:
                kind = self.cfg.kinds[lead.plan.kind]
                runs = [kind.run_s(m.plan.t1, lead.k) for m in (lead, *lead.batch)]
                longest = max(runs)
                # One forward pass over the batch: the longest item, plus a fraction of each other one.
                lead.run = longest + self.cfg.batch_marginal * (sum(runs) - longest)
                dem = lead.demand
                for i, amount in enumerate((dem.cpu, dem.mem_mb, dem.gpu, dem.gpu_mem_mb)):
                    self.result.busy[i] += amount * lead.k * (lead.run - runs[0])
                self.result.batched += len(lead.batch)
            for m in (lead, *lead.batch):
                m.setup, m.run = lead.setup, lead.run
                self._push(now + lead.setup + lead.run, "finish", (m.plan.action_id, m.generation))
        self._started = []

    def _load_model(self, live: _Live, d: Start) -> float:
        """Take GPU devices for ``live`` (warm ones first); the load time if any of them lacks its model."""
        name = live.plan.kind
        kind = self.cfg.kinds[name]
        need = kind.demand.gpu * d.parallelism
        devices, free = self._devices[d.worker_id], self._device_free[d.worker_id]
        whole = need >= 1 - _EPS
        share = 1.0 if whole else need
        count = round(need) if whole else 1
        # Devices holding the model first, then the emptiest (the GPU runner places a new replica on the
        # least-pressed device), then by index.
        order = sorted(
            range(len(devices)),
            key=lambda i: (
                name not in devices[i].loaded,
                sum(devices[i].loaded.values()),
                len(devices[i].loaded),
                i,
            ),
        )
        chosen = [i for i in order if free[i] >= share - _EPS][:count]
        if len(chosen) < count:
            raise SimulationError(f"{d.action_id} needs {count} free GPUs on {d.worker_id}: {free}")
        mem = kind.demand.gpu_mem_mb / max(kind.demand.gpu, _EPS) * share
        loaded = False
        for i in chosen:
            free[i] -= share
            loaded |= devices[i].load(name, mem)
            devices[i].busy[name] = devices[i].busy.get(name, 0) + 1
        live.devices = tuple(chosen)
        if loaded:
            self.result.model_loads += 1
            return self.cfg.load_s(name)
        return 0.0

    def _release(self, live: _Live) -> None:
        if live.start < 0 or live.rider:
            return
        dem = live.demand
        use = self._in_use[live.worker]
        for i, amount in enumerate((dem.cpu, dem.mem_mb, dem.gpu, dem.gpu_mem_mb)):
            use[i] -= amount * live.k
        if live.devices:
            need = dem.gpu * live.k
            share = 1.0 if need >= 1 - _EPS else need
            for i in live.devices:
                self._device_free[live.worker][i] += share
                self._devices[live.worker][i].busy[live.plan.kind] -= 1
            live.devices = ()

    def _check_held(self, held: Resources) -> None:
        cap = self._capacity
        for h, c in ((held.cpu, cap.cpu), (held.mem_mb, cap.mem_mb), (held.gpu, cap.gpu)):
            if h > c * (1 + 1e-9) + 1e-6:
                raise SimulationError(f"{self.result.policy} holds {held}, more than the pool's {cap}")


def _idle_mb(traj: Trajectory) -> float:
    """What ``traj``'s sandbox holds from creation to close."""
    return traj.env.sandbox.idle_mb if traj.env.sandbox is not None else 0.0


def simulate(
    scheduler: Scheduler, cluster: ClusterSpec, workload: WorkloadConfig, **options: Any
) -> SimResult:
    """Run one simulation (see :class:`Simulator`)."""
    return Simulator(scheduler, cluster, workload, **options).run()
