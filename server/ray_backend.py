"""Tangram on a Ray cluster: Ray supplies hosts, processes and membership; Tangram keeps scheduling.

``tangram-server --ray auto`` attaches the orchestrator to a Ray cluster as a Ray driver. Every node
gets a Tangram worker (a CPU worker, and a GPU worker where the node has GPUs and reward models are
registered) running as a Ray actor pinned to that node; each joins the orchestrator over the usual
ZeroMQ path (``Register``, ``Dispatch``, ``Results``) and lends what Ray reports for its node minus
the user's reserve. Ray's node table is the membership: a node that joins gets its workers within a
poll or two; a node that dies or drains has its workers removed at once (their running actions are
requeued, exactly one result each, as for any lost worker). A worker actor that crashes is restarted
by Ray (``max_restarts``) on the same node and registers again.

Elastic capacity: when the queued demand exceeds the pool's free capacity for ``scale_up_after_s``,
the backend asks Ray's autoscaler (``ray.autoscaler.sdk.request_resources``) for the pool plus the
shortfall; when the pool has been idle for ``release_after_s`` it withdraws the request, so that the
autoscaler can remove idle nodes. The decision is :class:`CapacityPolicy`, a pure function of the
orchestrator's view; the shell here only carries it out.

The actors hold no Ray resources (``num_cpus=0``): a node that Tangram leaves idle is idle to the
autoscaler too. The reserve (``reserve_cpu``...) is therefore what Tangram leaves to other Ray work on
its nodes; ``node_resource`` keeps Tangram to nodes that declare a custom resource.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from tangram_env.errors import RegistryError
from tangram_env.server.config import RaySettings, ServerSettings
from tangram_env.server.scheduler.events import Resources
from tangram_env.server.security import is_loopback

log = logging.getLogger(__name__)

_EPS = 1e-9
_RETRY_FAILED_NODE_S = 30.0  # a node whose worker could not start is tried again after this long
# Ray hides GPUs from actors that hold none; the GPU runner picks its devices itself.
_SEE_ALL_GPUS = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


class PluginUnavailable(RegistryError, ImportError):
    """A worker on a Ray node cannot import a plugin module the orchestrator loaded."""


# --- pure: what a node gets -------------------------------------------------------------------------
@dataclass(frozen=True)
class RayNode:
    """One row of Ray's node table, as the backend needs it."""

    node_id: str
    alive: bool
    resources: Mapping[str, float]
    draining: bool = False
    ip: str = ""


@dataclass(frozen=True)
class WorkerPlan:
    """A Tangram worker for one node: its name, runner and what it lends."""

    worker_id: str
    node_id: str
    runner: str  # "cpu" or "gpu"
    lend: Resources
    devices: tuple[str, ...] = ()


def plan_workers(node: RayNode, settings: RaySettings, *, reward_models: bool) -> list[WorkerPlan]:
    """The workers ``node`` should run: what Ray reports minus the reserve, split between a CPU worker
    and (with GPUs and reward models) a GPU worker that lends one core per device, as ``tangram-worker``.
    """
    res = node.resources
    if settings.node_resource and res.get(settings.node_resource, 0) <= 0:
        return []
    cpu = max(0.0, res.get("CPU", 0.0) - settings.reserve_cpu)
    mem_mb = max(0.0, res.get("memory", 0.0) / 2**20 - settings.reserve_mem)
    gpus = int(max(0.0, res.get("GPU", 0.0) - settings.reserve_gpu))
    stem = f"ray-{node.node_id[:12]}"
    plans: list[WorkerPlan] = []
    if gpus and reward_models:
        gpu_cpu = min(float(gpus), cpu)
        gpu_mem = mem_mb / 4
        cpu, mem_mb = cpu - gpu_cpu, mem_mb - gpu_mem
        plans.append(
            WorkerPlan(
                f"{stem}-gpu",
                node.node_id,
                "gpu",
                Resources(cpu=gpu_cpu, mem_mb=int(gpu_mem), gpu=float(gpus)),
                tuple(f"cuda:{i}" for i in range(gpus)),
            )
        )
    if cpu > _EPS and mem_mb >= 1:
        plans.insert(
            0, WorkerPlan(f"{stem}-cpu", node.node_id, "cpu", Resources(cpu=cpu, mem_mb=int(mem_mb)))
        )
    return plans


