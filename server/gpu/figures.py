"""The figures a GPU runner reports in ``stats()``: per model and per device (plain JSON-able data)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tangram_env.server.gpu.devices import DeviceSlot
from tangram_env.server.gpu.models import ModelEntry


def model_figures(m: ModelEntry, labels: Mapping[int, str]) -> dict[str, Any]:
    """One model's state and counters (``labels``: device slot index -> its label)."""
    s = m.stats
    return {
        "loaded_on": sorted(labels[i] for i, r in m.replicas.items() if r.ready),
        "loading_on": sorted(labels[i] for i, r in m.replicas.items() if not r.ready),
        "replicas": m.ready_replicas(),
        "queue_items": m.queue.queued_items(),
        "queue_actions": m.queue.queued_jobs(),
        "memory_mb": round(m.memory_mb, 1),
        "max_batch": m.max_batch,
        "loads": s.loads,
        "load_failures": s.load_failures,
        "evictions": s.evictions,
        "retirements": s.retirements,
        "load_s": round(s.load_s, 4),
        "last_load_s": round(s.last_load_s, 4),
        "unload_s": round(s.unload_s, 4),
        "batches": s.batches,
        "items": s.items,
        "mean_batch": round(s.items / s.batches, 2) if s.batches else 0.0,
        "max_batch_seen": s.max_batch_seen,
        "errors": s.errors,
        "ooms": s.ooms,
        "score_s": round(s.score_s, 4),
    }


def device_figures(slot: DeviceSlot, models: Mapping[str, ModelEntry], now: float) -> dict[str, Any]:
    """One device slot: its budget, the memory its models hold, whether it is busy, and how busy lately;
    while it runs a model's forward pass or load, which and for how long (``running``).
    """
    here = {name: m.replicas[slot.index] for name, m in models.items() if slot.index in m.replicas}
    running = None
    if (past := slot.past_limit_s(now)) is not None:
        running = {
            "model": slot.work_of,
            "what": slot.work_what,
            "for_s": round(now - slot.work_since, 3),
            "past_limit_s": round(max(0.0, past), 3),
        }
    return {
        "device": slot.label,
        "torch_device": slot.name,
        "lane": slot.lane,
        "budget_mb": None if slot.lane == "host" else round(slot.budget_mb, 1),
        "used_mb": round(sum(r.memory_mb for r in here.values()), 1),
        "busy": slot.busy,
        "utilization": round(slot.utilization(now), 3),
        "models": sorted(here),
        "running": running,
    }
