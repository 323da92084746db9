"""Which devices a GPU runner hosts models on, their memory budgets, and torch helpers.

Torch is imported only when it is installed and needed (the core SDK installs without it).
"""

from __future__ import annotations

import glob
import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from typing import Literal

#: Budget of a CPU "device" when none is given: a quarter of physical memory, at most 8 GiB.
CPU_BUDGET_CAP_MB = 8192
#: Share of a CUDA device's memory the runner books for models when no budget is given.
CUDA_BUDGET_FRACTION = 0.9
#: Time constant of a device's utilization estimate (seconds).
UTIL_TAU_S = 3.0


@dataclass
class DeviceSlot:
    """One place models are loaded: a torch device with a memory budget.

    ``name`` is what models get in ``load(device)``; ``label`` is unique within the runner (two CPU
    slots are ``cpu#0`` and ``cpu#1``: simulated devices that share the host's cores and memory).
    The ``host`` lane runs models that need no accelerator (demand ``gpu == 0``); it has no budget,
    and each host-lane model has a slot (a thread) of its own, its ``owner``: one model's slow or
    hung ``score`` then holds up only its own requests.
    """

    index: int
    name: str
    label: str
    budget_mb: float
    lane: Literal["device", "host"] = "device"
    owner: str | None = None  # the one model a host-lane slot serves
    busy: bool = False  # running a batch, loading or unloading
    # What it runs now, for spotting a device stuck in a model's code: the model, "forward" or "load",
    # since when, and the last time limit of the requests waiting on it (None: none waits on it).
    work_of: str = ""
    work_what: str = ""
    work_since: float = 0.0
    work_until: float | None = None
    _util: float = 0.0  # share of recent time busy, as of ``_util_t``
    _util_t: float = 0.0

    def serves(self, lane: str, model: str) -> bool:
        """Whether a model of ``lane`` named ``model`` may be loaded here."""
        return self.lane == lane and self.owner in (None, model)

    def set_busy(self, busy: bool, now: float) -> None:
        """Change state at ``now``, folding the time since the last change into the utilization."""
        self._util = self.utilization(now)
        self._util_t = now
        self.busy = busy

    def past_limit_s(self, now: float) -> float | None:
        """How long its current work has run past the last time limit of the requests waiting on it
        (negative while within it); None when no request waits on what it runs.
        """
        return None if self.work_until is None else now - self.work_until

    def utilization(self, now: float) -> float:
        """Share of the last ``UTIL_TAU_S`` or so seconds the device was busy (exponentially weighted)."""
        decay = math.exp(-max(0.0, now - self._util_t) / UTIL_TAU_S)
        return self._util * decay + (1.0 - decay) * (1.0 if self.busy else 0.0)

    @property
    def is_cuda(self) -> bool:
        """Whether models here live on a CUDA device."""
        return self.name.startswith("cuda")


def torch_available() -> bool:
    """Torch is importable (without importing it)."""
    return "torch" in sys.modules or importlib.util.find_spec("torch") is not None


def _may_have_gpu() -> bool:
    """Cheap test before importing torch: on Linux, GPUs show up as device nodes."""
    if not sys.platform.startswith("linux"):
        return True
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def cuda_devices() -> list[str]:
    """``cuda:0``, ``cuda:1``, ... for every visible CUDA device (none without torch or CUDA)."""
    if not torch_available() or not _may_have_gpu():
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def default_budget_mb(device: str) -> float:
    """Return the memory budget of ``device`` when none is configured."""
    if device.startswith("cuda"):
        import torch

        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        return total / 2**20 * CUDA_BUDGET_FRACTION
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    except (ValueError, OSError, AttributeError):
        physical = 4 * CPU_BUDGET_CAP_MB
    return float(min(CPU_BUDGET_CAP_MB, physical / 4))


def make_slots(devices: list[str] | None, mem_budget_mb: float | None) -> list[DeviceSlot]:
    """Device slots for ``devices`` (default: every CUDA device, else one ``cpu``); host-lane slots
    come with their models (:func:`host_slot`).
    """
    names = list(devices) if devices else (cuda_devices() or ["cpu"])
    for name in names:
        if not (name == "cpu" or name.startswith("cuda")):
            raise ValueError(f"unknown device {name!r}: use 'cpu', 'cuda' or 'cuda:N'")
    if mem_budget_mb is not None and mem_budget_mb <= 0:
        raise ValueError(f"mem_budget_mb must be positive, got {mem_budget_mb}")
    counts = {n: names.count(n) for n in names}
    seen: dict[str, int] = {}
    slots = []
    for i, name in enumerate(names):
        k = seen.get(name, 0)
        seen[name] = k + 1
        label = f"{name}#{k}" if counts[name] > 1 else name
        budget = float(mem_budget_mb) if mem_budget_mb is not None else default_budget_mb(name)
        slots.append(DeviceSlot(i, name, label, budget))
    return slots


def host_slot(index: int, model: str) -> DeviceSlot:
    """The host-lane slot of ``model`` (no accelerator, no memory budget)."""
    return DeviceSlot(index, "cpu", f"host:{model}", float("inf"), lane="host", owner=model)


#: How torch's allocators word running out of memory when they raise a plain ``RuntimeError`` (or,
#: for a CUDA error, ``torch.AcceleratorError``) rather than ``torch.OutOfMemoryError``.
TORCH_OOM_PREFIXES = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED",
    "HIP out of memory",
    "HIP error: out of memory",
    "MPS backend out of memory",
    "XPU out of memory",
    "[enforce fail at alloc_cpu.cpp",  # "... DefaultCPUAllocator: can't allocate memory"
)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` means the device (or host) ran out of memory.

    Decided by the exception's type: a model's error that merely mentions "out of memory" (a
    validation error echoing a client's item, say) must not unload the shared replica, requeue other
    requests' batches and halve the batch limit. Only torch's own ``RuntimeError`` is read, and only
    for the exact start of torch's out-of-memory messages.
    """
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    cuda = getattr(torch, "cuda", None)
    ooms = tuple(
        t
        for t in (getattr(torch, "OutOfMemoryError", None), getattr(cuda, "OutOfMemoryError", None))
        if isinstance(t, type)
    )
    if ooms and isinstance(exc, ooms):
        return True
    plain = (RuntimeError, getattr(torch, "AcceleratorError", RuntimeError))
    return type(exc) in plain and str(exc).startswith(TORCH_OOM_PREFIXES)


def free_device_cache(device: str) -> None:
    """Give cached allocator blocks back after an unload (CUDA only; a no-op elsewhere)."""
    if device.startswith("cuda") and "torch" in sys.modules:
        import torch

        torch.cuda.empty_cache()


def allocated_mb(device: str) -> float:
    """Bytes torch holds allocated on ``device``, in MiB (0 off CUDA)."""
    if not device.startswith("cuda") or "torch" not in sys.modules:
        return 0.0
    import torch

    return float(torch.cuda.memory_allocated(torch.device(device))) / 2**20
