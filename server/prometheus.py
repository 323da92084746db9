"""Prometheus metrics of an orchestrator, served over HTTP (``tangram-server --metrics-port PORT``).

Two sources feed the exporter. Every finished action is observed as it happens
(:meth:`PrometheusExporter.observe_result`): ACT and queueing histograms per kind, outcomes and errors
by reason. About twice a second the loop hands over the same figures ``Stats`` returns
(:meth:`PrometheusExporter.update`); those become gauges and counters that mirror the orchestrator's
state: queue length, running actions, capacity and use per resource type (hence utilisation), sandbox
pool sizes, model loads and evictions. The state series are rebuilt from each snapshot, so a worker that
leaves simply stops being reported instead of leaving stale series behind.

Series (all prefixed ``tangram_``)::

    action_completion_seconds{kind}          histogram  submit -> result (ACT)
    action_queue_seconds{kind}               histogram  time spent waiting for resources
    actions_finished_total{kind,outcome}     counter    outcome: ok | error
    action_errors_total{kind,reason}         counter    reason: the result's error_type
    submitted_total, finished_total          counter    as the orchestrator counts them
    errors_total{reason}                     counter    the orchestrator's own error counts (incl. rejections)
    protocol_errors_total{code}              counter    malformed or unexpected messages
    queue_length, running_actions, workers   gauge
    worker_running_actions{worker}           gauge
    capacity{resource}, used{resource}       gauge      summed over workers (cpu, mem_mb, gpu, gpu_mem_mb)
    utilisation_ratio{resource}              gauge      used / capacity
    worker_capacity{worker,resource}, worker_used{worker,resource}, worker_utilisation_ratio{worker,resource}
    sandbox_pool{worker,image,state}         gauge      sandboxes per image: warm, in_use, target
    sandbox_sessions{worker}, sandbox_reset_ms_mean{worker}  gauge
    sandbox_events_total{worker,event}       counter    created, cold_starts, warm_hits, resets, ...
    sandbox_discards_total{worker,reason}    counter
    model_loads_total{worker,model}, model_evictions_total{...}, model_load_failures_total{...},
    model_ooms_total{...}                    counter    from reward-model workers
    model_replicas{worker,model}, model_memory_mb{worker,model}, model_queue_items{worker,model}  gauge
    device_used_mb{worker,device}, device_budget_mb{worker,device}, device_busy{worker,device}  gauge
    server_info{server_id,scheduler}         gauge      always 1
    api_waiting{api}, api_tokens{api,key}, api_in_flight{api,key}  gauge  API quotas (docs/quotas.md)
    api_granted_total{api,key}, api_throttled_total{api,key}       counter
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

#: The resource types a worker announces (the fields of a scheduler ``Resources``).
RESOURCES = ("cpu", "mem_mb", "gpu", "gpu_mem_mb")

#: ACT spans a millisecond (an inline echo) to an hour (a long test suite).
ACT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)


def _number(value: Any) -> float | None:
    """``value`` as a float if it is a plain number (bools and everything else: None)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _resources(value: Any) -> dict[str, float]:
    """The numeric resource fields of a capacity or usage dict (missing or odd values are left out)."""
    if not isinstance(value, Mapping):
        return {}
    out: dict[str, float] = {}
    for name in RESOURCES:
        number = _number(value.get(name))
        if number is not None:
            out[name] = number
    return out


class _Families:
    """Metric families built from one figures snapshot."""

    def __init__(self) -> None:
        self._families: dict[str, Metric] = {}

    def gauge(self, name: str, doc: str, labels: Iterable[str]) -> GaugeMetricFamily:
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = GaugeMetricFamily(name, doc, labels=list(labels))
        assert isinstance(family, GaugeMetricFamily)
        return family

    def counter(self, name: str, doc: str, labels: Iterable[str]) -> CounterMetricFamily:
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = CounterMetricFamily(name, doc, labels=list(labels))
        assert isinstance(family, CounterMetricFamily)
        return family

    def all(self) -> list[Metric]:
        return list(self._families.values())


