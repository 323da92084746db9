"""``TangramEnv``: a gymnasium Env whose steps run as actions on an orchestrator.

Subclasses write ``_reset`` and ``_step`` as generators: they ``yield`` a list of actions, get their
results back (in the same order; a failure is a result with ``ok=False``, never an exception) and finally
``return`` the usual reset/step tuple. The base class drives them one env at a time here, or many at
once in :class:`~tangram_env.vector.TangramVectorEnv`, where every env's actions go out together.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import sys
import uuid
from collections.abc import Generator, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any, Generic, TypeVar, overload

import gymnasium
import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import read_from_shared_memory

from tangram_env.errors import (
    AlreadyPendingCallError,
    ClosedEnvError,
    NoAsyncCallError,
    RewardUnavailable,
    did_you_mean,
)
from tangram_env.protocol import Action, Result
from tangram_env.rewards import INVALID_REWARD, InvalidRewardPolicy, check_policy, flagged_info

T = TypeVar("T")
ObsType = TypeVar("ObsType")
ActType = TypeVar("ActType")

# Why step() refuses to go on (see ``TangramEnv.needs_reset``).
EPISODE_ENDED = "the episode has ended (a step returned terminated or truncated): call reset() before step()"
RESET_UNFINISHED = "the last reset did not finish (it failed or was cancelled): call reset() again"
STEP_UNFINISHED = (
    "the last step did not finish (it failed, was cancelled or timed out, and its actions may have run): "
    "call reset() before step()"
)

#: What ``_reset``/``_step`` are: yield actions, receive results, return the reset/step tuple.
EnvGen = Generator[list[Action], list[Result], T]


class AsyncState(enum.Enum):
    """Which async call, if any, an env is waiting on."""

    DEFAULT = "default"
    WAITING_RESET = "reset"
    WAITING_STEP = "step"


class Driver(Generic[T]):
    """Advances one ``_reset``/``_step`` generator: ``actions`` are outstanding until ``feed``."""

    def __init__(
        self, env: TangramEnv[Any, Any], gen: EnvGen[T], finish: Any = None, is_step: bool = False
    ) -> None:
        self.env = env
        self._gen = gen
        self._finish = finish
        self._is_step = is_step
        self.actions: list[Action] = []
        self.results: list[Result] = []  # every result this call received, for reporting
        self.done = False
        self.value: T | None = None
        self._advance(None)

    def _advance(self, results: list[Result] | None) -> None:
        while True:
            try:
                actions = next(self._gen) if results is None else self._gen.send(results)
            except StopIteration as stop:
                self.done, self.actions = True, []
                self.value = self._finish(stop.value, self.results) if self._finish else stop.value
                return
            except RewardUnavailable as error:
                if not self._is_step or self.env.invalid_reward == "raise":
                    raise
                self.done, self.actions = True, []
                self.value = self.env._flagged_step(error, self.results)
                return
            if actions:
                self.actions = [self.env._stamp(a) for a in actions]
                return
            results = []  # nothing to run: answer at once

    def feed(self, results: list[Result]) -> None:
        """Give the outstanding actions' results (same order) and advance to the next yield or return."""
        if self.env._closed:  # its session ended under the actions: their results are not the task's
            raise ClosedEnvError("the env was closed while this call ran")
        self.results.extend(results)
        self._advance(results)

    def run(self) -> T:
        """Drive to completion through the env's client, one batch of actions at a time."""
        while not self.done:
            futures = self.env.client.submit(self.actions)
            self.env._sync_wait = (futures, self.actions)  # close() on another thread wakes these
            try:
                results = [f.result() for f in futures]
            finally:
                self.env._sync_wait = None
            self.feed(results)
        return self.value  # type: ignore[return-value]

    async def arun(self, client: Any) -> T:
        """Drive to completion through an :class:`~tangram_env.aio.AsyncClient`, without blocking the loop."""
        if not self.done:
            self.env._session_aclient = client  # its socket owns the session now: it must end it too
        while not self.done:
            # A task of its own, so that close() can cancel the wait (and, through gather's cancel
            # path, the actions not started) without cancelling the caller's task.
            waiting = asyncio.ensure_future(client.gather(self.actions))
            self.env._async_wait = (asyncio.get_running_loop(), waiting, client, self.actions)
            try:
                results = await waiting
            except asyncio.CancelledError:
                task = asyncio.current_task()
                cancelling = getattr(task, "cancelling", lambda: 0)()  # Python 3.11+: the caller's own cancel
                if self.env._closed and not cancelling:
                    raise ClosedEnvError("the env was closed while this call ran") from None
                raise
            finally:
                self.env._async_wait = None
            self.feed(results)
        return self.value  # type: ignore[return-value]


