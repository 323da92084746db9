"""Warm pools of sandboxes per image, shared by every trajectory of every env.

The orchestrator's loop owns one :class:`SandboxPool`. ``acquire`` pops a warm sandbox (or makes
one); a session id keeps getting the same sandbox until ``end_session``; ``release`` resets a
sandbox and keeps it warm for the next trajectory. A pool is sized one of two ways:

- ``scale(image, n)`` (pre-warming by hand): creates sandboxes up to ``n`` at once; ``maintain``
  (call it on the loop's timer) refills a pool that acquires emptied and closes warm sandboxes above
  ``n`` once idle for ``max_idle_s``; a broken sandbox is replaced while the pool is short.
- ``keep(image, n)`` (the scheduler's ``ScalePool``): recycles released sandboxes while fewer
  than ``n`` are warm and closes the rest at once, unreset, and never creates one to fill itself: every
  creation is then an acquire the scheduler started (a session's first action, or a session-less
  action), counted against the image's live cap and the provider's creation rate.

``acquire`` itself only pops, so it stays fast. A sandbox that is broken (it died, hung, or could
not be reset) is closed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tangram_env.sandbox import (
    Sandbox,
    SandboxBroken,
    SandboxError,
    SandboxProvider,
    SandboxRequestError,
    SandboxSpec,
)

log = logging.getLogger(__name__)

#: How long the loop's fast path waits for the pool's lock: well beyond what bookkeeping holds it
#: for (microseconds), far below a reset or a close.
_BOOKKEEPING_S = 0.002
_LOST_KEPT = 10_000  # sessions remembered as lost (each ends, normally, long before)


@dataclass
class _Held:
    """A sandbox lent out: of which image, and to which session if any."""

    image: str
    session: str | None = None
    since: float = 0.0


@dataclass
class _Image:
    """One image's pool: warm sandboxes (with the time each went idle) and its size."""

    warm: deque[tuple[Sandbox, float]] = field(default_factory=deque)
    target: int = 0  # scale(): created up to this
    in_use: int = 0
    keep: int | None = None  # keep(): recycled up to this, nothing created (overrides target)