def families_from_figures(figures: Mapping[str, Any]) -> list[Metric]:
    """The state series of one ``Stats`` snapshot. Missing or malformed keys are skipped, never fatal."""
    out = _Families()
    if "server_id" in figures or "scheduler" in figures:
        out.gauge(
            "tangram_server_info",
            "The orchestrator behind these figures (always 1).",
            ["server_id", "scheduler"],
        ).add_metric([str(figures.get("server_id", "")), str(figures.get("scheduler", ""))], 1.0)
    for key, doc in (
        ("submitted", "Actions submitted (after de-duplication)."),
        ("finished", "Actions that got a result."),
    ):
        number = _number(figures.get(key))
        if number is not None:
            out.counter(f"tangram_{key}", doc, []).add_metric([], number)
    for key, name, doc in (
        ("errors", "tangram_errors", "Failed actions and rejected submissions by reason."),
        ("protocol_errors", "tangram_protocol_errors", "Bad messages by error code."),
    ):
        counts = figures.get(key)
        label = "reason" if key == "errors" else "code"
        family = out.counter(name, doc, [label])
        if isinstance(counts, Mapping):
            for reason, count in counts.items():
                number = _number(count)
                if number is not None:
                    family.add_metric([str(reason)], number)
    for key, name, doc in (
        ("pending", "tangram_queue_length", "Actions waiting for resources."),
        ("running", "tangram_running_actions", "Actions running now."),
    ):
        number = _number(figures.get(key))
        if number is not None:
            out.gauge(name, doc, []).add_metric([], number)
    workers = figures.get("workers")
    if isinstance(workers, Mapping):
        _worker_families(out, workers)
    quotas = figures.get("api_quotas")
    if isinstance(quotas, Mapping):
        _quota_families(out, quotas)
    ray = figures.get("ray")
    if isinstance(ray, Mapping):
        _ray_families(out, ray)
    _sandbox_session_families(out, figures)
    return out.all()


def _sandbox_session_families(out: _Families, figures: Mapping[str, Any]) -> None:
    """Sandbox providers' backpressure, and the memory live sandboxes hold."""
    series = (
        ("sandbox_busy", "retries", "counter", "Back-offs begun because a sandbox provider was at capacity."),
        ("sandbox_busy", "backing_off", "gauge", "Actions waiting out a sandbox provider's back-off."),
        ("sandbox_busy", "given_up", "counter", "Actions failed after a provider stayed at capacity."),
        ("sandbox_memory", "live_sessions", "gauge", "Sandbox sessions whose sandbox is held."),
        ("sandbox_memory", "lent_mb", "gauge", "Memory the scheduler lends now, live sandboxes included."),
        ("sandbox_memory", "new_sessions_waiting", "gauge", "New sandbox sessions waiting to start."),
    )
    for group, key, kind, doc in series:
        values = figures.get(group)
        number = _number(values.get(key)) if isinstance(values, Mapping) else None
        if number is None:
            continue
        if kind == "counter":
            out.counter(f"tangram_{group}_{key}", doc, []).add_metric([], number)
        else:
            out.gauge(f"tangram_{group}_{key}", doc, []).add_metric([], number)


def _quota_families(out: _Families, quotas: Mapping[str, Any]) -> None:
    """API quotas: actions waiting per API; tokens, in flight, grants and 429s per key."""
    for api, figures in quotas.items():
        if not isinstance(figures, Mapping):
            continue
        waiting = _number(figures.get("waiting"))
        if waiting is not None:
            out.gauge("tangram_api_waiting", "Actions waiting for a key of the API.", ["api"]).add_metric(
                [str(api)], waiting
            )
        keys = figures.get("keys")
        if not isinstance(keys, Mapping):
            continue
        for key, k in keys.items():
            if not isinstance(k, Mapping):
                continue
            for field, name, doc, counter in (
                ("tokens", "tangram_api_tokens", "Tokens in the key's bucket.", False),
                ("in_flight", "tangram_api_in_flight", "Requests in flight on the key.", False),
                ("granted", "tangram_api_granted", "Requests granted on the key.", True),
                ("throttled", "tangram_api_throttled", "429s the API answered on the key.", True),
            ):
                number = _number(k.get(field))
                if number is None:
                    continue
                family = (out.counter if counter else out.gauge)(name, doc, ["api", "key"])
                family.add_metric([str(api), str(key)], number)


def _ray_families(out: _Families, ray: Mapping[str, Any]) -> None:
    """The Ray backend: nodes it follows, and what it asked Ray's autoscaler for, and when."""
    nodes = _number(ray.get("nodes"))
    if nodes is not None:
        out.gauge("tangram_ray_nodes", "Live Ray nodes the backend follows.", []).add_metric([], nodes)
    requested = ray.get("requested")
    if isinstance(requested, Mapping):
        family = out.gauge(
            "tangram_ray_requested", "Resources asked of Ray's autoscaler (0: no request).", ["resource"]
        )
        for resource in ("CPU", "GPU"):
            family.add_metric([resource], _number(requested.get(resource)) or 0.0)
    requests = _number(ray.get("requests"))
    if requests is not None:
        out.counter(
            "tangram_ray_autoscaler_requests", "Requests made to Ray's autoscaler (releases included).", []
        ).add_metric([], requests)
    when = _number(ray.get("last_request_at"))
    if when is not None:
        out.gauge(
            "tangram_ray_last_request_timestamp_seconds", "When the last autoscaler request was made.", []
        ).add_metric([], when)