# --- pure: how much to ask the autoscaler for -------------------------------------------------------
Bundle = dict[str, float]


@dataclass
class CapacityPolicy:
    """When to ask Ray's autoscaler for capacity, and how much; with hysteresis both ways.

    :meth:`decide` gets the orchestrator's view at ``now`` and returns the bundles to request if the
    request changes (``[]`` withdraws it), else None. The request is absolute, as Ray reads it: the
    pool's own bundles plus the shortfall, so that the autoscaler adds nodes only for the shortfall.
    """

    settings: RaySettings
    requested: list[Bundle] = field(default_factory=list)  # the request in force ([]: none)
    short_since: float | None = None
    idle_since: float | None = None

    def decide(
        self,
        now: float,
        waiting: Resources,
        free: Resources,
        pool: list[Bundle],
        busy: bool,
        whole: Sequence[Bundle] = (),
    ) -> list[Bundle] | None:
        """``waiting``: summed demand of queued actions; ``free``: the pool's unused capacity;
        ``pool``: one bundle per Ray-backed worker (what it lends); ``busy``: anything queued or running;
        ``whole``: a bundle per queued action that no worker could ever hold (a node must come that
        holds it whole, so it is asked for as one bundle, not as loose cores).
        """
        short_cpu = max(0.0, waiting.cpu - free.cpu)
        short_gpu = max(0.0, waiting.gpu - free.gpu)
        if short_cpu > _EPS or short_gpu > _EPS or whole:
            self.idle_since = None
            if self.short_since is None:
                self.short_since = now
            if now - self.short_since < self.settings.scale_up_after_s:
                return None
            target = self._target(pool, short_cpu, short_gpu, whole)
            if _total(target) == _total(self.requested):
                return None
            self.requested = target
            return target
        self.short_since = None
        if busy:
            self.idle_since = None
            return None
        if self.idle_since is None:
            self.idle_since = now
        if self.requested and now - self.idle_since >= self.settings.release_after_s:
            self.requested = []
            return []
        return None

    def _target(
        self, pool: list[Bundle], short_cpu: float, short_gpu: float, whole: Sequence[Bundle]
    ) -> list[Bundle]:
        limits = {"CPU": self.settings.max_cpus, "GPU": self.settings.max_gpus}
        used = {"CPU": 0.0, "GPU": 0.0}
        target: list[Bundle] = []
        extra = [{"GPU": 1.0}] * math.ceil(short_gpu - _EPS) + [{"CPU": 1.0}] * math.ceil(short_cpu - _EPS)
        for bundle in [*pool, *whole, *extra]:
            if any(used[k] + bundle.get(k, 0.0) > limits[k] + _EPS for k in limits):
                continue  # beyond the limits: the autoscaler is not asked for it
            for k in limits:
                used[k] += bundle.get(k, 0.0)
            target.append(bundle)
        return target


def _total(bundles: list[Bundle]) -> dict[str, float]:
    out: dict[str, float] = {}
    for bundle in bundles:
        for k, v in bundle.items():
            out[k] = out.get(k, 0.0) + v
    return out