class SandboxPool:
    """Warm sandboxes per image, lent to actions and sessions (see the module's description).

    ``spec_for_image(image)`` gives the spec new sandboxes of ``image`` get (default: a
    :class:`SandboxSpec` with that image and default limits). ``max_warm`` caps the warm sandboxes
    kept per image beyond the target. With ``background_resets``, a sandbox whose reset copies files
    (an image with a workspace) is reset in a forked child and turns warm when that ends; others
    reset in the call. Thread-safe: calls are serialised by a lock, except the provider's ``create``
    of a cold start, which runs outside it.
    """

    def __init__(
        self,
        provider: SandboxProvider,
        *,
        spec_for_image: Callable[[str], SandboxSpec] | None = None,
        max_idle_s: float = 60.0,
        max_warm: int = 64,
        background_resets: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_idle_s < 0 or max_warm < 0:
            raise SandboxRequestError("max_idle_s and max_warm must not be negative")
        self.provider = provider
        self._spec_for_image = spec_for_image or (lambda image: SandboxSpec(image=image))
        self.max_idle_s = max_idle_s
        self.max_warm = max_warm
        self._clock = clock
        self._images: dict[str, _Image] = {}
        self._held: dict[int, tuple[Sandbox, _Held]] = {}
        self._sessions: dict[str, Sandbox] = {}
        # Sessions whose sandbox broke under them, and why, until they end: their files are gone, so
        # their next commands fail (sandbox_died) rather than run in a fresh sandbox as if nothing
        # happened (a trajectory graded on a state its agent never made).
        self._lost: OrderedDict[str, str] = OrderedDict()
        self.background_resets = background_resets
        self._resetting: dict[int, tuple[Sandbox, str, float]] = {}
        self._counts: Counter[str] = Counter()
        self._reasons: Counter[str] = Counter()
        self._lock = threading.RLock()
        self._closed = False

    # --- lending ----------------------------------------------------------------------------------
    def acquire(self, image: str = "default", session: str | None = None) -> Sandbox:
        """A sandbox of ``image``: the session's own if it has one, else a warm one, else a new one."""
        with self._lock:
            self._check_open()
            if self._resetting:
                self._reap()
            self._check_not_lost(session)
            if session is not None and session in self._sessions:
                return self._held_by(session, image)
            warm = self._pop_warm(image)
            if warm is not None:
                self._counts["warm_hits"] += 1
                return self._lend(warm, image, session)
        # A cold start: the provider call (seconds, for some) runs outside the lock, so that other
        # threads' acquires, releases and figures go on meanwhile.
        sandbox = self._create(image)
        with self._lock:
            other = self._sessions.get(session) if session is not None else None
            if not self._closed and other is None:
                self._counts["cold_starts"] += 1
                return self._lend(sandbox, image, session)
        self._close(sandbox)  # the pool closed meanwhile, or the session got one from another thread
        if other is None:
            raise SandboxError("the sandbox pool is closed")
        return self.acquire(image, session)

    def held(self, session: str, image: str = "default") -> Sandbox | None:
        """The sandbox ``session`` already holds, or None; never waits for a provider or a reset.

        The executor's fast path, on the orchestrator's loop: a session's next command need not go
        through a set-up thread. The pool's lock is waited for only as long as bookkeeping holds
        it; while another thread holds it longer (a reset or a close in the call), None: the
        action's set-up thread then waits for it, not the loop.
        """
        if not self._lock.acquire(timeout=_BOOKKEEPING_S):
            return None
        try:
            self._check_open()
            self._check_not_lost(session)
            return self._held_by(session, image) if session in self._sessions else None
        finally:
            self._lock.release()

    def _check_not_lost(self, session: str | None) -> None:
        if session is not None and session in self._lost:
            raise SandboxBroken(
                f"session {session!r} lost its sandbox ({self._lost[session]}) with its files and "
                "processes; end the session (reset the env) to start again"
            )

    def _held_by(self, session: str, image: str) -> Sandbox:
        sandbox = self._sessions[session]
        held = self._held[id(sandbox)][1]
        if held.image != image:
            raise SandboxRequestError(
                f"session {session!r} holds a sandbox of image {held.image!r}, not {image!r}"
            )
        return sandbox

    def _lend(self, sandbox: Sandbox, image: str, session: str | None) -> Sandbox:
        self._held[id(sandbox)] = (sandbox, _Held(image, session, self._clock()))
        self._pool(image).in_use += 1
        if session is not None:
            self._sessions[session] = sandbox
        return sandbox

    def session(self, session: str) -> Sandbox | None:
        """The sandbox ``session`` holds, if any (without acquiring one)."""
        with self._lock:
            return self._sessions.get(session)

    def end_session(self, session: str) -> None:
        """The session is over: reset its sandbox and return it to the warm pool (no-op if unknown)."""
        with self._lock:
            self._lost.pop(session, None)
            sandbox = self._sessions.get(session)
            if sandbox is not None:
                self.release(sandbox)

    def end_sessions(self, sessions: Iterable[str]) -> None:
        """:meth:`end_session` for each, one failure (logged) not stopping the rest."""
        for session in sessions:
            try:
                self.end_session(session)
            except Exception:
                log.exception("ending sandbox session %s failed", session)

    def release(self, sandbox: Sandbox) -> None:
        """Give a sandbox back: reset, then warm for the next user (or closed if broken)."""
        with self._lock:
            if self._closed and id(sandbox) not in self._held:
                self._close(sandbox)  # the pool was closed under the action: just finish it
                return
            held = self._forget(sandbox)
            problem = _health(sandbox)
            if problem is not None:
                self._close_broken(sandbox, held.image, problem)
                return
            if not self._has_room(held.image):
                # Nobody would take it warm: resetting it first would be wasted work (on e2b, where a
                # reset makes a new cloud sandbox, a creation billed and counted against the rate).
                self._close(sandbox)
                return
            if self.background_resets and getattr(sandbox, "slow_reset", False):
                self._reset_in_child(sandbox, held.image)
                return
            try:
                started = time.perf_counter()
                sandbox.reset()
                self._counts["resets"] += 1
                self._counts["reset_ns"] += int((time.perf_counter() - started) * 1e9)
            except Exception as exc:  # whatever went wrong, the sandbox is closed, never leaked
                self._close_broken(sandbox, held.image, f"reset failed: {type(exc).__name__}: {exc}")
                return
            self._keep_warm(sandbox, held.image)
            self.maintain()

    def _has_room(self, image: str) -> bool:
        """Whether one more sandbox of ``image`` may turn warm, counting those resetting to do so."""
        if self._closed:
            return False
        pool = self._pool(image)
        limit = pool.keep if pool.keep is not None else max(self.max_warm, pool.target)
        resetting = sum(1 for _, of, _ in self._resetting.values() if of == image)
        return len(pool.warm) + resetting < limit

    def _keep_warm(self, sandbox: Sandbox, image: str) -> None:
        if self._has_room(image):
            self._pool(image).warm.append((sandbox, self._clock()))
        else:  # the pool filled, or shrank, while it was reset
            self._close(sandbox)

    def _reset_in_child(self, sandbox: Sandbox, image: str) -> None:
        """Reset in a forked child, so copying a large image does not stall the caller's loop.

        Only for sandboxes whose state is all on the file system (they say so with ``slow_reset``);
        the sandbox turns warm when :meth:`_reap` sees the child exit 0.
        """
        pid = os.fork()
        if pid == 0:  # the child: reset, report by exit status, never return
            code = 1
            try:
                sandbox.reset()
                code = 0
            finally:
                os._exit(code)
        self._resetting[pid] = (sandbox, image, time.perf_counter())

    def _reap(self, block: bool = False) -> None:
        """Collect finished background resets: warm on success, discarded otherwise."""
        for pid, (sandbox, image, started) in list(self._resetting.items()):
            done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
            if done == 0:
                continue
            del self._resetting[pid]
            if os.waitstatus_to_exitcode(status) != 0:
                self._close_broken(sandbox, image, "reset failed (in the background)")
                continue
            self._counts["resets"] += 1
            self._counts["reset_ns"] += int((time.perf_counter() - started) * 1e9)
            self._keep_warm(sandbox, image)

    def discard(self, sandbox: Sandbox, reason: str) -> None:
        """Close a broken sandbox (its session ends with it) and replace it if the pool is short. One
        the pool has let go already (its session ended meanwhile, and the reset found it broken) is
        closed: nothing is left to do.
        """
        with self._lock:
            if id(sandbox) not in self._held:
                return
            held = self._forget(sandbox)
            if held.session is not None:
                self._lost[held.session] = reason
                if len(self._lost) > _LOST_KEPT:
                    self._lost.popitem(last=False)
            self._close_broken(sandbox, held.image, reason)

    # --- sizing -----------------------------------------------------------------------------------
    def scale(self, image: str, size: int) -> None:
        """Keep ``size`` warm sandboxes of ``image``: grow now, shrink after ``max_idle_s`` idle."""
        self._size(image, "target", size)

    def keep(self, image: str, size: int, expire: int = 0) -> None:
        """Keep at most ``size`` warm sandboxes of ``image``, from released ones only; close extras now,
        and the ``expire`` longest idle first (they have waited longer than keeping them pays).
        """
        self._size(image, "keep", size, expire)

    def _size(self, image: str, attr: str, size: int, expire: int = 0) -> None:
        if size < 0 or expire < 0:
            raise SandboxRequestError(f"pool size and expiries must not be negative, got {size}, {expire}")
        with self._lock:
            self._check_open()
            pool = self._pool(image)
            for _ in range(min(expire, len(pool.warm))):
                self._close(pool.warm.popleft()[0])
                self._counts["shrunk"] += 1
            setattr(pool, attr, size)
            self.maintain()

    def maintain(self, now: float | None = None) -> None:
        """Grow scaled pools to their target, shrink them after ``max_idle_s`` idle; trim kept pools."""
        with self._lock:
            if self._closed:
                return
            if self._resetting:
                self._reap()
            now = self._clock() if now is None else now
            for image, pool in self._images.items():
                if pool.keep is not None:
                    while len(pool.warm) > pool.keep:
                        self._close(pool.warm.popleft()[0])
                        self._counts["shrunk"] += 1
                    continue
                while len(pool.warm) < pool.target:
                    try:
                        pool.warm.append((self._create(image), now))
                    except SandboxError as exc:
                        log.error("cannot grow the %s pool: %s", image, exc)
                        break
                # Oldest idle first: they are at the left.
                while len(pool.warm) > pool.target and now - pool.warm[0][1] >= self.max_idle_s:
                    sandbox, _ = pool.warm.popleft()
                    self._close(sandbox)
                    self._counts["shrunk"] += 1

    # --- figures and shutdown ---------------------------------------------------------------------
    def stats(self, *, wait: bool = True) -> dict[str, Any] | None:
        """Pool sizes per image, sessions, and counters (created, warm hits, resets, discards).

        ``wait=False``: None at once while another thread holds the pool (a reset or close under way),
        for a caller's loop that must not wait.
        """
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            if self._resetting:
                self._reap()
            counts = dict(self._counts)
            resets = counts.get("resets", 0)
            return {
                "provider": getattr(self.provider, "name", type(self.provider).__name__),
                "images": {
                    name: {
                        "warm": len(p.warm),
                        "in_use": p.in_use,
                        "target": p.target if p.keep is None else p.keep,
                    }
                    for name, p in self._images.items()
                },
                "sessions": len(self._sessions),
                "resetting": len(self._resetting),
                "created": counts.get("created", 0),
                "cold_starts": counts.get("cold_starts", 0),
                "warm_hits": counts.get("warm_hits", 0),
                "resets": resets,
                "reset_ms_mean": counts.get("reset_ns", 0) / resets / 1e6 if resets else 0.0,
                "shrunk": counts.get("shrunk", 0),
                "discarded": counts.get("discarded", 0),
                "discard_reasons": dict(self._reasons),
                "closed": counts.get("closed", 0),
            }
        finally:
            self._lock.release()

    def close(self) -> None:
        """Close every sandbox, lent or warm; the pool refuses new work afterwards."""
        with self._lock:
            self._closed = True
            self._reap(block=True)
            for pool in self._images.values():
                while pool.warm:
                    self._close(pool.warm.popleft()[0])
            for sandbox, _ in list(self._held.values()):
                self._close(sandbox)
            self._held.clear()
            self._sessions.clear()

    # --- internals --------------------------------------------------------------------------------
    def _pool(self, image: str) -> _Image:
        return self._images.setdefault(image, _Image())

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("the sandbox pool is closed")

    def _create(self, image: str) -> Sandbox:
        spec = self._spec_for_image(image)
        if spec.image != image:
            spec = spec.model_copy(update={"image": image})
        sandbox = self.provider.create(spec)
        with self._lock:
            self._counts["created"] += 1
        return sandbox

    def _pop_warm(self, image: str) -> Sandbox | None:
        pool = self._pool(image)
        while pool.warm:
            sandbox, _ = pool.warm.pop()  # most recently used: its pages are the warmest
            problem = _health(sandbox)
            if problem is None:
                return sandbox
            self._close_broken(sandbox, image, problem)
        return None

    def _forget(self, sandbox: Sandbox) -> _Held:
        entry = self._held.pop(id(sandbox), None)
        if entry is None:
            raise SandboxRequestError(
                f"sandbox {getattr(sandbox, 'id', sandbox)!r} was not lent by this pool"
            )
        held = entry[1]
        self._pool(held.image).in_use -= 1
        if held.session is not None and self._sessions.get(held.session) is sandbox:
            del self._sessions[held.session]
        return held

    def _close(self, sandbox: Sandbox) -> None:
        try:
            sandbox.close()
        except Exception as exc:  # closing must go on for the others
            log.warning("closing sandbox %s failed: %s", getattr(sandbox, "id", "?"), exc)
        self._counts["closed"] += 1

    def _close_broken(self, sandbox: Sandbox, image: str, reason: str) -> None:
        log.warning("discarding sandbox %s (%s): %s", getattr(sandbox, "id", "?"), image, reason)
        self._counts["discarded"] += 1
        self._reasons[_reason_key(reason)] += 1
        self._close(sandbox)
        self.maintain()


def _health(sandbox: Sandbox) -> str | None:
    check = getattr(sandbox, "health", None)
    return check() if callable(check) else None


def _reason_key(reason: str) -> str:
    """A short key for counting reasons (the text before any colon)."""
    return reason.split(":", 1)[0].strip()[:60] or "unknown"
