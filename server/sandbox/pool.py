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

``acquire`` itself only pops (with none warm, it waits for a reset under way rather than make
another), so it stays fast. A sandbox that is broken (it died, hung, or could not be reset) is closed.
Provider calls (resets, health checks, creates, closes) run outside the pool's lock, so that one slow
sandbox (an e2b reset is a create: seconds) holds up no other session.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
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
    making: int = 0  # maintain(): creations under way toward the target
    waiting: int = 0  # acquires waiting for a reset under way rather than making one


class SandboxPool:
    """Warm sandboxes per image, lent to actions and sessions (see the module's description).

    ``spec_for_image(image)`` gives the spec new sandboxes of ``image`` get (default: a
    :class:`SandboxSpec` with that image and default limits). ``max_warm`` caps the warm sandboxes
    kept per image beyond the target. With ``background_resets``, a sandbox whose reset copies files
    (an image with a workspace) is reset in a forked child and turns warm when that ends; others
    reset in the call. Thread-safe: the pool's books are kept under a lock held only for bookkeeping;
    every provider call (a create, a reset, a health check, a close: seconds, on e2b) runs outside it,
    so that one slow sandbox never holds up another session's ``held`` or ``acquire``.
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
        # Sandboxes out of the books while a provider call on them runs outside the lock (a reset in
        # the call, or a health check before lending): neither lent nor warm, each counted once toward
        # its image's room; "reset" or "check" says which.
        self._in_hand: dict[int, tuple[Sandbox, str, str]] = {}
        self._counts: Counter[str] = Counter()
        self._reasons: Counter[str] = Counter()
        self._lock = threading.RLock()
        self._settled = threading.Condition(self._lock)  # notified as sandboxes leave _in_hand
        self._closed = False

    # --- lending ----------------------------------------------------------------------------------
    def acquire(self, image: str = "default", session: str | None = None) -> Sandbox:
        """A sandbox of ``image``: the session's own if it has one, else a warm one, else a new one."""
        while True:
            finished: list[tuple[Sandbox, str, str | None]] = []
            try:
                with self._lock:
                    self._check_open()
                    if self._resetting:
                        finished = self._reap()
                    self._check_not_lost(session)
                    if session is not None and session in self._sessions:
                        return self._held_by(session, image)
                    pool = self._pool(image)
                    if not pool.warm and self._resets_under_way(image) > pool.waiting:
                        self._await_reset(pool, image)
                        continue
                    if not pool.warm:
                        break
                    candidate = pool.warm.pop()[0]  # most recently used: its pages are the warmest
                    self._in_hand[id(candidate)] = (candidate, image, "check")
            finally:
                self._dispose(finished)
            lent = self._lend_checked(candidate, image, session)
            if lent is not None:
                return lent
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

    def _resets_under_way(self, image: str) -> int:
        return sum(1 for _, of, why in self._in_hand.values() if of == image and why == "reset")

    def _await_reset(self, pool: _Image, image: str) -> None:
        """Wait (the lock let go meanwhile) for one of the resets under way to end: a sandbox about to
        turn warm is taken rather than another made (on e2b, a creation billed and rate-limited).
        Under the lock.
        """
        pool.waiting += 1
        try:
            self._settled.wait_for(
                lambda: bool(pool.warm) or self._closed or self._resets_under_way(image) < pool.waiting
            )
        finally:
            pool.waiting -= 1

    def _lend_checked(self, candidate: Sandbox, image: str, session: str | None) -> Sandbox | None:
        """``candidate`` (a warm sandbox, in hand) lent if its health check passes (outside the lock);
        None if not (it is closed), or if the session got a sandbox meanwhile (it turns warm again).
        """
        problem = _health(candidate)
        with self._lock:
            if problem is None:
                if not self._closed and (session is None or session not in self._sessions):
                    self._release_hand(candidate)
                    self._counts["warm_hits"] += 1
                    return self._lend(candidate, image, session)
                if self._warm_from_hand(candidate, image):  # the session got one from another thread
                    return None
        self._let_go(candidate, image, problem)  # broken, or no room for it (the pool closed)
        return None

    def held(self, session: str, image: str = "default") -> Sandbox | None:
        """The sandbox ``session`` already holds, or None; never waits for a provider or a reset.

        The executor's fast path, on the orchestrator's loop: a session's next command need not go
        through a set-up thread. The pool's lock is held only for bookkeeping (no provider call runs
        under it), and waited for only that long; should another thread hold it longer (a fork for
        a background reset, a stalled machine), None: the action's set-up thread then asks instead.
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
            detached = self._detach(session)
        if detached is not None:
            self._recycle(*detached)

    def _detach(self, session: str) -> tuple[Sandbox, str] | None:
        """Forget ``session`` (its lost mark; its sandbox, now in hand to be reset): its id may start
        afresh. The sandbox and its image, if it had one. Under the lock.
        """
        self._lost.pop(session, None)
        sandbox = self._sessions.get(session)
        return None if sandbox is None else (sandbox, self._take_back(sandbox))

    def end_sessions(self, sessions: Iterable[str]) -> None:
        """:meth:`end_session` for each, one failure (logged) not stopping the rest."""
        for session in sessions:
            try:
                self.end_session(session)
            except Exception:
                log.exception("ending sandbox session %s failed", session)

    def end_sessions_soon(self, sessions: Sequence[str], submit: Callable[..., object]) -> None:
        """End the sessions from the orchestrator's loop: their ids are free at once, and their
        sandboxes are reset through ``submit`` (a set-up thread). Ended on that thread alone, a
        session's id could be used again before it ran: the new session then found the old one's
        lost mark, or the old sandbox with its files. Only if the books are busy past the bookkeeping
        wait does the whole ending go to ``submit``.
        """
        if not self._lock.acquire(timeout=_BOOKKEEPING_S):
            submit(self.end_sessions, tuple(sessions))
            return
        try:
            detached = [d for d in map(self._detach, sessions) if d is not None]
        finally:
            self._lock.release()
        if detached:
            submit(self._recycle_all, detached)

    def _recycle_all(self, detached: list[tuple[Sandbox, str]]) -> None:
        for sandbox, image in detached:
            try:
                self._recycle(sandbox, image)
            except Exception:
                log.exception("resetting sandbox %s failed", getattr(sandbox, "id", "?"))

    def release(self, sandbox: Sandbox) -> None:
        """Give a sandbox back: reset, then warm for the next user (or closed if broken)."""
        with self._lock:
            lent = not self._closed or id(sandbox) in self._held
            image = self._take_back(sandbox) if lent else None
        if image is None:
            self._close(sandbox)  # the pool was closed under the action: just finish it
            return
        self._recycle(sandbox, image)

    def _take_back(self, sandbox: Sandbox) -> str:
        """A lent sandbox's image, the sandbox now in hand to be reset. Under the lock."""
        image = self._forget(sandbox).image
        self._in_hand[id(sandbox)] = (sandbox, image, "reset")
        return image

    def _recycle(self, sandbox: Sandbox, image: str) -> None:
        """Reset a sandbox in hand and keep it warm (or close it: broken, or no room for it). The
        provider's calls run outside the lock; the books count it once meanwhile, lending it to nobody.
        """
        problem = _health(sandbox)
        if problem is not None:
            self._let_go(sandbox, image, problem)
            return
        with self._lock:
            # Nobody would take it warm: resetting it first would be wasted work (on e2b, where a
            # reset makes a new cloud sandbox, a creation billed and counted against the rate).
            entry = self._in_hand.pop(id(sandbox))
            room = self._has_room(image)
            self._in_hand[id(sandbox)] = entry
        if not room:
            self._let_go(sandbox, image, None)
            return
        if self.background_resets and getattr(sandbox, "slow_reset", False):
            self._reset_in_child(sandbox, image)
            return
        started = time.perf_counter()
        try:
            sandbox.reset()
        except Exception as exc:  # whatever went wrong, the sandbox is closed, never leaked
            self._let_go(sandbox, image, f"reset failed: {type(exc).__name__}: {exc}")
            return
        with self._lock:
            self._counts["resets"] += 1
            self._counts["reset_ns"] += int((time.perf_counter() - started) * 1e9)
            kept = self._warm_from_hand(sandbox, image)
        if not kept:  # the pool filled, shrank or closed while it was reset
            self._let_go(sandbox, image, None)
        self.maintain()

    def _has_room(self, image: str) -> bool:
        """Whether one more sandbox of ``image`` may turn warm, counting those on their way to it (being
        reset, or checked before lending). Under the lock.
        """
        if self._closed:
            return False
        pool = self._pool(image)
        limit = pool.keep if pool.keep is not None else max(self.max_warm, pool.target)
        resetting = sum(1 for _, of, _ in self._resetting.values() if of == image)
        resetting += sum(1 for _, of, _ in self._in_hand.values() if of == image)
        return len(pool.warm) + resetting < limit

    def _keep_warm(self, sandbox: Sandbox, image: str) -> bool:
        """Whether ``sandbox`` turned warm (else the caller closes it, outside the lock). Under the lock."""
        if self._has_room(image):
            self._pool(image).warm.append((sandbox, self._clock()))
            return True
        return False

    def _warm_from_hand(self, sandbox: Sandbox, image: str) -> bool:
        """Whether ``sandbox``, in hand, turned warm (and left the hand); if not, it stays in hand for
        :meth:`_let_go`. Under the lock.
        """
        entry = self._in_hand.pop(id(sandbox))  # its room is its own to take
        if self._keep_warm(sandbox, image):
            self._settled.notify_all()
            return True
        self._in_hand[id(sandbox)] = entry
        return False

    def _release_hand(self, sandbox: Sandbox) -> None:
        """The provider calls on ``sandbox`` are over: back to the books (the caller says where). Under
        the lock.
        """
        del self._in_hand[id(sandbox)]
        self._settled.notify_all()

    def _let_go(self, sandbox: Sandbox, image: str, problem: str | None) -> None:
        """Close a sandbox in hand (broken if ``problem``, else one there is no room for), then take it
        off the hand: :meth:`close` waits for that. Outside the lock.
        """
        if problem is not None:
            self._note_broken(sandbox, image, problem)
        try:
            self._close(sandbox)
        finally:
            with self._lock:
                self._release_hand(sandbox)
        if problem is not None:
            self.maintain()

    def _reset_in_child(self, sandbox: Sandbox, image: str) -> None:
        """Reset in a forked child, so copying a large image does not stall the caller's loop.

        Only for sandboxes whose state is all on the file system (they say so with ``slow_reset``);
        the sandbox (in hand meanwhile) turns warm when :meth:`_reap` sees the child exit 0.
        """
        pid = os.fork()
        if pid == 0:  # the child: reset, report by exit status, never return
            code = 1
            try:
                sandbox.reset()
                code = 0
            finally:
                os._exit(code)
        with self._lock:
            closed = self._closed
            if not closed:
                self._release_hand(sandbox)
                self._resetting[pid] = (sandbox, image, time.perf_counter())
        if closed:  # closed meanwhile, and close() waits for this sandbox: finish it here
            os.waitpid(pid, 0)
            self._let_go(sandbox, image, None)

    def _reap(self) -> list[tuple[Sandbox, str, str | None]]:
        """Collect finished background resets: warm on success. Under the lock; what is left to close
        (the sandbox, its image, and why if broken) the caller hands to :meth:`_dispose` after it.
        """
        left: list[tuple[Sandbox, str, str | None]] = []
        for pid, (sandbox, image, started) in list(self._resetting.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == 0:
                continue
            del self._resetting[pid]
            if os.waitstatus_to_exitcode(status) != 0:
                left.append((sandbox, image, "reset failed (in the background)"))
                continue
            self._counts["resets"] += 1
            self._counts["reset_ns"] += int((time.perf_counter() - started) * 1e9)
            if not self._keep_warm(sandbox, image):
                left.append((sandbox, image, None))
        return left

    def _dispose(self, left: list[tuple[Sandbox, str, str | None]]) -> None:
        """Close what :meth:`_reap` left (outside the lock): broken ones as such, the others plainly."""
        for sandbox, image, problem in left:
            if problem is None:
                self._close(sandbox)
            else:
                self._close_broken(sandbox, image, problem)

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

    def retire(self, sandbox: Sandbox) -> None:
        """Close a sandbox after its use by an action without a session, instead of resetting it for
        another: the action's kind put in it what no later action may see (a grader's hidden tests),
        and a reset empties files, not every trace a process can leave in the kernel.
        """
        with self._lock:
            if id(sandbox) not in self._held:
                return
            self._forget(sandbox)
            self._counts["retired"] += 1
        self._close(sandbox)
        self.maintain()

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
            expired = [pool.warm.popleft()[0] for _ in range(min(expire, len(pool.warm)))]
            self._counts["shrunk"] += len(expired)
            setattr(pool, attr, size)
        for sandbox in expired:
            self._close(sandbox)
        self.maintain()

    def maintain(self, now: float | None = None) -> None:
        """Grow scaled pools to their target, shrink them after ``max_idle_s`` idle; trim kept pools."""
        finished: list[tuple[Sandbox, str, str | None]] = []
        retired: list[Sandbox] = []
        wanted: dict[str, int] = {}
        with self._lock:
            if self._closed:
                return
            if self._resetting:
                finished = self._reap()
            now = self._clock() if now is None else now
            for image, pool in self._images.items():
                if pool.keep is not None:
                    while len(pool.warm) > pool.keep:
                        retired.append(pool.warm.popleft()[0])
                        self._counts["shrunk"] += 1
                    continue
                missing = pool.target - len(pool.warm) - pool.making
                if missing > 0:  # booked now, so that another thread's maintain makes none of these
                    pool.making += missing
                    wanted[image] = missing
                # Oldest idle first: they are at the left.
                while len(pool.warm) > pool.target and now - pool.warm[0][1] >= self.max_idle_s:
                    retired.append(pool.warm.popleft()[0])
                    self._counts["shrunk"] += 1
        self._dispose(finished)
        for sandbox in retired:
            self._close(sandbox)
        for image, count in wanted.items():
            self._grow(image, count, now)

    def _grow(self, image: str, count: int, now: float) -> None:
        """Make ``count`` sandboxes of ``image`` (booked in its ``making``), outside the lock, and keep
        them warm; the first failure leaves the rest unmade.
        """
        pool, left = self._pool(image), count
        try:
            while left:
                try:
                    sandbox = self._create(image)
                except SandboxError as exc:
                    log.error("cannot grow the %s pool: %s", image, exc)
                    return
                with self._lock:
                    pool.making, left = pool.making - 1, left - 1
                    kept = self._has_room(image)
                    if kept:
                        pool.warm.append((sandbox, now))
                if not kept:  # the pool closed or shrank meanwhile
                    self._close(sandbox)
        finally:
            with self._lock:
                pool.making -= left

    # --- figures and shutdown ---------------------------------------------------------------------
    def stats(self, *, wait: bool = True) -> dict[str, Any] | None:
        """Pool sizes per image, sessions, and counters (created, warm hits, resets, discards, retired).

        ``wait=False``: None at once while another thread holds the pool (a reset or close under way),
        for a caller's loop that must not wait.
        """
        if not self._lock.acquire(blocking=wait):
            return None
        finished: list[tuple[Sandbox, str, str | None]] = []
        try:
            if self._resetting:
                finished = self._reap()
            counts = dict(self._counts)
            resets = counts.get("resets", 0)
            in_call = sum(1 for *_, why in self._in_hand.values() if why == "reset")
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
                "resetting": len(self._resetting) + in_call,
                "created": counts.get("created", 0),
                "cold_starts": counts.get("cold_starts", 0),
                "warm_hits": counts.get("warm_hits", 0),
                "resets": resets,
                "reset_ms_mean": counts.get("reset_ns", 0) / resets / 1e6 if resets else 0.0,
                "shrunk": counts.get("shrunk", 0),
                "discarded": counts.get("discarded", 0),
                "discard_reasons": dict(self._reasons),
                "retired": counts.get("retired", 0),
                "closed": counts.get("closed", 0),
            }
        finally:
            self._lock.release()
            self._dispose(finished)

    def close(self) -> None:
        """Close every sandbox, lent or warm; the pool refuses new work afterwards. Returns once the
        provider calls under way on the pool's sandboxes (resets, checks) are over and those closed too.
        """
        with self._lock:
            self._closed = True
            self._settled.notify_all()  # acquires waiting for a reset: closed
            children = list(self._resetting.items())
            self._resetting.clear()
            doomed = [sandbox for pool in self._images.values() for sandbox, _ in pool.warm]
            doomed += [sandbox for sandbox, _ in self._held.values()]
            for pool in self._images.values():
                pool.warm.clear()
            self._held.clear()
            self._sessions.clear()
        for pid, (sandbox, _, _) in children:
            os.waitpid(pid, 0)
            doomed.append(sandbox)
        for sandbox in doomed:
            self._close(sandbox)
        with self._lock:  # each in hand is closed by its own thread, which finds the pool closed
            self._settled.wait_for(lambda: not self._in_hand)

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
        """Close a sandbox out of the books (a provider call: never under the lock)."""
        try:
            sandbox.close()
        except Exception as exc:  # closing must go on for the others
            log.warning("closing sandbox %s failed: %s", getattr(sandbox, "id", "?"), exc)
        with self._lock:
            self._counts["closed"] += 1

    def _close_broken(self, sandbox: Sandbox, image: str, reason: str) -> None:
        self._note_broken(sandbox, image, reason)
        self._close(sandbox)
        self.maintain()

    def _note_broken(self, sandbox: Sandbox, image: str, reason: str) -> None:
        log.warning("discarding sandbox %s (%s): %s", getattr(sandbox, "id", "?"), image, reason)
        with self._lock:
            self._counts["discarded"] += 1
            self._reasons[_reason_key(reason)] += 1


def _health(sandbox: Sandbox) -> str | None:
    check = getattr(sandbox, "health", None)
    return check() if callable(check) else None


def _reason_key(reason: str) -> str:
    """A short key for counting reasons (the text before any colon)."""
    return reason.split(":", 1)[0].strip()[:60] or "unknown"
