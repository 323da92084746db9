"""e2b through the orchestrator: at capacity (429, 503) the action waits and gets its real result; a
warm sandbox, billed while it lives, is kept only for about its creation time."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from tangram_env import Action, ActionContext, Client
from tangram_env.kinds import KindRegistry, tool
from tangram_env.server.config import ServerSettings
from tangram_env.server.sandbox import SandboxPool
from tests.server.helpers import serving
from tests.server.sandbox.fake_e2b import FakeE2B, fake_e2b

pytest.importorskip("e2b", reason="the e2b extra is not installed")
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="the fake runs commands under bwrap")


class Nothing(BaseModel):
    pass


def _registry() -> KindRegistry:
    reg = KindRegistry()

    @tool(name="in_e2b", cpu=0.1, mem_mb=16, timeout_s=60, placement="sandbox", registry=reg)
    def in_e2b(args: Nothing, ctx: ActionContext) -> str:
        return str(ctx.sandbox.exec("echo real work").stdout).strip()

    return reg


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, FakeE2B]]:
    from tangram_env.server.sandbox.e2b_provider import E2BProvider

    with fake_e2b() as (url, state):
        monkeypatch.setenv("E2B_SANDBOX_URL", url)
        monkeypatch.setenv("E2B_CONNECTION_RETRIES", "0")
        # The SDK retries 429/503 itself (3 times by default, with its own waits): off here, so that
        # each refusal reaches the provider and the orchestrator's back-off is what is tested.
        provider = E2BProvider(api_key="e2b_test", api_url=url, request_timeout_s=10, retries=0)
        settings = ServerSettings(
            bind="tcp://127.0.0.1:0",
            cpus=2,
            mem_mb=2048,
            entry_point_plugins=False,
            sandbox_busy_wait_s=0.2,
            sandbox_busy_max_wait_s=0.4,
            sandbox_busy_tries=3,
        )
        try:
            with serving(settings, _registry(), SandboxPool(provider)) as orchestrator:
                yield orchestrator, state
        finally:
            provider.close()


def test_429_then_200_gives_the_action_its_real_result(served: tuple[Any, FakeE2B]) -> None:
    orchestrator, state = served
    state.create_statuses = [429, 503]  # e2b refuses twice, then makes the sandboxes
    earlier = set(helpers())  # other tests' providers, left open, keep theirs
    with Client(orchestrator.address) as client:
        futures = client.submit([Action(kind="in_e2b", affinity=f"trajectory-{i}") for i in range(3)])
        results = [f.result(60) for f in futures]
        figures = client.stats()
    assert all(r.ok and r.value == "real work" for r in results), results
    assert not state.create_statuses and len(state.sandboxes) == 3
    assert figures["sandbox_busy"] == {"retries": 2, "backing_off": 0, "given_up": 0}
    assert "sandbox_died" not in figures["errors"] and "throttled" not in figures["errors"]
    # e2b's sandboxes use none of this host's memory: nothing is reserved for the live session.
    assert figures["sandbox_memory"]["live_sessions"] == 3 and figures["sandbox_memory"]["lent_mb"] == 0
    assert len(set(helpers()) - earlier) == 1  # one SDK process, whichever set-up thread needed it first


def helpers() -> list[str]:
    """The e2b helper processes this test process started."""
    import subprocess

    out = subprocess.run(
        ["pgrep", "-P", str(os.getpid()), "-f", "e2b_helper"], capture_output=True, text=True
    )
    return out.stdout.split()


def test_a_provider_that_stays_busy_fails_the_action_as_infrastructure(served: tuple[Any, FakeE2B]) -> None:
    orchestrator, state = served
    state.status_for_create = 429
    with Client(orchestrator.address) as client:
        result = client.submit([Action(kind="in_e2b", affinity="trajectory-2")])[0].result(60)
        figures = client.stats()
    assert not result.ok and result.error_type == "sandbox_died"
    assert "at capacity through 3 tries" in result.message and "429" in result.message
    # The client retries a sandbox_died once (its default): two rounds of three refusals each.
    assert figures["sandbox_busy"] == {"retries": 6, "backing_off": 0, "given_up": 2}


def test_a_warm_e2b_sandbox_is_kept_only_for_its_creation_time(served: tuple[Any, FakeE2B]) -> None:
    # e2b bills a sandbox for every second it lives, warm or busy. Kept until the next session came
    # (minutes, between RL steps), each would be billed all that time to save one creation.
    orchestrator, state = served
    state.create_delay_s = 0.5
    with Client(orchestrator.address) as client:
        assert client.submit([Action(kind="in_e2b", affinity="S")])[0].result(60).value == "real work"
        client.close_sessions(["S"])
        deadline = time.monotonic() + 20
        while state.sandboxes:  # reset and kept warm, then killed once it has waited its creation time
            assert time.monotonic() < deadline, (state.sandboxes, client.stats()["sandbox_images"])
            time.sleep(0.05)
        keep_s = client.stats()["sandbox_images"]["default"]["keep_s"]
    assert keep_s is not None and 0.5 <= keep_s < 5.0, keep_s  # the measured creation, not "until taken"
    assert len(state.killed) == 2  # the one it ran in at its reset (a fresh one replaces it), then that
