"""Tools the test suite registers; test servers import this module as a plugin."""

from __future__ import annotations

import os
import time

from pydantic import BaseModel, Field

import tangram_env
from tangram_env import ActionContext


class Touch(BaseModel):
    """Append a line to a file: a side effect the tests can count."""

    path: str
    line: str


@tangram_env.tool(name="test.touch", cpu=0.25, mem_mb=16, timeout_s=10)
def touch(args: Touch) -> str:
    """Append ``line`` to ``path`` and return it (counts how often an action ran)."""
    with open(args.path, "a") as f:
        f.write(args.line + "\n")
    return args.line


class Spawn(BaseModel):
    """Start a grandchild that outlives its parent unless the process group is killed."""

    pidfile: str
    seconds: float = Field(30, ge=0)


@tangram_env.tool(name="test.spawn_and_hang", cpu=0.25, mem_mb=16, timeout_s=1)
def spawn_and_hang(args: Spawn) -> None:
    """Fork a grandchild that records its pid, then hang: the timeout must kill both."""
    pid = os.fork()
    if pid == 0:
        with open(args.pidfile, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(args.seconds)
        os._exit(0)
    time.sleep(args.seconds)


class Exit(BaseModel):
    """How to die."""

    code: int = 3


@tangram_env.tool(name="test.exit", cpu=0.25, mem_mb=16, timeout_s=5)
def hard_exit(args: Exit) -> None:
    """Leave the interpreter without a result."""
    os._exit(args.code)


class Boom(BaseModel):
    """What to raise."""

    message: str = "boom"


@tangram_env.tool(name="test.raise", cpu=0.25, mem_mb=16, timeout_s=5)
def boom(args: Boom) -> None:
    """Raise ValueError."""
    raise ValueError(args.message)


class Par(BaseModel):
    """No arguments."""


@tangram_env.tool(name="test.grant", cpu=0.5, mem_mb=16, timeout_s=5, max_par=4)
def grant(args: Par, ctx: ActionContext) -> dict[str, object]:
    """Report the grant it ran with."""
    return {"parallelism": ctx.parallelism, "cores": list(ctx.cores), "affinity": sorted(os.sched_getaffinity(0))}
