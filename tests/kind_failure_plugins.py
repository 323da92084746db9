"""Tools that fail in the ways a user's tool can, for tests/test_kind_failures.py (a server plugin)."""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict

import tangram_env
from tangram_env.kinds import kind_registry


class Wait(BaseModel):
    seconds: float = 0.0


@tangram_env.tool(name="kf.wait", cpu=0.1, mem_mb=16, timeout_s=30)
def wait(args: Wait) -> str:
    time.sleep(args.seconds)
    return "done"


@tangram_env.tool(name="kf.no_limit", cpu=0.1, mem_mb=16, timeout_s=30)
def no_limit(args: Wait) -> str:
    return "never runs"


# A limit no grant can take, as a spec built around registration's checks holds it.
object.__setattr__(kind_registry.get("kf.no_limit"), "timeout_s", float("nan"))


@tangram_env.tool(name="kf.int_keys", cpu=0.1, mem_mb=16, timeout_s=10)
def int_keys(args: Wait) -> dict[str, object]:
    return {"lengths": {1: 2, 3: 1}}


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() of this exception fails")


@tangram_env.tool(name="kf.bad_str", cpu=0.1, mem_mb=16, timeout_s=10)
def bad_str(args: Wait) -> None:
    raise BadStr()


@tangram_env.tool(name="kf.huge_message", cpu=0.1, mem_mb=512, timeout_s=30)
def huge_message(args: Wait) -> None:
    raise ValueError("y" * (100 << 20))


class Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")
    n: int = 0


@tangram_env.tool(name="kf.loose", cpu=0.1, mem_mb=16, timeout_s=10)
def loose(args: Loose) -> int:
    return args.n