def action_report(results: list[Result]) -> list[dict[str, Any]]:
    """Per action of a step: kind-free timing summary for ``info["actions"]``."""
    return [
        {
            "id": r.action_id,
            "ok": r.ok,
            "act_s": r.timing.act_s,
            "queued_s": r.timing.queued_s,
            "setup_s": r.timing.setup_s,
            "run_s": r.timing.run_s,
            "parallelism": r.parallelism,
            **({"error_type": r.error_type, "message": r.message} if not r.ok else {}),
        }
        for r in results
    ]


class TangramEnv(gymnasium.Env[ObsType, ActType]):
    """Base class of environments whose work runs on a Tangram orchestrator.

    Keyword arguments: ``address`` (orchestrator; default ``TANGRAM_ADDRESS``, else embedded),
    ``client`` (share one :class:`~tangram_env.client.Client` between envs), ``max_episode_steps``
    (truncate after that many steps), ``invalid_reward`` (``"raise"`` or ``"flag"``: what a step
    whose reward could not be determined does; see :mod:`tangram_env.rewards`).
    """

    # None here: gymnasium's checker renders each declared mode, and a subclass declares "ansi" along
    # with the render() that serves it.
    metadata: dict[str, Any] = {"render_modes": []}
    #: The keys ``reset(options=...)`` takes (None: any). A misspelt key must not pass for no key: the
    #: episode would get a random task, and a group of samples meant to share one would not.
    reset_options: frozenset[str] | None = None

    def __init__(
        self,
        *,
        address: str | None = None,
        client: Any = None,
        max_episode_steps: int | None = None,
        render_mode: str | None = None,
        invalid_reward: InvalidRewardPolicy = "raise",
    ) -> None:
        self.invalid_reward = check_policy(invalid_reward)
        self._address = address
        self._given_aclient: Any = None
        if hasattr(client, "sync"):  # an AsyncClient: astep uses it, step its sync client
            self._given_aclient, client = client, client.sync
        self._client = client
        self._owns_client = client is None
        self.max_episode_steps = max_episode_steps
        self.render_mode = render_mode
        self.session_id: str | None = None
        self._session_aclient: Any = None  # the AsyncClient whose socket carried this session, if any
        self.trajectory_id: str | None = None
        self.elapsed_steps = 0
        # Why step() must wait for reset(), if it must: a step past the end of an episode, or after a
        # reset or step that never finished, would be graded on a state nobody saw through.
        self._stop_reason: str | None = None
        self._last_obs: Any = None
        self._closed = False
        self._async_state = AsyncState.DEFAULT
        self._async_loop: asyncio.AbstractEventLoop | None = None  # the loop of an areset/astep running
        self._async_driver: Driver[Any] | None = None
        self._async_futures: list[Future[Result]] = []
        # What an areset/astep awaits now (its loop, the wait, the client, the actions): close() ends it.
        self._async_wait: tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Any, list[Action]] | None
        self._async_wait = None
        # What a sync reset/step awaits now (its futures and actions): close() on another thread ends it.
        self._sync_wait: tuple[list[Future[Result]], list[Action]] | None = None

    # --- what subclasses write --------------------------------------------------------------------
    def _reset(
        self, *, seed: int | None, options: dict[str, Any] | None
    ) -> EnvGen[tuple[ObsType, dict[str, Any]]]:
        raise NotImplementedError
        yield []

    def _step(self, action: ActType) -> EnvGen[tuple[ObsType, float, bool, bool, dict[str, Any]]]:
        raise NotImplementedError
        yield []

    def _close(self) -> None:
        """Free what the subclass holds (called once, from :meth:`close`)."""

    # --- gymnasium API ----------------------------------------------------------------------------
    @property
    def client(self) -> Any:
        """The orchestrator connection (created on first use)."""
        if self._client is None:
            self._check_open()
            from tangram_env.client import Client

            self._client = Client(self._address)
        return self._client

    @property
    def aclient(self) -> Any:
        """The :class:`~tangram_env.aio.AsyncClient` that ``areset``/``astep`` use: the one the env was
        given, else the calling thread's twin of :attr:`client` (same orchestrator and settings).
        """
        if self._given_aclient is not None:
            return self._given_aclient
        from tangram_env.aio import AsyncClient

        return AsyncClient.wrap(self.client)

    @property
    def env_id(self) -> str:
        """The registered id of this env (``""`` if it was built directly)."""
        return self.spec.id if self.spec is not None else type(self).__name__

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[ObsType, dict[str, Any]]:
        """Start an episode: a fresh trajectory and sandbox session; the previous session ends."""
        return self.begin_reset(seed=seed, options=options).run()

    def step(self, action: ActType) -> tuple[ObsType, float, bool, bool, dict[str, Any]]:
        """Run the step's actions on the orchestrator and return what they produced."""
        return self.begin_step(action).run()

    def begin_reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Driver[Any]:
        """The reset as a :class:`Driver` (the vector env drives many at once)."""
        self._check_open()
        self._check_reset_options(options)
        if self._async_driver is not None:  # a step_async/reset_async nobody waited for: superseded
            self._async_state, self._async_driver, self._async_futures = AsyncState.DEFAULT, None, []
        self._check_idle()  # an areset/astep running: a reset now would change the episode under it
        super().reset(seed=seed)
        self._end_session()
        self.trajectory_id = uuid.uuid4().hex
        self.session_id = f"{self.trajectory_id}-sbx"
        self.elapsed_steps = 0
        self._stop_reason = RESET_UNFINISHED  # until it returns
        return Driver(self, self._reset(seed=seed, options=options), self._finish_reset)

    def _check_reset_options(self, options: Any) -> None:
        if options is None or self.reset_options is None:
            return
        if not isinstance(options, dict):
            raise TypeError(f"reset(options=...) takes a dict, not {type(options).__name__}")
        for key in options:
            if key not in self.reset_options:
                known = ", ".join(map(repr, sorted(self.reset_options))) or "none"
                raise ValueError(
                    f"{self.env_id} has no reset option {key!r}{did_you_mean(str(key), self.reset_options)} "
                    f"(its options: {known})"
                )

    def begin_step(self, action: ActType) -> Driver[Any]:
        """The step as a :class:`Driver`."""
        self._check_open()
        if isinstance(self.action_space, spaces.Text) and not isinstance(action, str):
            # str() would grade token ids or bytes as source text: a trainer's bug as a silent 0.0.
            raise TypeError(
                f"{self.env_id} takes text actions (a str), not {type(action).__name__}"
                + ("; pass chat=True for chat messages" if hasattr(self, "chat") else "")
            )
        if self.trajectory_id is None:
            raise gymnasium.error.ResetNeeded("call reset() before step()")
        self._check_idle()
        if self._stop_reason is not None:  # past the end, a policy could try answers until one paid
            raise gymnasium.error.ResetNeeded(self._stop_reason)
        self._stop_reason = STEP_UNFINISHED  # until it returns
        return Driver(self, self._step(action), self._finish_step, is_step=True)

    def _finish_reset(self, value: tuple[ObsType, dict[str, Any]], results: list[Result]) -> Any:
        obs, info = value
        self._last_obs = obs
        self._stop_reason = None
        if results:
            info = {**info, "actions": action_report(results)}
        return obs, info

    def _finish_step(
        self, value: tuple[ObsType, float, bool, bool, dict[str, Any]], results: list[Result]
    ) -> Any:
        obs, reward, terminated, truncated, info = value
        self._last_obs = obs
        self.elapsed_steps += 1
        if (
            self.max_episode_steps is not None
            and self.elapsed_steps >= self.max_episode_steps
            and not terminated
        ):
            truncated = True
        self._stop_reason = EPISODE_ENDED if terminated or truncated else None
        return (
            obs,
            float(reward),
            bool(terminated),
            bool(truncated),
            {**info, "reward_valid": True, "actions": action_report(results)},
        )

    def _flagged_step(self, error: RewardUnavailable, results: list[Result]) -> Any:
        """A step with no reward (``invalid_reward="flag"``): the last observation, NaN, truncated."""
        self.elapsed_steps += 1
        self._stop_reason = EPISODE_ENDED
        info = {**flagged_info(error), "actions": action_report(results)}
        return self._last_obs, INVALID_REWARD, False, True, info

    # --- asyncio API: the same generators, awaited ------------------------------------------------
    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[ObsType, dict[str, Any]]:
        """:meth:`reset` for asyncio code: waits without blocking the event loop."""
        begin = functools.partial(self.begin_reset, seed=seed, options=options)
        return await self._arun(AsyncState.WAITING_RESET, begin)  # type: ignore[no-any-return,unused-ignore]

    async def astep(self, action: ActType) -> tuple[ObsType, float, bool, bool, dict[str, Any]]:
        """:meth:`step` for asyncio code: waits without blocking the event loop."""
        return await self._arun(AsyncState.WAITING_STEP, functools.partial(self.begin_step, action))  # type: ignore[no-any-return,unused-ignore]

    async def _arun(self, state: AsyncState, begin: Any) -> Any:
        """Start the call with ``begin()`` once no other is pending, and drive it on the event loop."""
        self._check_idle()
        self._check_open()
        aclient = self.aclient
        # Refuse a client this loop cannot use (closed, or driven by a loop on another thread) before
        # begin() ends the episode or advances the env: nothing was sent, so the episode is untouched.
        aclient._check_open()
        if aclient.sync._closed:
            raise ClosedEnvError("the env's client is closed")
        aclient._attach()
        driver = begin()
        self._async_state, self._async_loop = state, asyncio.get_running_loop()
        try:
            return await driver.arun(aclient)
        finally:
            self._async_state, self._async_loop = AsyncState.DEFAULT, None

    # --- async API (gymnasium's AsyncVectorEnv style) ---------------------------------------------
    def step_async(self, action: ActType) -> None:
        """Submit the step's first actions and return at once; :meth:`step_wait` finishes it."""
        self._start_async(AsyncState.WAITING_STEP, functools.partial(self.begin_step, action))

    def step_wait(self, timeout: float | None = None) -> tuple[ObsType, float, bool, bool, dict[str, Any]]:
        """Wait for the step started by :meth:`step_async`."""
        return self._wait_async(AsyncState.WAITING_STEP, timeout)  # type: ignore[no-any-return,unused-ignore]

    def reset_async(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        """Like :meth:`step_async`, for reset."""
        self._start_async(
            AsyncState.WAITING_RESET, functools.partial(self.begin_reset, seed=seed, options=options)
        )

    def reset_wait(self, timeout: float | None = None) -> tuple[ObsType, dict[str, Any]]:
        """Wait for the reset started by :meth:`reset_async`."""
        return self._wait_async(AsyncState.WAITING_RESET, timeout)  # type: ignore[no-any-return,unused-ignore]

    def _start_async(self, state: AsyncState, begin: Any) -> None:
        self._check_idle()
        driver = begin()
        self._async_state, self._async_driver = state, driver
        self._async_futures = self.client.submit(driver.actions) if not driver.done else []

    def _wait_async(self, state: AsyncState, timeout: float | None) -> Any:
        if self._async_state is not state or self._async_driver is None:
            raise NoAsyncCallError(f"no pending {state.value} call to wait for")
        driver = self._async_driver
        try:
            while not driver.done:
                driver.feed([f.result(timeout) for f in self._async_futures])
                self._async_futures = self.client.submit(driver.actions) if not driver.done else []
        finally:
            if driver.done:
                self._async_state, self._async_driver = AsyncState.DEFAULT, None
        return driver.value

    # --- plumbing ---------------------------------------------------------------------------------
    def _stamp(self, action: Action) -> Action:
        """Fill who-asked fields the subclass left empty."""
        if not action.trajectory_id and self.trajectory_id:
            action.trajectory_id = self.trajectory_id
        if not action.env_id:
            action.env_id = self.env_id
        return action

    @property
    def needs_reset(self) -> bool:
        """Whether :meth:`step` must wait for :meth:`reset`: the episode ended, or its last reset or
        step never finished (it failed, was cancelled, or the env was closed under it).
        """
        return self._stop_reason is not None

    def _check_idle(self) -> None:
        if self._async_loop is not None and self._async_loop.is_closed():
            # Its loop was closed with the call still waiting (a trainer's batch past its deadline),
            # so it never ends: abandoned, like a cancelled one (the episode needs a reset).
            self._async_state, self._async_loop = AsyncState.DEFAULT, None
        if self._async_state is not AsyncState.DEFAULT:
            raise AlreadyPendingCallError(f"a {self._async_state.value} call is already pending")

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedEnvError(f"{type(self).__name__} is closed")

    def _end_session(self) -> None:
        # The orchestrator lets only a connection that used the session end it: the sync client's, the
        # asyncio client's, or both (the others' requests are ignored). In a forked child (a data
        # loader's worker) both are the parent's, and so is the session: it is left to the parent.
        if self.session_id is not None and not (self._client is not None and self._client.forked):
            if self._client is not None:
                self._client.close_sessions([self.session_id])
            if self._session_aclient is not None:
                self._session_aclient.close_sessions([self.session_id])
        self.session_id = None
        self._session_aclient = None

    def _cancel_async_wait(self) -> None:
        """Cancel the actions an areset/astep awaits that have not started (they would run for nobody)
        and wake its caller at once with :class:`ClosedEnvError`.
        """
        held = self._async_wait
        if held is None:
            return
        loop, waiting, aclient, actions = held
        if not aclient._closed:  # now: a client the env owns closes below, before the wait wakes
            aclient.cancel([a.id for a in actions])
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here:
            waiting.cancel()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(waiting.cancel)

    def _cancel_sync_wait(self) -> None:
        """Cancel the actions a sync reset/step (on another thread) awaits that have not started, and
        wake it at once with :class:`ClosedEnvError`, as for an ``astep``.
        """
        held = self._sync_wait
        if held is None:
            return
        futures, actions = held
        client = self._client
        if client is not None and not client._closed and not client.forked:
            client.cancel([a.id for a in actions])
        for fut in futures:
            with contextlib.suppress(InvalidStateError):  # its result came meanwhile
                fut.set_exception(ClosedEnvError("the env was closed while this call ran"))

    def __del__(self) -> None:
        # Best effort: an env a trainer dropped without closing it (a rollout loop with no `finally`)
        # still ends its session, or its client heartbeats the sandbox for as long as it lives.
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:
                pass

    def close(self) -> None:
        """End the episode's session, free the subclass's state, close the client if this env owns it."""
        if self._closed:
            return
        self._closed = True  # first: an areset/astep woken below must see it
        try:
            self._cancel_async_wait()
            self._cancel_sync_wait()
            self._end_session()
            self._close()
        finally:
            self._closed = True
            if self._owns_client and self._client is not None:
                self._client.close()
            self._client = None


def check_turns(value: Any, name: str = "max_turns") -> int:
    """``value`` as a number of turns an episode may take (a whole number, at least 1)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} is a whole number of turns, at least 1; got {value!r}")
    return int(value)


class AnyText(spaces.Text):
    """A text space that holds any string up to ``max_length``: task texts, test data and tool output
    are Unicode, while gymnasium's ``Text`` holds only its charset (which samples still come from).
    """

    def contains(self, x: Any) -> bool:
        """Whether ``x`` is a string of an allowed length."""
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length


# gymnasium's ``Text`` flattens to indexes into its charset, which an ``AnyText`` string need not keep
# to (an ``AsyncVectorEnv``'s shared memory flattens every observation): ``AnyText`` flattens to
# Unicode code points instead, ``-1`` past the string's end.
_PAST_END = -1


@spaces.flatten.register(AnyText)
def _flatten_any_text(space: AnyText, x: str) -> np.ndarray[Any, np.dtype[np.int32]]:  # type: ignore[misc]
    points = np.frombuffer(x.encode("utf-32-le", "surrogatepass"), dtype="<u4").astype(np.int32)
    flat = np.full(space.max_length, _PAST_END, dtype=np.int32)
    flat[: len(points)] = points
    return flat


@spaces.unflatten.register(AnyText)
def _unflatten_any_text(space: AnyText, x: np.ndarray[Any, Any]) -> str:  # type: ignore[misc]
    points = np.asarray(x, dtype=np.int32)
    ends = np.flatnonzero(points == _PAST_END)
    points = points[: ends[0]] if len(ends) else points
    return points.astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")


@spaces.flatten_space.register(AnyText)
def _flatten_any_text_space(space: AnyText) -> spaces.Box:
    return spaces.Box(low=_PAST_END, high=sys.maxunicode, shape=(space.max_length,), dtype=np.int32)


class _SharedTexts(Sequence[str]):
    """The strings in a shared-memory buffer, read when asked. ``AsyncVectorEnv`` reads its shared
    memory once, at start, and hands out (a deep copy of) what it read after every step: a view
    into the buffer, as gymnasium's arrays are, rather than the tuple of strings gymnasium's own
    ``Text`` reads, which never changes.
    """

    def __init__(self, space: AnyText, shared_memory: Any, n: int) -> None:
        buffer = np.frombuffer(shared_memory.get_obj(), dtype=np.int32)
        self._rows = buffer.reshape((n, space.max_length))
        self._space = space

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...
    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        if isinstance(index, slice):
            return tuple(_unflatten_any_text(self._space, row) for row in self._rows[index])
        return _unflatten_any_text(self._space, self._rows[index])

    def __deepcopy__(self, memo: dict[int, Any]) -> tuple[str, ...]:
        return tuple(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __repr__(self) -> str:
        return repr(tuple(self))


@read_from_shared_memory.register(AnyText)
def _read_any_text(space: AnyText, shared_memory: Any, n: int = 1) -> _SharedTexts:
    return _SharedTexts(space, shared_memory, n)
