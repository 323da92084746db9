"""Fixtures for the GPU runner tests: a private kind registry and runners that are always closed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tangram_env.kinds import KindRegistry, RewardModel, reward_model
from tangram_env.server.gpu import GpuRunner


@pytest.fixture
def registry() -> KindRegistry:
    """A registry of the test's own reward models (the process-wide one stays untouched)."""
    return KindRegistry()


@pytest.fixture
def make_runner(registry: KindRegistry) -> Iterator[Callable[..., GpuRunner]]:
    """Build GpuRunners on the test's registry (one CPU device unless told); all closed at the end."""
    runners: list[GpuRunner] = []

    def make(**kwargs: Any) -> GpuRunner:
        kwargs.setdefault("devices", ["cpu"])
        runner = GpuRunner(registry=registry, **kwargs)
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.close()


class Calls:
    """What a test model saw: forward passes (batch size, device), loads and unloads, in order."""

    def __init__(self) -> None:
        self.forwards: list[tuple[int, str]] = []
        self.threads: list[str] = []  # the device thread of each forward pass
        self.loads: list[str] = []
        self.unloads: list[str] = []


@pytest.fixture
def affine_model(registry: KindRegistry) -> Callable[..., Calls]:
    """Register a real torch model, ``score(x) = 2x + 1`` through an ``nn.Linear(1, 1)``.

    Its forward passes are counted by a forward hook. ``load_gate`` (a threading.Event) holds its
    ``load`` until set; ``score_delay_s`` makes each forward slower; ``fail`` maps an item value to
    the exception its batch raises.
    """
    torch = pytest.importorskip("torch")

    def register(
        name: str = "affine",
        *,
        memory_mb: int = 16,
        load_gate: threading.Event | None = None,
        load_delay_s: float = 0.0,
        score_delay_s: float = 0.0,
        fail: dict[float, BaseException] | None = None,
        **options: Any,
    ) -> Calls:
        calls = Calls()
        options.setdefault("gpu", 0.1)

        class Affine(RewardModel):
            def load(self, device: str) -> None:
                if load_gate is not None:
                    load_gate.wait(30)
                time.sleep(load_delay_s)
                net = torch.nn.Linear(1, 1)
                with torch.no_grad():
                    net.weight.fill_(2.0)
                    net.bias.fill_(1.0)
                self.net = net.to(device)
                self.device = device
                self.net.register_forward_hook(
                    lambda _m, args, _out: calls.forwards.append((len(args[0]), device))
                )
                self.net.register_forward_hook(
                    lambda *_: calls.threads.append(threading.current_thread().name)
                )
                calls.loads.append(device)

            def score(self, batch: list[Any]) -> list[float]:
                for value in batch:
                    if fail and value in fail:
                        raise fail[value]
                time.sleep(score_delay_s)
                x = torch.tensor([[float(v)] for v in batch], device=self.device)
                return self.net(x).squeeze(1).tolist()

            def unload(self) -> None:
                calls.unloads.append(self.device)
                self.net = None

        Affine.memory_mb = memory_mb
        Affine.__qualname__ = f"Affine_{name}"
        reward_model(name=name, registry=registry, **options)(Affine)
        return calls

    return register
