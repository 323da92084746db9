"""The tool cluster tests run on their workers (workers and servers import this module as a plugin)."""

from __future__ import annotations

import os
import time

from pydantic import BaseModel, Field

import tangram_env
from tangram_env import ActionContext

#: Set in each test worker's environment; the forked children that run actions inherit it.
WORKER_ENV = "CLUSTER_TEST_WORKER"


class Mark(BaseModel):
    """Sleep, then record that this action ran (and where) as a file of its own in ``dir``."""

    dir: str
    seconds: float = Field(0.1, ge=0, le=30)


@tangram_env.tool(name="cluster.mark", cpu=0.25, mem_mb=16, timeout_s=20)
def mark(args: Mark, ctx: ActionContext) -> dict[str, object]:
    """Leaves ``<action id>.<pid>.start`` when it begins and ``<action id>.<pid>.done`` when it is
    through, each holding the worker's name and the time. The side effect that counts is ``.done``: it
    comes last, so a run cut short (its worker killed, which kills the run too) leaves only ``.start``."""
    worker = os.environ.get(WORKER_ENV) or os.environ.get("TANGRAM_WORKER_ID", "?")  # the latter: Ray workers
    _leave(args.dir, f"{ctx.action.id}.{os.getpid()}.start", worker)
    time.sleep(args.seconds)
    _leave(args.dir, f"{ctx.action.id}.{os.getpid()}.done", worker)
    return {"worker": worker, "pid": os.getpid()}


def _leave(directory: str, name: str, worker: str) -> None:
    # Written under a hidden name, then renamed: a run killed mid-write leaves no half-written mark.
    hidden = os.path.join(directory, f".{name}")
    fd = os.open(hidden, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, f"{worker}\t{time.time():.6f}\n".encode())
    finally:
        os.close(fd)
    os.rename(hidden, os.path.join(directory, name))