# --- the actor: a Tangram worker inside Ray -----------------------------------------------------------
@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker actor needs to join the orchestrator (pickled to the node)."""

    plan: WorkerPlan
    address: str
    plugins: tuple[str, ...]
    plugin_files: tuple[str, ...]
    entry_point_plugins: bool
    sandbox_provider: str
    curve_server_key: str | None
    max_body: int
    gpu_stuck_after_s: float
    worker_token: str | None = None


class RayWorker:
    """A ``tangram-worker`` under a Ray actor. The actor checks the plugins (a missing one fails its
    creation with :class:`PluginUnavailable`), then runs the worker as its child process and lives as
    long as it does: Ray's restarts and kills apply to the worker too. The worker is a child of its
    own, not a thread here, because it forks a process per action and a small process forks faster
    than a Ray worker with its threads and mappings.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        from tangram_env.plugins import load_plugins

        plan = spec.plan
        try:
            load_plugins(
                list(spec.plugins), list(spec.plugin_files), entry_point_plugins=spec.entry_point_plugins
            )
        except Exception as exc:
            raise PluginUnavailable(
                f"worker {plan.worker_id} on Ray node {plan.node_id[:12]} cannot import its plugins "
                f"({type(exc).__name__}: {exc}); install them on every node's Python, or ship them with "
                'TANGRAM_RAY_RUNTIME_ENV (e.g. {"py_modules": [...]} or {"pip": [...]})'
            ) from None
        self.worker_id = plan.worker_id
        self._stopping = False
        self.process = subprocess.Popen(
            _worker_argv(spec, os.getpid()),
            env=_worker_env(spec),
            preexec_fn=_die_with_parent,
        )
        threading.Thread(target=self._watch, name="tangram-worker-watch", daemon=True).start()

    def _watch(self) -> None:
        code = self.process.wait()
        if not self._stopping:  # the worker died: so does the actor, and Ray restarts both
            logging.getLogger(__name__).error("worker %s exited with %s", self.worker_id, code)
            os._exit(1)

    def info(self) -> dict[str, Any]:
        """Who and where this worker is."""
        return {"worker_id": self.worker_id, "pid": os.getpid(), "worker_pid": self.process.pid}

    def stop(self) -> None:
        """Stop the worker (it ends its running actions and closes its runner)."""
        self._stopping = True
        self.process.terminate()
        self.process.wait(timeout=15)


def _worker_argv(spec: WorkerSpec, parent_pid: int) -> list[str]:
    """``tangram-worker``'s command line for ``spec``."""
    plan = spec.plan
    argv = [sys.executable, "-m", "tangram_env.server.worker", "--connect", spec.address]
    argv += ["--worker-id", plan.worker_id, "--runner", plan.runner, "--parent-pid", str(parent_pid)]
    argv += ["--max-body", str(spec.max_body)]
    argv += ["--cpus", f"{plan.lend.cpu:g}", "--mem-mb", str(int(plan.lend.mem_mb))]
    if plan.runner == "gpu":
        argv += ["--gpus", ",".join(plan.devices), "--stuck-after-s", f"{spec.gpu_stuck_after_s:g}"]
    else:
        argv += ["--sandbox", spec.sandbox_provider]
    for module in spec.plugins:
        argv += ["--plugin", module]
    for path in spec.plugin_files:
        argv += ["--plugin-file", path]
    return argv


def _worker_env(spec: WorkerSpec) -> dict[str, str]:
    env = {**os.environ, "TANGRAM_WORKER_ID": spec.plan.worker_id}  # actions can tell where they ran
    if spec.curve_server_key:
        env["TANGRAM_CURVE_SERVER_KEY"] = spec.curve_server_key
    if spec.worker_token:
        env["TANGRAM_WORKER_TOKEN"] = spec.worker_token
    return env


