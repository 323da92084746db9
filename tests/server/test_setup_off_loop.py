"""Sandbox set-up runs off the orchestrator's loop: a slow provider delays only its own actions."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from tangram_env import Action, ActionContext, Client
from tangram_env.kinds import KindRegistry, tool
from tangram_env.sandbox import Sandbox, SandboxSpec
from tangram_env.server.config import ServerSettings
from tangram_env.server.orchestrator import Orchestrator
from tangram_env.server.sandbox import SandboxPool
from tangram_env.server.sandbox.unisolated import UnisolatedProvider
from tests.server.helpers import serving

CREATE_S = 0.5


class SlowProvider:
    """A real provider whose every create takes ``CREATE_S`` longer (a cold cloud or Docker start)."""

    name = "slow"

    def __init__(self, inner: UnisolatedProvider) -> None:
        self.inner = inner
        self.creates = 0

    def create(self, spec: SandboxSpec) -> Sandbox:
        self.creates += 1
        time.sleep(CREATE_S)
        return self.inner.create(spec)

    def close(self) -> None:
        self.inner.close()


class Nothing(BaseModel):
    pass


def _registry() -> KindRegistry:
    reg = KindRegistry()

    @tool(name="noop", cpu=0, mem_mb=0, timeout_s=1, placement="inline", registry=reg)
    def noop(args: Nothing) -> None:
        return None

    @tool(name="in_sandbox", cpu=0.1, mem_mb=16, timeout_s=30, placement="sandbox", registry=reg)
    def in_sandbox(args: Nothing, ctx: ActionContext) -> str:
        return str(ctx.sandbox.exec("echo hi").stdout).strip()

    return reg


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Orchestrator, SlowProvider]]:
    provider = SlowProvider(UnisolatedProvider(state_dir=str(tmp_path)))
    settings = ServerSettings(bind="tcp://127.0.0.1:0", cpus=2, mem_mb=2048, entry_point_plugins=False)
    with serving(settings, _registry(), SandboxPool(provider)) as orchestrator:
        yield orchestrator, provider


def test_no_ops_of_another_client_flow_while_sandboxes_start_cold(
    served: tuple[Orchestrator, SlowProvider],
) -> None:
    orchestrator, provider = served
    with Client(orchestrator.address) as starter, Client(orchestrator.address) as other:
        assert other.call("noop") is None  # connected and warm
        cold = [Action(kind="in_sandbox", affinity=f"session-{i}") for i in range(8)]
        t0 = time.monotonic()
        futures = starter.submit(cold)
        rtts: list[float] = []
        while not all(f.done() for f in futures):
            t = time.monotonic()
            other.call("noop")
            rtts.append(time.monotonic() - t)
        results: list[Any] = [f.result(30) for f in futures]
        elapsed = time.monotonic() - t0
    assert all(r.ok and r.value == "hi" for r in results), results
    assert provider.creates == 8 and min(r.timing.setup_s for r in results) >= CREATE_S * 0.9
    # The loop never waited for a create (generous bounds, not a benchmark): with creates on the loop,
    # each of the 8 would hold every no-op for 0.5 s, and only a handful would get through. One slow
    # round trip is allowed for a busy machine's own hiccups.
    rtts.sort()
    slow = [r for r in rtts if r >= CREATE_S * 0.8]
    assert len(rtts) > 20 and rtts[len(rtts) // 2] < CREATE_S / 10, (len(rtts), slow)
    assert len(slow) <= 1 and rtts[-1] < 2 * CREATE_S, slow
    assert elapsed < 8 * CREATE_S  # creates of different sessions overlap, on the set-up threads


def test_a_session_that_holds_its_sandbox_does_not_queue_behind_cold_starts(
    served: tuple[Orchestrator, SlowProvider],
) -> None:
    orchestrator, provider = served
    with Client(orchestrator.address) as client:
        warm = Action(kind="in_sandbox", affinity="warm-session")
        assert client.submit([warm])[0].result(30).value == "hi"  # the session now holds its sandbox
        # Twelve cold starts fill every set-up thread (4) for about 1.5 s.
        cold = client.submit([Action(kind="in_sandbox", affinity=f"cold-{i}") for i in range(12)])
        time.sleep(0.1)
        t0 = time.monotonic()
        again = client.submit([Action(kind="in_sandbox", affinity="warm-session")])[0].result(30)
        waited = time.monotonic() - t0
        assert again.ok and again.value == "hi"
        assert not all(f.done() for f in cold)  # the cold starts were still under way
        assert all(f.result(30).ok for f in cold)
    # Generous: behind the set-up threads it would wait for at least one create (0.5 s).
    assert waited < CREATE_S * 0.8, waited
    assert provider.creates == 13
