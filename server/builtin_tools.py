"""Tools every orchestrator serves: trivial ones for health checks and benchmarks."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, Field

from tangram_env.kinds import tool


class NoopArgs(BaseModel):
    """No arguments."""


@tool(name="noop", cpu=0, mem_mb=0, timeout_s=1, placement="inline")
def noop(args: NoopArgs) -> None:
    """Do nothing (measures the orchestrator's own overhead)."""
    return None


class EchoArgs(BaseModel):
    """Anything to send back."""

    value: Any = None


@tool(name="echo", cpu=0, mem_mb=0, timeout_s=1, placement="inline")
def echo(args: EchoArgs) -> Any:
    """Return the value it was given."""
    return args.value


class SleepArgs(BaseModel):
    """How long to sleep."""

    seconds: float = Field(ge=0, le=3600)


@tool(name="sleep", cpu=0.1, mem_mb=16, timeout_s=3600)
def sleep(args: SleepArgs) -> float:
    """Sleep in a child process, holding a tenth of a core (tests and benchmarks)."""
    time.sleep(args.seconds)
    return args.seconds