def _die_with_parent() -> None:
    """In the worker, before exec: SIGTERM when the actor dies, even by SIGKILL (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the worker's --parent-pid check stops it within a heartbeat


# --- the shell ------------------------------------------------------------------------------------------
@dataclass
class _NodeWorkers:
    plans: list[WorkerPlan]
    actors: dict[str, Any]  # worker id -> actor handle
    ready: dict[Any, str] = field(default_factory=dict)  # pending ``info`` ref -> worker id


class RayBackend:
    """Attaches one orchestrator to a Ray cluster. :meth:`housekeep` runs on the orchestrator's loop;
    everything that calls Ray runs on the backend's own thread, so the loop never waits on Ray.
    """

    def __init__(self, settings: ServerSettings, address: str, *, reward_models: bool) -> None:
        self.settings = settings
        self.ray_settings = settings.ray
        self.orchestrator_address = address
        self.reward_models = reward_models
        self.policy = CapacityPolicy(self.ray_settings)
        self._nodes: dict[str, _NodeWorkers] = {}
        self._failed: dict[str, float] = {}  # node id -> when its workers failed to start
        self._removals: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self._requests: queue.SimpleQueue[list[Bundle]] = queue.SimpleQueue()
        self._pool: list[Bundle] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._curve_key: str | None = None
        self._local_ips: set[str] = set()
        self.figures: dict[str, Any] = {
            "address": self.ray_settings.address,
            "nodes": 0,
            "workers": [],
            "requested": {},
            "requests": 0,
            "last_request_at": None,
            "last_request": None,
            "errors": {},
        }

    # --- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Connect to Ray (``ray.init``) and start following its node table."""
        import ray

        address = self.ray_settings.address
        ray.init(
            address=None if address in (None, "local") else address,
            namespace=self.ray_settings.namespace,
            log_to_driver=False,
            configure_logging=False,
        )
        self.orchestrator_address = self._reachable(self.orchestrator_address)
        self._local_ips = {ray.util.get_node_ip_address(), "127.0.0.1"}
        if self.settings.curve_secret_key_file:
            import zmq.auth

            public, _ = zmq.auth.load_certificate(self.settings.curve_secret_key_file)
            self._curve_key = public.decode()
        log.info("attached to Ray at %s; workers join %s", address, self.orchestrator_address)
        self._thread = threading.Thread(target=self._follow, name="tangram-ray", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop following Ray, end the worker actors and disconnect."""
        import ray

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for node in self._nodes.values():
            for handle in node.actors.values():
                try:
                    ray.kill(handle, no_restart=True)
                except Exception:
                    pass
        if self.policy.requested:
            self._request([])
        ray.shutdown()

    @staticmethod
    def _reachable(address: str) -> str:
        """The orchestrator's address as the nodes reach it (a wildcard bind becomes this host's IP)."""
        if not address.startswith("tcp://"):
            return address
        host = urlsplit(address).hostname or ""
        if host in ("0.0.0.0", "*", "::"):
            import ray.util

            return address.replace(host, ray.util.get_node_ip_address(), 1)
        return address

    def snapshot(self) -> dict[str, Any]:
        """The figures as they stand (a copy: the backend's thread keeps changing them)."""
        figures = dict(self.figures)
        figures["errors"] = dict(figures["errors"])
        figures["requested"] = dict(figures["requested"])
        return figures

    # --- on the orchestrator's loop -------------------------------------------------------------------
    def housekeep(self, orchestrator: Any, now: float) -> None:
        """Apply Ray's removals and decide on the autoscaler request, from the orchestrator's state."""
        while True:
            try:
                worker_id, why = self._removals.get_nowait()
            except queue.Empty:
                break
            orchestrator.remove_worker(worker_id, why)
        if not self.ray_settings.autoscale:
            return
        demands = orchestrator.queued_demands()
        waiting, free = Resources(), Resources()
        whole: list[Bundle] = []
        if demands:
            workers = orchestrator.figures()["workers"].values()
            capacities = [Resources(**info["capacity"]) for info in workers]
            for info in workers:
                free = free + Resources(**info["capacity"]) - Resources(**info["used"])
            for demand in demands:
                if any(demand.cpu <= c.cpu + _EPS and demand.gpu <= c.gpu + _EPS for c in capacities):
                    waiting = waiting + demand
                else:  # loose cores would not help it: no node might hold them together
                    whole.append({"CPU": demand.cpu, **({"GPU": demand.gpu} if demand.gpu else {})})
        busy = orchestrator.scheduler.pending() > 0 or orchestrator.scheduler.running() > 0
        request = self.policy.decide(now, waiting, free, list(self._pool), busy, whole)
        if request is not None:
            self._requests.put(request)

    # --- on the backend's thread ------------------------------------------------------------------------
    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                self._reconcile()
                self._apply_requests()
            except Exception:
                log.exception("following the Ray cluster failed; trying again")
            self._stop.wait(self.ray_settings.poll_s)

    def _read_nodes(self) -> list[RayNode]:
        import ray

        draining: set[str] = set()
        try:  # not a public API: without it, a draining node is noticed when it dies
            worker: Any = ray._private.worker.global_worker
            draining = set(worker.gcs_client.get_draining_nodes(timeout=5))
        except Exception:
            pass
        return [
            RayNode(
                n["NodeID"],
                bool(n["Alive"]),
                dict(n.get("Resources") or {}),
                n["NodeID"] in draining,
                n.get("NodeManagerAddress", ""),
            )
            for n in ray.nodes()
        ]

    def _reconcile(self) -> None:
        import ray

        nodes = self._read_nodes()
        live = {n.node_id: n for n in nodes if n.alive and not n.draining}
        for node_id in [i for i in self._nodes if i not in live]:
            gone = next((n for n in nodes if n.node_id == node_id), None)
            why = "its Ray node is draining" if gone is not None and gone.draining else "its Ray node died"
            self._drop(node_id, why)
        now = time.monotonic()
        for node in live.values():
            if node.node_id in self._nodes:
                continue
            if now - self._failed.get(node.node_id, -math.inf) < _RETRY_FAILED_NODE_S:
                continue
            plans = plan_workers(node, self.ray_settings, reward_models=self.reward_models)
            if plans and node.ip not in self._local_ips and is_loopback(self.orchestrator_address):
                log.warning(
                    "Ray node %s (%s) is another host, but the orchestrator listens on %s, which it cannot "
                    "reach: bind an address the nodes can reach, with CurveZMQ keys (docs/ray.md)",
                    node.node_id[:12],
                    node.ip,
                    self.orchestrator_address,
                )
            if plans:
                try:
                    self._nodes[node.node_id] = self._start_workers(plans)
                except Exception as exc:  # this node only: the others, and the autoscaler request, go on
                    message = self._start_failure(exc)
                    log.error("Ray node %s: its workers could not start: %s", node.node_id[:12], message)
                    self.figures["errors"][node.node_id] = message
                    self._failed[node.node_id] = now
        for node_id, workers in list(self._nodes.items()):
            if not workers.ready:
                continue
            done, _ = ray.wait(list(workers.ready), num_returns=len(workers.ready), timeout=0)
            for ref in done:
                worker_id = workers.ready.pop(ref)
                try:
                    info = ray.get(ref)
                    log.info("Ray worker %s is up (pid %s)", worker_id, info["pid"])
                    self.figures["errors"].pop(node_id, None)
                except Exception as exc:
                    message = _cause(exc)
                    log.error("Ray worker %s could not start: %s", worker_id, message)
                    self.figures["errors"][node_id] = message
                    self._failed[node_id] = time.monotonic()
                    self._drop(node_id, "its worker actor failed to start")
                    break
        self._pool = [
            {"CPU": p.lend.cpu, **({"GPU": p.lend.gpu} if p.lend.gpu else {})}
            for w in self._nodes.values()
            for p in w.plans
        ]
        self.figures["nodes"] = len(live)
        self.figures["workers"] = sorted(p.worker_id for w in self._nodes.values() for p in w.plans)

    def _start_workers(self, plans: list[WorkerPlan]) -> _NodeWorkers:
        import ray

        runtime_env = dict(self.ray_settings.runtime_env or {})
        runtime_env["env_vars"] = {**_SEE_ALL_GPUS, **runtime_env.get("env_vars", {})}
        actor_class = ray.remote(RayWorker)
        workers = _NodeWorkers(plans, {})
        try:
            for plan in plans:
                self._start_worker(actor_class, plan, runtime_env, workers)
        except Exception:
            for handle in workers.actors.values():  # none of this node's workers stays half started
                with contextlib.suppress(Exception):
                    ray.kill(handle, no_restart=True)
            raise
        return workers

    def _start_failure(self, exc: Exception) -> str:
        """Why a node's workers could not start, with the fix when it is known."""
        if type(exc).__name__ == "ActorAlreadyExistsError" or "already taken" in str(exc):
            return (
                f"a Ray actor of its name already runs in namespace {self.ray_settings.namespace!r}: another "
                "orchestrator's workers use this node; give each orchestrator its own nodes "
                "(TANGRAM_RAY_NODE_RESOURCE) and its own namespace (TANGRAM_RAY_NAMESPACE)"
            )
        return _cause(exc)

    def _start_worker(
        self, actor_class: Any, plan: WorkerPlan, runtime_env: dict[str, Any], workers: _NodeWorkers
    ) -> None:
        """Start ``plan``'s worker actor on its node and note it in ``workers``."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        spec = WorkerSpec(
            plan=plan,
            address=self.orchestrator_address,
            plugins=tuple(self.settings.plugins),
            plugin_files=tuple(os.path.abspath(p) for p in self.settings.plugin_files),
            entry_point_plugins=self.settings.entry_point_plugins,
            sandbox_provider=self.settings.sandbox_provider,
            curve_server_key=self._curve_key,
            max_body=self.settings.max_body,
            gpu_stuck_after_s=self.settings.gpu_stuck_after_s,
            worker_token=self.settings.worker_token.get_secret_value()
            if self.settings.worker_token
            else None,
        )
        handle: Any = actor_class.options(
            name=f"tangram-{plan.worker_id}",
            get_if_exists=False,
            num_cpus=0,
            max_restarts=self.ray_settings.max_restarts,
            scheduling_strategy=NodeAffinitySchedulingStrategy(plan.node_id, soft=False),
            runtime_env=runtime_env,
        ).remote(spec)
        workers.actors[plan.worker_id] = handle
        workers.ready[handle.info.remote()] = plan.worker_id
        log.info("starting Ray worker %s lending %s", plan.worker_id, plan.lend)

    def _drop(self, node_id: str, why: str) -> None:
        import ray

        workers = self._nodes.pop(node_id)
        for worker_id, handle in workers.actors.items():
            try:
                ray.kill(handle, no_restart=True)  # before the removal: it must not register again
            except Exception:
                pass
            self._removals.put((worker_id, why))

    def _apply_requests(self) -> None:
        latest: list[Bundle] | None = None
        while True:
            try:
                latest = self._requests.get_nowait()
            except queue.Empty:
                break
        if latest is not None:
            self._request(latest)

    def _request(self, bundles: list[Bundle]) -> None:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=bundles)
        self.figures.update(
            requested=_total(bundles),
            requests=self.figures["requests"] + 1,
            last_request_at=time.time(),
            last_request="release" if not bundles else "scale_up",
        )
        log.info("asked Ray's autoscaler for %s", _total(bundles) or "nothing (released)")


def _cause(exc: BaseException) -> str:
    """The message of the error that killed an actor's creation (Ray wraps it)."""
    cause = getattr(exc, "cause", None) or exc
    for line in reversed(str(cause).splitlines()):
        if "PluginUnavailable" in line or "Error" in line:
            return line.strip()
    return str(cause).strip().splitlines()[-1] if str(cause).strip() else type(exc).__name__


def attach_ray(settings: ServerSettings, orchestrator: Any) -> RayBackend | None:
    """Attach ``orchestrator`` to the Ray cluster of ``settings.ray`` (None when Ray is not asked for)."""
    if settings.ray.address is None:
        return None
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ImportError(
            "--ray needs Ray on the orchestrator's host: pip install 'tangram-env[ray]'"
        ) from None
    from tangram_env.kinds import kind_registry

    backend = RayBackend(
        settings,
        orchestrator.address,
        reward_models=any(s.role == "reward_model" for s in kind_registry),
    )
    backend.start()
    orchestrator.attach(backend.housekeep, backend.snapshot, name="ray")
    return backend


__all__ = [
    "Bundle",
    "CapacityPolicy",
    "PluginUnavailable",
    "RayBackend",
    "RayNode",
    "RayWorker",
    "WorkerPlan",
    "WorkerSpec",
    "attach_ray",
    "plan_workers",
]