def _worker_families(out: _Families, workers: Mapping[str, Any]) -> None:
    out.gauge(
        "tangram_workers", "Places actions run (the local executor and remote workers).", []
    ).add_metric([], float(len(workers)))
    running = out.gauge("tangram_worker_running_actions", "Actions running on each worker.", ["worker"])
    w_cap = out.gauge(
        "tangram_worker_capacity", "What each worker lends, per resource type.", ["worker", "resource"]
    )
    w_used = out.gauge(
        "tangram_worker_used", "What is granted on each worker, per resource type.", ["worker", "resource"]
    )
    w_util = out.gauge(
        "tangram_worker_utilisation_ratio", "Used over capacity on each worker.", ["worker", "resource"]
    )
    cap_total = dict.fromkeys(RESOURCES, 0.0)
    used_total = dict.fromkeys(RESOURCES, 0.0)
    used_known = False
    for worker_id, info in workers.items():
        if not isinstance(info, Mapping):
            continue
        wid = str(worker_id)
        n = _number(info.get("running"))
        if n is not None:
            running.add_metric([wid], n)
        capacity = _resources(info.get("capacity"))
        used = _resources(info.get("used"))
        used_known = used_known or bool(used)
        for resource, value in capacity.items():
            w_cap.add_metric([wid, resource], value)
            cap_total[resource] += value
        for resource, value in used.items():
            w_used.add_metric([wid, resource], value)
            used_total[resource] += value
            if capacity.get(resource):
                w_util.add_metric([wid, resource], value / capacity[resource])
        figures = info.get("figures")
        if isinstance(figures, Mapping):
            _sandbox_families(out, wid, figures.get("sandboxes"))
            _model_families(out, wid, figures)
    cap = out.gauge("tangram_capacity", "Capacity summed over workers, per resource type.", ["resource"])
    for resource, value in cap_total.items():
        cap.add_metric([resource], value)
    if used_known:  # without per-worker use, a zero would be a claim the figures do not make
        used_g = out.gauge("tangram_used", "Granted resources summed over workers.", ["resource"])
        util = out.gauge("tangram_utilisation_ratio", "Used over capacity, per resource type.", ["resource"])
        for resource, value in used_total.items():
            used_g.add_metric([resource], value)
            if cap_total[resource] > 0:
                util.add_metric([resource], value / cap_total[resource])


_SANDBOX_COUNTERS = ("created", "cold_starts", "warm_hits", "resets", "shrunk", "discarded", "closed")


def _sandbox_families(out: _Families, worker: str, sandboxes: Any) -> None:
    """Pool sizes and pool events from a worker's sandbox figures (``SandboxPool.stats()``)."""
    if not isinstance(sandboxes, Mapping):
        return
    images = sandboxes.get("images")
    if isinstance(images, Mapping):
        pool = out.gauge(
            "tangram_sandbox_pool",
            "Sandboxes per image by state (warm, in_use, target).",
            ["worker", "image", "state"],
        )
        for image, states in images.items():
            if isinstance(states, Mapping):
                for state, count in states.items():
                    number = _number(count)
                    if number is not None:
                        pool.add_metric([worker, str(image), str(state)], number)
    sessions = _number(sandboxes.get("sessions"))
    if sessions is not None:
        out.gauge(
            "tangram_sandbox_sessions", "Open sandbox sessions (trajectories holding a sandbox).", ["worker"]
        ).add_metric([worker], sessions)
    events = out.counter(
        "tangram_sandbox_events",
        "Sandbox pool events: created, cold starts, warm hits, ...",
        ["worker", "event"],
    )
    for key in _SANDBOX_COUNTERS:
        number = _number(sandboxes.get(key))
        if number is not None:
            events.add_metric([worker, key], number)
    reasons = sandboxes.get("discard_reasons")
    if isinstance(reasons, Mapping):
        discards = out.counter(
            "tangram_sandbox_discards", "Sandboxes thrown away, by reason.", ["worker", "reason"]
        )
        for reason, count in reasons.items():
            number = _number(count)
            if number is not None:
                discards.add_metric([worker, str(reason)], number)
    reset_ms = _number(sandboxes.get("reset_ms_mean"))
    if reset_ms is not None:
        out.gauge(
            "tangram_sandbox_reset_ms_mean", "Mean time to reset a sandbox between uses (ms).", ["worker"]
        ).add_metric([worker], reset_ms)


