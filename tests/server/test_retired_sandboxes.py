"""A kind that puts in its sandbox what agents must not see (a grader's hidden tests) retires it after
use: the sandbox is closed, never reset and lent to another action."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel

from tangram_env import ActionContext, Client
from tangram_env.kinds import KindRegistry, tool
from tangram_env.server.config import ServerSettings
from tangram_env.server.orchestrator import Orchestrator
from tangram_env.server.sandbox import SandboxPool
from tangram_env.server.sandbox.unisolated import UnisolatedProvider
from tests.server.helpers import serving


class Nothing(BaseModel):
    pass


def _registry() -> KindRegistry:
    reg = KindRegistry()

    @tool(name="plain", cpu=0.1, mem_mb=16, timeout_s=30, placement="sandbox", registry=reg)
    def plain(args: Nothing, ctx: ActionContext) -> str:
        return str(ctx.sandbox.id)

    @tool(
        name="grader",
        cpu=0.1,
        mem_mb=16,
        timeout_s=30,
        placement="sandbox",
        retire_sandbox=True,
        registry=reg,
    )
    def grader(args: Nothing, ctx: ActionContext) -> str:
        return str(ctx.sandbox.id)

    return reg


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Orchestrator, SandboxPool]]:
    pool = SandboxPool(UnisolatedProvider(state_dir=str(tmp_path)))
    settings = ServerSettings(bind="tcp://127.0.0.1:0", cpus=2, mem_mb=2048, entry_point_plugins=False)
    with serving(settings, _registry(), pool) as orchestrator:
        yield orchestrator, pool


def test_a_graders_sandbox_is_closed_after_use_and_never_lent_again(
    served: tuple[Orchestrator, SandboxPool],
) -> None:
    # A reset empties files, not every trace a process leaves in the kernel: an audit's grading wrote
    # the grader's test list where the next episode given its reset sandbox read it.
    orchestrator, pool = served
    with Client(orchestrator.address) as client:
        first = client.call("plain")
        assert client.call("plain") == first  # reset and lent again: the pool's usual way
        graded_in = client.call("grader")
        assert pool.stats()["retired"] == 1 and pool.stats()["discarded"] == 0  # not counted as broken
        later = {client.call("plain") for _ in range(3)}
        assert graded_in not in later
