"""The local executor: runs each granted action in a child process of its own.

The child is forked (so it has every plugin already imported), put in a process group of its own,
pinned to the action's cores, and given the action's time limit; on expiry the whole group is killed.
A child that crashes, exits early or is killed costs only its own action an error result. The
project's own sandbox tools on a sandbox whose ``exec`` bounds and kills its own commands run on a
thread instead (see :func:`_runs_in_a_thread`): a fork copies the whole orchestrator on its loop.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgpack

from tangram_env import wire
from tangram_env.errors import ApiThrottled
from tangram_env.kinds import ActionContext, KindRegistry, KindSpec, kind_registry
from tangram_env.plugins import end_safe_path
from tangram_env.protocol import ErrorType, Grant, Resources, Result, Results, Timing
from tangram_env.sandbox import SandboxBroken, SandboxBusy
from tangram_env.server.backpressure import busy_result

log = logging.getLogger(__name__)

_RESULT_LIMIT = 64 * 2**20  # a value larger than this becomes an error result instead
_MESSAGE_LIMIT = 8000  # characters of a tool's exception message kept in its failure
_TRACEBACK_LIMIT = 32000  # and of its traceback
_MAX_TOOL_THREADS = 256  # trusted tools' threads at most; beyond, an action forks (see LocalRunner)


def run_kind(spec: KindSpec, ctx: ActionContext, args: Any = None) -> Any:
    """Call ``spec``'s target with the action's arguments (and ``ctx`` if it asks).

    ``args`` is the payload as validated at admission; None: validate it here (a grant that came over
    the wire, or was restored from the state file).
    """
    if args is None:
        args = spec.validate_payload(ctx.action.payload)
    if spec.takes_ctx:
        return spec.target(args, ctx=ctx)
    return spec.target(args)


@dataclass
class _Ready:
    """A sandbox action whose set-up ended (on a set-up thread): start it, or report ``failure``."""

    grant: Grant
    spec: KindSpec
    sandbox: Any
    setup_s: float
    failure: Result | None = None


@dataclass
class _Child:
    grant: Grant
    pid: int
    fd: int
    cores: tuple[int, ...]
    started: float
    deadline: float
    setup_s: float
    sandbox: Any = None
    buffer: bytearray = field(default_factory=bytearray)
    eof: bool = False
    killed_for_timeout: bool = False
    cancelled: bool = False  # its owner cancelled it while it ran: killed at the next collect


class LocalRunner:
    """Runs tool actions of the local kind registry in forked child processes (or on threads: see
    :func:`_runs_in_a_thread`).

    ``sandbox_pool`` (a :class:`tangram_env.server.sandbox.SandboxPool`) serves kinds placed in
    sandboxes; without one, such kinds are not offered. Getting and giving back sandboxes (a create
    or a reset can take seconds) runs on ``setup_threads`` threads: an action starts once its sandbox
    is ready, and the caller's loop never waits for a provider.
    """

    name = "local"

    def __init__(
        self,
        cpus: float,
        mem_mb: int,
        *,
        registry: KindRegistry = kind_registry,
        sandbox_pool: Any = None,
        worker_id: str = "local",
        setup_threads: int = 4,
    ) -> None:
        self._cpus = cpus
        self._mem_mb = mem_mb
        self._registry = registry
        self._pool = sandbox_pool
        self.worker_id = worker_id
        try:
            self._core_ids = sorted(os.sched_getaffinity(0))
        except AttributeError:
            self._core_ids = list(range(os.cpu_count() or 1))
        self._core_load = dict.fromkeys(self._core_ids, 0.0)
        self._children: dict[int, _Child] = {}  # by read fd
        self._done: list[Result] = []
        self._setup = started_pool(setup_threads, "sandbox-setup") if sandbox_pool else None
        self._maintaining: Future[None] | None = None
        self._ready: collections.deque[_Ready] = collections.deque()  # set up off the loop, to start
        self._setting_up: set[str] = set()  # actions whose sandbox a set-up thread is getting
        self._abandoned: set[str] = set()  # of those, the ones never to start (see abandon)
        self._cancelled: set[str] = set()  # of those, the ones their owner cancelled (see cancel)
        # Trusted built-in tools on a sandbox with a bounded exec run here, on threads, not in a fork.
        # Enough for as many of the smallest trusted tool (a quarter core) as the capacity grants at
        # once; should more be granted (an action may ask for less), the rest fork: none waits. Capped:
        # a host of hundreds of cores would otherwise start a thousand threads it rarely needs.
        tool_threads = min(_MAX_TOOL_THREADS, max(8, math.ceil(4 * cpus)))
        self._threads = started_pool(tool_threads, "sandbox-tool") if sandbox_pool else None
        self._idle_tool_threads = threading.Semaphore(tool_threads)
        self._pool_figures: dict[str, Any] | None = None  # the pool's last figures (see stats)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # --- Runner protocol --------------------------------------------------------------------------
    def capacity(self) -> Resources:
        """Cores and memory this executor lends."""
        return Resources(cpu=self._cpus, mem_mb=self._mem_mb)

    def kinds(self) -> frozenset[str] | None:
        """Tools registered here (sandbox-placed ones only when a sandbox pool exists)."""
        return frozenset(
            s.name
            for s in self._registry
            if s.role == "tool"
            and s.placement != "inline"
            and (s.placement != "sandbox" or self._pool is not None)
        )

    def start(self, grant: Grant) -> None:
        """Fork a child for ``grant``'s action, or ask for its sandbox first; returns at once."""
        action = grant.action
        try:
            spec = self._registry.get(action.kind)
        except KeyError as exc:
            self._finish_now(Result.failure(action.id, "rejected", str(exc)))
            return
        if spec.placement == "sandbox" and self._setup is not None:
            held = self._held_sandbox(grant)
            if held is None:
                self._setting_up.add(action.id)
                self._setup.submit(self._acquire, grant, spec)
            elif isinstance(held, Result):
                self._finish_now(held)
            else:
                self._launch(grant, spec, held, 0.0)
            return
        self._launch(grant, spec, None, 0.0)

    def _held_sandbox(self, grant: Grant) -> Any:
        """The sandbox the action's session already holds (its command starts at once, with no hop
        through a set-up thread), a failure result, or None: the set-up thread gets one.
        """
        action = grant.action
        if action.affinity is None:
            return None
        try:
            assert action.image is not None, "the orchestrator resolves every action's image at admission"
            return self._pool.held(action.affinity, action.image)
        except Exception as exc:
            return Result.failure(action.id, "sandbox_died", f"no sandbox available: {exc}")

    def _acquire(self, grant: Grant, spec: KindSpec) -> None:
        """On a set-up thread: get the action's sandbox, then wake the loop to start the action."""
        action = grant.action
        t0 = time.monotonic()
        try:
            assert action.image is not None, "the orchestrator resolves every action's image at admission"
            sandbox = self._pool.acquire(action.image, session=action.affinity)
        except SandboxBusy as exc:  # a provider at capacity: backpressure the orchestrator retries
            log.info("no sandbox for action %s yet: %s", action.id, exc)
            self._ready.append(_Ready(grant, spec, None, time.monotonic() - t0, busy_result(action.id, exc)))
        except Exception as exc:
            if isinstance(exc, SandboxBroken):  # a session that lost its sandbox: said, not a bug
                log.warning("no sandbox for action %s: %s", action.id, exc)
            else:
                log.exception("could not get a sandbox for action %s", action.id)
            failure = Result.failure(action.id, "sandbox_died", f"no sandbox available: {exc}")
            self._ready.append(_Ready(grant, spec, None, time.monotonic() - t0, failure))
        else:
            self._ready.append(_Ready(grant, spec, sandbox, time.monotonic() - t0))
        self._wake()

    def _launch(self, grant: Grant, spec: KindSpec, sandbox: Any, setup_s: float) -> None:
        """Start the action: on a tool thread if it may run there, else in a forked child."""
        action = grant.action
        demand = action.demand
        assert demand is not None, "the orchestrator resolves every action's demand at admission"
        cores = self._take_cores(max(1, math.ceil(demand.cpu * grant.parallelism - 1e-9)))
        ctx = ActionContext(
            action=action,
            parallelism=grant.parallelism,
            cores=cores,
            deadline=time.monotonic() + grant.timeout_s,
            sandbox=sandbox,
            api_key=grant.api_key,
        )
        try:
            read_fd, write_fd = os.pipe()
        except OSError as exc:  # out of file descriptors: this action fails, the loop goes on
            self._not_started(grant, cores, sandbox, setup_s, exc)
            return
        if (
            self._threads is not None
            and _runs_in_a_thread(spec, sandbox)
            and self._idle_tool_threads.acquire(blocking=False)
        ):
            pid = 0  # no child: the tool's thread writes its result to the same kind of pipe
            self._threads.submit(_thread_main, spec, ctx, grant.args, write_fd, self._idle_tool_threads)
        else:
            try:
                pid = os.fork()
            except OSError as exc:  # out of processes or memory
                os.close(read_fd)
                os.close(write_fd)
                self._not_started(grant, cores, sandbox, setup_s, exc)
                return
            if pid == 0:  # child: never returns
                os.close(read_fd)
                _child_main(spec, ctx, grant.args, write_fd)
            os.close(write_fd)
            try:  # also set in the child; doing it here closes the race with an early kill
                os.setpgid(pid, pid)
            except OSError:
                pass
        os.set_blocking(read_fd, False)
        now = time.monotonic()
        self._children[read_fd] = _Child(
            grant=grant,
            pid=pid,
            fd=read_fd,
            cores=cores,
            started=now,
            deadline=now + grant.timeout_s,
            setup_s=setup_s,
            sandbox=sandbox,
        )

    def wait_fds(self) -> list[int]:
        """Result pipes of running children, plus a wake-up pipe for results made without a child."""
        return [self._wake_r, *self._children]

    def collect(self) -> list[Result]:
        """Results of children that finished or ran out of time."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while self._ready:
            ready = self._ready.popleft()
            action_id = ready.grant.action.id
            self._setting_up.discard(action_id)
            if action_id in self._abandoned:
                self._abandoned.discard(action_id)
                self._forget_setup(ready)
            elif action_id in self._cancelled:
                self._cancelled.discard(action_id)
                self._forget_setup(ready)
                self._done.append(_cancelled(ready.grant, self.worker_id, ready.setup_s))
            elif ready.failure is not None:
                self._done.append(ready.failure)
            else:
                self._launch(ready.grant, ready.spec, ready.sandbox, ready.setup_s)
        now = time.monotonic()
        for child in list(self._children.values()):
            self._drain(child)
            if child.eof:
                self._reap(child)
            elif child.cancelled or now >= child.deadline:
                child.killed_for_timeout = not child.cancelled
                if child.pid:
                    _kill_group(child.pid)
                self._reap(child)
        done, self._done = self._done, []
        return done

    def next_deadline(self) -> float | None:
        """The earliest time-limit expiry of a running child (the loop wakes up for it)."""
        return min((c.deadline for c in self._children.values()), default=None)

    def cancel(self, action_ids: list[str]) -> None:
        """Stop these actions: each ends with a ``cancelled`` result at the next collect. A forked
        child is killed with its group (and the sandbox command it ran, as an orphan); a tool on a
        thread has its sandbox's commands killed, if no other action runs in that sandbox (they cannot
        be told apart), and otherwise runs on to its time limit; one still getting its sandbox never
        starts.
        """
        wanted = set(action_ids)
        for child in self._children.values():
            if child.grant.action.id not in wanted or child.cancelled:
                continue
            child.cancelled = True
            stop = getattr(child.sandbox, "stop_commands", None)
            shared = any(c is not child and c.sandbox is child.sandbox for c in self._children.values())
            if not child.pid and stop is not None and not shared and self._setup is not None:
                self._setup.submit(_logged_stop, stop, child.sandbox)  # waits for the kill: off the loop
        self._cancelled |= wanted & self._setting_up
        self._wake()

    def end_sessions(self, sessions: list[str]) -> None:
        """The sessions end now; their sandboxes go back to the pool, reset, on a set-up thread."""
        if self._pool is not None and self._setup is not None:
            self._pool.end_sessions_soon(sessions, self._setup.submit)

    def maintain(self) -> None:
        """Pool upkeep on a set-up thread, one at a time: warm sandboxes idle past the pool's
        ``max_idle_s`` are closed (a remote worker's pool, which no scheduler sizes, kept them all).
        """
        idle = self._maintaining is None or self._maintaining.done()
        if self._pool is not None and self._setup is not None and idle:
            self._maintaining = self._setup.submit(self._pool.maintain)

    def abandon(self) -> list[str]:
        """Kill every action it runs or sets up, and drop their results: the orchestrator that granted
        them no longer waits for them (it restarted, or lost this worker, which registers again).
        Returns their ids.
        """
        gone = set(self._setting_up)  # those whose sandbox is on its way, or ready to start
        self._abandoned |= self._setting_up  # collect drops them once their set-up ends
        for child in list(self._children.values()):
            if child.pid:
                _kill_group(child.pid)
            self._reap(child)
            gone.add(child.grant.action.id)
        self._done = [r for r in self._done if r.action_id not in gone]
        return sorted(gone)

    def unrecoverable(self) -> str | None:
        """Never: a stuck command is killed at its time limit, and its child with it."""
        return None

    def stats(self) -> dict[str, object]:
        """Running children and, with sandboxes, the pool's figures."""
        out: dict[str, object] = {"running": len(self._children), "cores": len(self._core_ids)}
        if self._pool is not None:
            figures = self._pool.stats(wait=False)  # never wait for a reset under way on a set-up thread
            if figures is not None:
                self._pool_figures = figures
            out["sandboxes"] = self._pool_figures
        return out

    def close(self) -> None:
        """Kill every running child; wait for sandbox set-up in flight (the pool closes what it made)."""
        for child in list(self._children.values()):
            if child.pid:
                _kill_group(child.pid)
            self._reap(child, closing=True)
        if self._setup is not None:
            self._setup.shutdown(wait=True, cancel_futures=True)
        if self._threads is not None:
            # A tool's thread ends with its command's own time limit, or when the pool's close ends
            # the sandbox's agent under it; nothing waits for it here.
            self._threads.shutdown(wait=False, cancel_futures=True)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # --- internals --------------------------------------------------------------------------------
    def _not_started(
        self, grant: Grant, cores: tuple[int, ...], sandbox: Any, setup_s: float, exc: OSError
    ) -> None:
        """The host refused what starting ``grant`` needs: it fails with the cause, nothing else does."""
        for c in cores:
            self._core_load[c] -= 1
        log.error("cannot start action %s: %s", grant.action.id, exc)
        timing = Timing(queued_s=grant.queued_s, setup_s=setup_s)
        result = Result.failure(
            grant.action.id,
            "error",
            f"the server could not start it: {exc} (raise the server's open-file or process limits, "
            "or run fewer actions at once)",
            timing=timing,
            worker=self.worker_id,
        )
        child = _Child(grant, 0, -1, cores, 0.0, 0.0, setup_s, sandbox)
        self._return_sandbox(child, result, closing=False)
        self._finish_now(result)

    def _forget_setup(self, ready: _Ready) -> None:
        """An abandoned action's sandbox, got but never used: back to the pool (a session's stays held)."""
        if ready.sandbox is not None and ready.grant.action.affinity is None and self._setup is not None:
            self._setup.submit(
                _give_back, functools.partial(self._pool.release, ready.sandbox), ready.sandbox
            )

    def _finish_now(self, result: Result) -> None:
        self._done.append(result)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def _take_cores(self, n: int) -> tuple[int, ...]:
        """The ``n`` least-loaded cores (a fractional demand shares a core with others)."""
        chosen = sorted(self._core_ids, key=lambda c: self._core_load[c])[: min(n, len(self._core_ids))]
        for c in chosen:
            self._core_load[c] += 1
        return tuple(chosen)

    def _drain(self, child: _Child) -> None:
        try:
            while True:
                chunk = os.read(child.fd, 1 << 20)
                if not chunk:
                    child.eof = True
                    return
                child.buffer += chunk
                if len(child.buffer) > _RESULT_LIMIT + 1024:
                    if child.pid:
                        _kill_group(child.pid)
                    child.eof = True
                    return
        except BlockingIOError:
            return

    def _reap(self, child: _Child, closing: bool = False) -> None:
        del self._children[child.fd]
        os.close(child.fd)
        status = 0
        if child.pid:
            _, status = os.waitpid(child.pid, 0)
            _kill_group(child.pid)  # anything it left behind in its group goes too
        if child.sandbox is not None and (child.killed_for_timeout or child.cancelled or not child.buffer):
            # A command it ran through a sandbox's exec agent is not in its group: the sandbox ends it.
            reap = getattr(child.sandbox, "reap_orphans", None)
            if reap is not None:
                reap()
        for c in child.cores:
            self._core_load[c] -= 1
        run_s = time.monotonic() - child.started
        action = child.grant.action
        timing = Timing(queued_s=child.grant.queued_s, setup_s=child.setup_s, run_s=run_s)
        common: dict[str, Any] = {
            "timing": timing,
            "parallelism": child.grant.parallelism,
            "worker": self.worker_id,
        }
        if child.cancelled:
            result = _cancelled(child.grant, self.worker_id, child.setup_s, run_s)
        elif child.killed_for_timeout:
            result = Result.failure(
                action.id,
                "timeout",
                f"{action.kind} ran past its limit of {child.grant.timeout_s:g}s",
                **common,
            )
        elif len(child.buffer) > _RESULT_LIMIT:
            result = Result.failure(
                action.id,
                "error",
                f"the result of {action.kind} is larger than {_RESULT_LIMIT} bytes: return less, or leave "
                "bulk data in files (or shared storage) and return where it is",
                **common,
            )
        elif child.buffer:
            try:
                result = _read_result(bytes(child.buffer), action.id)
                result.timing, result.parallelism, result.worker = (
                    timing,
                    child.grant.parallelism,
                    self.worker_id,
                )
            except Exception as exc:
                result = Result.failure(
                    action.id, "error", _unreadable(action.kind, child.buffer, exc), **common
                )
        else:
            result = Result.failure(
                action.id,
                "error",
                f"the action's process {_describe_status(status)} before reporting a result",
                **common,
            )
        self._return_sandbox(child, result, closing)
        self._done.append(result)

    def _return_sandbox(self, child: _Child, result: Result, closing: bool) -> None:
        """Give the sandbox back: a broken one is replaced (its session ends with it), one that an action
        left mid-command is discarded, a session keeps its own until the env closes it.
        """
        if child.sandbox is None or self._pool is None:
            return
        session = child.grant.action.affinity
        if result.error_type == "sandbox_died" or (session is None and not result.ok):
            give_back: Any = functools.partial(self._pool.discard, child.sandbox, result.message)
        elif session is None and self._registry.get(child.grant.action.kind).retire_sandbox:
            give_back = functools.partial(self._pool.retire, child.sandbox)  # it held secrets: no reuse
        elif session is None and not closing:
            give_back = functools.partial(self._pool.release, child.sandbox)  # a reset: maybe slow
        else:
            return
        if self._setup is None or closing:
            _give_back(give_back, child.sandbox)
        else:
            self._setup.submit(_give_back, give_back, child.sandbox)


def _cancelled(grant: Grant, worker_id: str, setup_s: float, run_s: float = 0.0) -> Result:
    """The result of an action its owner cancelled after it started (or while it got its sandbox)."""
    return Result.failure(
        grant.action.id,
        "cancelled",
        f"cancelled after it started: {grant.action.kind} was stopped",
        timing=Timing(queued_s=grant.queued_s, setup_s=setup_s, run_s=run_s),
        parallelism=grant.parallelism,
        worker=worker_id,
    )


def _logged_stop(stop: Callable[[], None], sandbox: Any) -> None:
    try:
        stop()
    except Exception:  # the action's result says cancelled either way; its command ends by its limit
        log.exception("could not stop the commands of sandbox %s", getattr(sandbox, "id", sandbox))


def started_pool(size: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose ``size`` threads are all running already.

    A plain pool starts a thread on the submit that finds none idle, and ``Thread.start`` waits until
    the new thread runs: milliseconds on a busy host, spent on the orchestrator's loop.
    """
    pool = ThreadPoolExecutor(size, thread_name_prefix=name)
    all_started = threading.Barrier(size)
    for _ in range(size):  # each holds its thread until every one is running, so none is reused
        pool.submit(all_started.wait)
    return pool


def _give_back(call: Any, sandbox: Any) -> None:
    try:
        call()
    except Exception:
        log.exception("returning sandbox %s to the pool failed", getattr(sandbox, "id", "?"))


def _unreadable(kind: str, data: bytearray, exc: Exception) -> str:
    """Why a child's result could not be read, naming the cause where it is the tool's value.

    Only on this failure path: the codec refuses maps with keys other than strings (``{1: 2}``), which
    the child's encoder happily writes; decoding again without that rule finds such a key.
    """
    try:
        body = msgpack.unpackb(memoryview(data)[2 + data[1] :], raw=False, strict_map_key=False)
        key = _non_string_key(body, "value")
    except Exception:
        key = None
    if key is not None:
        return (
            f"the result of {kind} has a dict key that is not a string ({key}): results cross the wire "
            "as msgpack maps whose keys must be strings; convert them, e.g. {str(k): v for k, v in d.items()}"
        )
    return f"unreadable result of {kind} from the action's process: {exc}"


def _non_string_key(body: Any, path: str) -> str | None:
    """``path[key]`` of the first map key in a result's value that is not a string, or None."""
    results = body.get("results") if isinstance(body, dict) else None
    if not isinstance(results, list) or not results or not isinstance(results[0], dict):
        return None
    stack: list[tuple[Any, str]] = [(results[0].get("value"), path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if not isinstance(k, str):
                    return f"{where}[{k!r}]"
                stack.append((v, f"{where}[{k!r}]"))
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(node))
    return None


def _read_result(data: bytes, action_id: str) -> Result:
    """The one result a child wrote to its pipe, in the wire's codec."""
    message = wire.decode(data, _RESULT_LIMIT + 1024)
    if not isinstance(message, Results) or [r.action_id for r in message.results] != [action_id]:
        raise ValueError(f"expected the one result of {action_id}")
    return message.results[0]


def _describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"was killed by signal {signal.Signals(sig).name if sig in signal.valid_signals() else sig}"
    return f"exited with code {os.WEXITSTATUS(status)}"


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _die_with_parent() -> None:
    """Linux: the child is killed if the orchestrator dies, so no action outlives its record."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


#: Modules whose sandbox tools are the project's own: they only call the sandbox (each call bounded
#: by the action's deadline) and shape its answer, so they may run on a thread of the runner.
_TRUSTED_TOOL_MODULES = frozenset({"tangram_env.shell_tools", "tangram_env.envs.code"})


def _runs_in_a_thread(spec: KindSpec, sandbox: Any) -> bool:
    """Whether ``spec``'s action runs on a thread here rather than in a forked child.

    Only a trusted tool (see :data:`_TRUSTED_TOOL_MODULES`) on a sandbox that says its ``exec`` is
    bounded (``bounded_exec``: it returns by the time limit it is given, having killed what it
    started, and spawns without copying the caller). The tool's every call is bounded by the action's
    deadline, so the thread ends with it; a fork would buy nothing but its own cost, paid on the
    loop: 1-4 ms per action in a server of some hundred MB, the loop stalled meanwhile.
    """
    return (
        spec.placement == "sandbox"
        and getattr(spec.target, "__module__", None) in _TRUSTED_TOOL_MODULES
        and getattr(sandbox, "bounded_exec", False)
    )


def _thread_main(
    spec: KindSpec, ctx: ActionContext, args: Any, write_fd: int, idle: threading.Semaphore
) -> None:
    """Body of a tool's thread: run the action and write its outcome, as a child would."""
    try:
        if ctx.remaining() > 0:  # else the runner reported its timeout already: nothing to start
            _write_outcome(spec, ctx, args, write_fd)
    except OSError:
        pass  # the runner stopped waiting (the action's deadline passed)
    except BaseException:
        log.exception("action %s of %s failed to report", ctx.action.id, spec.name)
    finally:
        os.close(write_fd)
        idle.release()


def _child_main(spec: KindSpec, ctx: ActionContext, args: Any, write_fd: int) -> None:
    """Body of the forked child: run the action, write its outcome, exit without cleanup."""
    code = 0
    try:
        os.setpgid(0, 0)
        _die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        end_safe_path()  # the tool's own subprocesses start as they would under any server
        if ctx.cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, ctx.cores)
        _write_outcome(spec, ctx, args, write_fd)
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _describe_exception(exc: BaseException) -> str:
    """``Type: message`` of a tool's exception, whatever its ``__str__`` does (raise, or return 100 MB)."""
    try:
        text = str(exc)
    except BaseException as err:
        text = f"<its message could not be read: str() raised {type(err).__name__}>"
    return f"{type(exc).__name__}: {_shortened(text, _MESSAGE_LIMIT)}"


def _shortened(text: str, limit: int) -> str:
    """``text``, its middle cut out past ``limit`` characters (a result must fit a message)."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} [... {len(text) - 2 * half} characters cut ...] {text[-half:]}"


def _write_outcome(spec: KindSpec, ctx: ActionContext, args: Any, write_fd: int) -> None:
    """Run the action and write its result to ``write_fd`` in the wire's codec."""
    action_id = ctx.action.id
    try:
        result = Result(action_id=action_id, ok=True, value=run_kind(spec, ctx, args))
    except BaseException as exc:  # the action's failure is data, whatever it raised
        error_type: ErrorType = "sandbox_died" if isinstance(exc, SandboxBroken) else "error"
        extra: dict[str, Any] = {}
        if isinstance(exc, ApiThrottled):  # the orchestrator requeues it and pauses its key
            error_type, extra = "throttled", {"value": {"retry_after_s": float(exc.retry_after_s)}}
        result = Result.failure(
            action_id,
            error_type,
            _describe_exception(exc),
            traceback=_shortened(traceback.format_exc(limit=20), _TRACEBACK_LIMIT),
            **extra,
        )
    try:  # the pipe speaks the wire's own codec, as every socket does
        data = wire.encode(Results(results=[result]))
    except Exception as exc:
        message = f"result of {spec.name} cannot be serialised: {exc}"
        data = wire.encode(Results(results=[Result.failure(action_id, "error", message)]))
    view = memoryview(data)
    while view:
        written = os.write(write_fd, view)
        view = view[written:]
