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


class Size(BaseModel):
    """How many bytes of text to return."""

    n: int = Field(ge=0)


@tangram_env.tool(name="test.text", cpu=0.25, mem_mb=64, timeout_s=10)
def text(args: Size) -> str:
    """``n`` bytes of text (a result as large as the caller asks)."""
    return "x" * args.n


class Par(BaseModel):
    """No arguments."""


@tangram_env.tool(name="test.grant", cpu=0.5, mem_mb=16, timeout_s=5, max_par=4)
def grant(args: Par, ctx: ActionContext) -> dict[str, object]:
    """Report the grant it ran with."""
    return {
        "parallelism": ctx.parallelism,
        "cores": list(ctx.cores),
        "affinity": sorted(os.sched_getaffinity(0)),
    }


class EchoEnv(tangram_env.TangramEnv[int, int]):
    """A tiny env for protocol tests: each step echoes (env tag, step, action) through the orchestrator
    and, with ``fork=True``, also runs a forked tool; the reward says whether the echo came back intact."""

    def __init__(
        self, tag: str = "", fork: bool = False, rounds: int = 1, sleep_s: float = 0.0, **kwargs: object
    ) -> None:
        import gymnasium

        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.tag = tag
        self.fork = fork or sleep_s > 0
        self.rounds = rounds
        self.sleep_s = sleep_s  # each reset and step runs a sleep this long (a call to cut short)
        self.observation_space = gymnasium.spaces.Discrete(1000)
        self.action_space = gymnasium.spaces.Discrete(10)
        self.t = 0
        self.mismatches: list[object] = []

    def _reset(self, *, seed, options):  # type: ignore[no-untyped-def]
        self.t = 0
        if self.sleep_s:
            yield [tangram_env.Action(kind="sleep", payload={"seconds": self.sleep_s})]
        return 0, {"tag": self.tag}

    def _step(self, action):  # type: ignore[no-untyped-def]
        self.t += 1
        for r in range(self.rounds):  # several rounds of actions within one step
            expected = [self.tag, self.t, int(action), r]
            batch = [tangram_env.Action(kind="echo", payload={"value": expected})]
            if self.fork:
                batch.append(tangram_env.Action(kind="sleep", payload={"seconds": self.sleep_s}))
            results = yield batch
            if not results[0].ok or results[0].value != expected or not all(x.ok for x in results):
                self.mismatches.append((expected, [x.value for x in results]))
        ok = not self.mismatches
        return self.t % 1000, float(ok), False, self.t >= 5, {"tag": self.tag}


@tangram_env.reward_model(name="test.judge", max_batch=8)
def judge(items: list[str]) -> list[float]:
    """Score 1.0 for "good", 0.0 otherwise; a model that fails (raises) on "crash"."""
    if "crash" in items:
        raise RuntimeError("the reward model failed")
    return [1.0 if item == "good" else 0.0 for item in items]


class JudgedEnv(tangram_env.TangramEnv[str, str]):
    """One-step env whose reward comes from the ``test.judge`` reward model, read with ``graded``."""

    def __init__(self, **kwargs: object) -> None:
        import gymnasium

        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.observation_space = gymnasium.spaces.Text(16, min_length=0)
        self.action_space = gymnasium.spaces.Text(16, min_length=0)

    def _reset(self, *, seed, options):  # type: ignore[no-untyped-def]
        return "say it", {}
        yield []

    def _step(self, action):  # type: ignore[no-untyped-def]
        (result,) = yield [tangram_env.Action(kind="test.judge", payload={"items": [action]})]
        (score,) = tangram_env.graded(result, "the reward model")
        return "done", score, True, False, {}


class SessionJudgedEnv(JudgedEnv):
    """:class:`JudgedEnv` whose step first runs a command in the episode's sandbox session: an episode
    that holds a sandbox, graded by a reward model that fails on "crash".
    """

    def _step(self, action):  # type: ignore[no-untyped-def]
        (ran,) = yield [
            tangram_env.Action(kind="bash", payload={"command": "true"}, affinity=self.session_id)
        ]
        tangram_env.graded(ran, "the sandbox")
        return (yield from super()._step(action))
