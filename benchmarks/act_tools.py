"""Tools for ``benchmarks.act --real``: each sleeps for its work divided by an Amdahl factor of k.

The server imports this module as a plugin (``--plugin benchmarks.act_tools``). Every kind of the
real-mode workload (:func:`benchmarks.act_real.real_workload`) becomes a tool ``act_<kind>`` with
that kind's demand and elasticity; an action's payload carries its hidden work (``t1``, the time on
one unit, and ``parallel``, its parallel fraction), and the tool sleeps
``t1 * ((1 - parallel) + parallel / k)`` where ``k`` is the parallelism the scheduler granted.
Sleeping, not spinning, keeps the run independent of how many physical cores the machine has: the
server lends logical cores (``--cpus``).
"""

from __future__ import annotations

import time

from pydantic import BaseModel, Field

from tangram_env.kinds import ActionContext, tool


class Work(BaseModel):
    """Hidden work of one simulated action."""

    t1: float = Field(ge=0, le=600, description="seconds on one unit")
    parallel: float = Field(0.0, ge=0, le=1, description="Amdahl parallel fraction")


def work(args: Work, ctx: ActionContext) -> int:
    """Sleep for the work at the granted parallelism; return that parallelism."""
    k = max(1, ctx.parallelism)
    time.sleep(args.t1 * ((1 - args.parallel) + args.parallel / k))
    return k


def tool_name(kind: str) -> str:
    """The tool that plays workload kind ``kind``."""
    return f"act_{kind}"


def _register() -> None:
    from benchmarks.act_real import real_workload

    for kind in real_workload().kinds.values():
        d = kind.demand
        tool(
            name=tool_name(kind.name),
            cpu=d.cpu,
            mem_mb=int(d.mem_mb),
            timeout_s=120.0,
            min_par=kind.min_par,
            max_par=kind.max_par,
            description=f"simulated {kind.name} (benchmarks.act --real)",
        )(work)


_register()