_MODEL_COUNTERS = {
    "loads": ("tangram_model_loads", "Times a reward model was loaded onto a device."),
    "evictions": ("tangram_model_evictions", "Times a loaded reward model was evicted to make room."),
    "load_failures": ("tangram_model_load_failures", "Loads that failed."),
    "ooms": ("tangram_model_ooms", "Out-of-memory errors while loading or scoring."),
}
_MODEL_GAUGES = {
    "replicas": ("tangram_model_replicas", "Ready replicas of each reward model."),
    "memory_mb": ("tangram_model_memory_mb", "Device memory one replica of each model takes (MiB)."),
    "queue_items": ("tangram_model_queue_items", "Items waiting to be scored by each model."),
}
_DEVICE_GAUGES = {
    "used_mb": ("tangram_device_used_mb", "Device memory held by loaded models (MiB)."),
    "budget_mb": ("tangram_device_budget_mb", "Device memory budget for models (MiB)."),
    "busy": ("tangram_device_busy", "1 while the device is scoring a batch."),
}
_PAST_LIMIT = (
    "tangram_device_past_limit_seconds",
    "How long the model call a device runs now has gone on past the time limit of the last request it "
    "serves (0 when idle or within it); its worker exits for a restart past stuck_after_s.",
)


def _model_families(out: _Families, worker: str, figures: Mapping[str, Any]) -> None:
    """Model and device series from a reward-model worker's figures (``GpuRunner.stats()``)."""
    models = figures.get("models")
    if isinstance(models, Mapping):
        for model, m in models.items():
            if not isinstance(m, Mapping):
                continue
            for key, (name, doc) in _MODEL_COUNTERS.items():
                number = _number(m.get(key))
                if number is not None:
                    out.counter(name, doc, ["worker", "model"]).add_metric([worker, str(model)], number)
            for key, (name, doc) in _MODEL_GAUGES.items():
                number = _number(m.get(key))
                if number is not None:
                    out.gauge(name, doc, ["worker", "model"]).add_metric([worker, str(model)], number)
    devices = figures.get("devices")
    if isinstance(devices, list):
        for d in devices:
            if not isinstance(d, Mapping):
                continue
            label = str(d.get("device", "?"))
            for key, (name, doc) in _DEVICE_GAUGES.items():
                number = _number(d.get(key)) if key != "busy" else float(bool(d.get(key)))
                if number is not None:
                    out.gauge(name, doc, ["worker", "device"]).add_metric([worker, label], number)
            running = d.get("running")
            past = _number(running.get("past_limit_s")) if isinstance(running, Mapping) else 0.0
            if past is not None:
                out.gauge(*_PAST_LIMIT, ["worker", "device"]).add_metric([worker, label], past)


class _SnapshotCollector(Collector):
    """Serves the families of the latest snapshot (built on the loop thread, read by HTTP threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: list[Metric] = []

    def replace(self, families: list[Metric]) -> None:
        with self._lock:
            self._families = families

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            return list(self._families)

    def describe(self) -> Iterable[Metric]:
        return []  # the names depend on the figures; no up-front description


class PrometheusExporter:
    """Prometheus series for one orchestrator, on its own registry (so tests can make many)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._act = Histogram(
            "tangram_action_completion_seconds",
            "Action completion time: submit to result.",
            ["kind"],
            registry=self.registry,
            buckets=ACT_BUCKETS,
        )
        self._queued = Histogram(
            "tangram_action_queue_seconds",
            "Time an action waited for resources.",
            ["kind"],
            registry=self.registry,
            buckets=ACT_BUCKETS,
        )
        self._finished = Counter(
            "tangram_actions_finished",
            "Finished actions by kind and outcome.",
            ["kind", "outcome"],
            registry=self.registry,
        )
        self._errors = Counter(
            "tangram_action_errors",
            "Failed actions by kind and error type.",
            ["kind", "reason"],
            registry=self.registry,
        )
        self._snapshot = _SnapshotCollector()
        self.registry.register(self._snapshot)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` over HTTP on ``addr:port`` (port 0 picks a free one); returns the port."""
        if self._server is not None:
            raise RuntimeError("this exporter is already serving")
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port {port} is out of range 0..65535")
        self._server, self._thread = start_http_server(port, addr, registry=self.registry)
        return int(self._server.server_port)

    @property
    def port(self) -> int | None:
        """The port it serves on, or None when not started."""
        return int(self._server.server_port) if self._server is not None else None

    def observe_result(
        self, kind: str, ok: bool, error_type: str | None, act_s: float, queued_s: float
    ) -> None:
        """Count one finished action (called by the loop for every result)."""
        self._act.labels(kind).observe(max(0.0, act_s))
        self._queued.labels(kind).observe(max(0.0, queued_s))
        self._finished.labels(kind, "ok" if ok else "error").inc()
        if not ok:
            self._errors.labels(kind, error_type or "error").inc()

    def update(self, figures: Mapping[str, Any]) -> None:
        """Replace the state series with those of ``figures`` (the dict ``Stats`` returns)."""
        self._snapshot.replace(families_from_figures(figures))

    def stop(self) -> None:
        """Stop the HTTP endpoint (the series stay readable through :attr:`registry`)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)
