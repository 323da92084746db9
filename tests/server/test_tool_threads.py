"""The project's sandbox tools run on a thread of the orchestrator (no fork of it per action) on every
sandbox whose exec is bounded; a user's tool still runs in a forked child. Real servers, real sandboxes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import tangram_env.shell_tools  # noqa: F401  (registers the project's bash)
from tangram_env import Action, ActionContext, Client
from tangram_env.kinds import KindRegistry, kind_registry, tool
from tangram_env.protocol import Resources
from tangram_env.server.config import ServerSettings
from tangram_env.server.orchestrator import Orchestrator
from tangram_env.server.sandbox import SandboxPool
from tangram_env.server.sandbox.local import LocalProvider
from tangram_env.server.sandbox.unisolated import UnisolatedProvider
from tests.server.helpers import serving
from tests.server.sandbox.helpers import processes_running


class Nothing(BaseModel):
    pass


def _registry() -> KindRegistry:
    reg = KindRegistry()

    @tool(name="parent_of_command", cpu=0.1, mem_mb=16, timeout_s=30, placement="sandbox", registry=reg)
    def parent_of_command(args: Nothing, ctx: ActionContext) -> int:
        return int(ctx.sandbox.exec("echo $PPID").stdout)

    reg.add(kind_registry.get("bash"))  # the project's own: trusted to run on a thread
    # The same, declared small: the capacity grants a dozen at once (a client may not ask for less
    # than a kind declares).
    small = Resources(cpu=0.05, mem_mb=16)
    reg.add(dataclasses.replace(kind_registry.get("bash"), name="small_bash", demand=small))
    return reg


def _serve(provider: Any) -> Iterator[Orchestrator]:
    settings = ServerSettings(bind="tcp://127.0.0.1:0", cpus=2, mem_mb=4096, entry_point_plugins=False)
    with serving(settings, _registry(), SandboxPool(provider)) as orchestrator:
        yield orchestrator


@pytest.fixture
def unisolated(tmp_path: Path) -> Iterator[Orchestrator]:
    yield from _serve(UnisolatedProvider(state_dir=str(tmp_path)))


@pytest.fixture
def local_without_agent(tmp_path: Path) -> Iterator[Orchestrator]:
    yield from _serve(LocalProvider(state_dir=str(tmp_path), exec_agent=False))


def test_trusted_tools_run_on_a_thread_and_others_in_a_child(unisolated: Orchestrator) -> None:
    with Client(unisolated.address) as client:
        trusted, untrusted = client.submit(
            [
                Action(kind="bash", payload={"command": "echo $PPID"}, affinity="ppid"),
                Action(kind="parent_of_command", affinity="ppid-2"),
            ]
        )
        # A command of the project's bash is spawned by the orchestrator's own process; a user's
        # tool runs in a forked child, which spawns the command.
        assert int(trusted.result(30).value["stdout"]) == os.getpid()
        assert untrusted.result(30).value not in (os.getpid(), 0)


def test_when_every_tool_thread_is_busy_the_next_actions_fork_rather_than_wait(
    unisolated: Orchestrator,
) -> None:
    threads = 8  # the executor's tool threads for 2 cores (see LocalRunner)
    with Client(unisolated.address) as client:
        futures = client.submit(
            [
                Action(kind="small_bash", payload={"command": "sleep 1.5; echo $PPID"}, affinity=f"b{i}")
                for i in range(threads + 4)
            ]
        )
        results = [f.result(60) for f in futures]
    assert all(r.ok for r in results), results
    parents = [int(r.value["stdout"]) for r in results]
    assert parents.count(os.getpid()) == threads, parents
    # None waited for a thread, nor for a forked sibling to drop its copy of its command's pipes.
    assert max(r.timing.run_s for r in results) < 2 * 1.5, [r.timing for r in results]


def test_on_a_thread_the_time_limit_still_kills_the_command(unisolated: Orchestrator) -> None:
    with Client(unisolated.address) as client:
        action = Action(kind="bash", payload={"command": "sleep 43.75"}, affinity="slow", timeout_s=2.5)
        t0 = time.monotonic()
        result = client.submit([action])[0].result(30)
        waited = time.monotonic() - t0
    assert result.ok and result.value["killed_by"] == "timeout", result
    assert waited < 3.5
    time.sleep(0.2)
    assert not processes_running("sleep 43.75")


def test_local_sandboxes_without_an_agent_run_the_tools_on_threads(local_without_agent: Orchestrator) -> None:
    with Client(local_without_agent.address) as client:
        slow = client.submit(
            [Action(kind="bash", payload={"command": "sleep 44.5"}, affinity="slow", timeout_s=4)]
        )[0]
        deadline = time.monotonic() + 10
        while not (running := processes_running("sleep 44.5")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running
        # Its bubblewrap is a child of the orchestrator's process, not of a forked action child.
        spawned_here = [pid for pid in processes_running("sleep 44.5") if _parent(pid) == os.getpid()]
        assert spawned_here, running
        parallel = client.submit(
            [
                Action(kind="bash", payload={"command": f"echo {i} > mine; cat mine"}, affinity=f"s{i}")
                for i in range(4)
            ]
        )
        assert [f.result(30).value["stdout"] for f in parallel] == [f"{i}\n" for i in range(4)]
        result = slow.result(30)
    assert result.ok and result.value["killed_by"] == "timeout", result
    time.sleep(0.2)
    assert not processes_running("sleep 44.5")


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("PPid:"))
