"""The one process that calls the e2b SDK: started (fork+exec, never a bare fork) by the e2b provider.

The SDK keeps process-wide HTTP transports with threads of their own; a forked child inherits the
transports but not the threads, and its requests never return. So the orchestrator and its forked
action children never import the SDK: each process asks this helper over a Unix socket
(``multiprocessing.connection`` with an auth key), one connection per call, and the helper (which
never forks) makes the calls, a thread per connection.

A request is ``(op, args)``; a reply is ``("ok", value)`` or ``("error", kind, message)`` with ``kind``
one of :data:`ERROR_KINDS`, mapped from the SDK's exceptions here, in one place: a refused key is
``unavailable``; 429/503 are ``busy`` (backpressure, retry later); a sandbox that is gone, stopped or
unreachable is ``broken``; a file read past its limit is ``too_large``; anything else is ``error``.

No sandbox is lost track of (each costs its owner money while it lives): every one carries the
provider's :data:`OWNER_KEY` and its create's own :data:`CREATE_KEY` in its e2b metadata. A kill that
fails is tried again in the background, waiting longer each time; a create that failed in a way that
e2b may have gone on from (a timeout, a 5xx) has its sandbox looked for by that metadata, and killed
when found; a create's answer that its caller does not acknowledge (it stopped waiting) is killed at
once. When stdin ends (the provider closed it, or its process exited, however), :meth:`Helper.sweep`
kills whatever still carries the provider's tag before the helper exits.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import sys
import threading
import time
import uuid
from multiprocessing.connection import Connection, Listener
from typing import Any

from tangram_env.server.sandbox.procrun import OutputCapture

log = logging.getLogger(__name__)

ERROR_KINDS = ("unavailable", "busy", "broken", "not_found", "too_large", "request", "error")
OPERATIONS = ("create", "exec", "write", "read", "health", "kill", "ping")
OWNER_KEY = "tangram.owner"  # metadata: the provider that made the sandbox
CREATE_KEY = "tangram.create"  # metadata: the create call that made it
TAKEN = "taken"  # what a caller sends back on receiving a create's answer
_TAKE_S = 30.0  # a create's answer not acknowledged within this is taken as its caller gone
_RETRY_FIRST_S = 1.0  # the first wait before trying a failed kill again; it doubles each time
_RETRY_MAX_S = 60.0
_SWEEP_WAITS_S = (1.0, 2.0)  # sweep's waits between its tries at the kills that fail
#: How long past a command's limit e2b is given to deliver the end of one that ended within it.
END_GRACE_S = 5.0


class _Failure(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _OutputFlood(Exception):
    """Raised from an output callback to stop reading a command that printed too much."""


class _Retry:
    """When to try something again: after a wait that doubles (to :data:`_RETRY_MAX_S`) with each
    failure, and not after ``until`` (by then e2b has ended the sandbox at its lifetime).
    """

    def __init__(self, now: float, until: float) -> None:
        self.wait, self.until = _RETRY_FIRST_S, until
        self.due = now + self.wait

    def failed(self, now: float) -> None:
        self.wait = min(2 * self.wait, _RETRY_MAX_S)
        self.due = now + self.wait


class Helper:
    """The SDK calls, on sandboxes this helper created (or reconnects to by id)."""

    def __init__(self, connection: dict[str, Any], owner: str, lifetime_s: float) -> None:
        import e2b

        self.e2b = e2b
        self.connection = connection
        self.owner = owner
        self.lifetime_s = lifetime_s
        self.sandboxes: dict[str, Any] = {}
        self.unkilled: dict[str, _Retry] = {}  # sandbox id -> the next try at killing it
        self.lost: dict[str, _Retry] = {}  # a failed create's CREATE_KEY -> the next look for its sandbox
        self.involved = False  # whether a sandbox of the provider's may be alive (else nothing to sweep)
        self.lock = threading.Lock()
        # SDKs before idempotency keys (e2b < 2.63 or so) retry creates without one.
        self._idempotent_creates = "idempotency_key" in inspect.signature(e2b.Sandbox.create).parameters

    def failure(self, exc: BaseException) -> _Failure:
        """The kind of failure an SDK exception is (see the module's description)."""
        text = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, self._classes("AuthenticationException")):
            return _Failure("unavailable", f"e2b refused the API key: {exc}")
        if isinstance(exc, self._classes("RateLimitException", "ServiceBusyException")):
            return _Failure("busy", text)
        if isinstance(exc, self._classes("FileNotFoundException")):
            return _Failure("not_found", text)
        gone = ("SandboxNotFoundException", "SandboxNotRunningException", "SandboxUnreachableException")
        if isinstance(exc, self._classes(*gone, "GuestUnresponsiveException")):
            return _Failure("broken", text)
        if isinstance(exc, self._classes("InvalidArgumentException")):
            return _Failure("request", text)
        return _Failure("error", text)

    def _classes(self, *names: str) -> tuple[type[BaseException], ...]:
        """The SDK's exception classes of these names that this version has (newer ones add some)."""
        return tuple(c for c in (getattr(self.e2b, n, None) for n in names) if isinstance(c, type))

    def _sandbox(self, sandbox_id: str) -> Any:
        with self.lock:
            found = self.sandboxes.get(sandbox_id)
        if found is None:  # made by an earlier helper: reconnect by id
            self.involved = True
            found = self.e2b.Sandbox.connect(sandbox_id, **self.connection)
            with self.lock:
                self.sandboxes[sandbox_id] = found
        return found

    # --- operations -------------------------------------------------------------------------------
    def create(self, template: str | None, lifetime_s: int, envs: dict[str, str], network: bool) -> str:
        """A new sandbox's id."""
        token = uuid.uuid4().hex
        # The SDK retries a create on 429/502/503/504; one that e2b had made behind a 502 would be
        # made twice, and the first lost. The key makes the retry answer with the same sandbox.
        once: dict[str, Any] = {"idempotency_key": token} if self._idempotent_creates else {}
        try:
            remote = self.e2b.Sandbox.create(
                template=template,
                timeout=lifetime_s,
                envs=envs,
                allow_internet_access=network,
                metadata={OWNER_KEY: self.owner, CREATE_KEY: token},
                **once,
                **self.connection,
            )
        except Exception as exc:
            if self._may_have_made(exc):
                self.involved = True
                log.warning("e2b sandbox create failed (%s): looking for a sandbox it made, to kill it", exc)
                now = time.monotonic()
                with self.lock:
                    self.lost[token] = _Retry(now, now + self.lifetime_s)
            raise
        self.involved = True
        with self.lock:
            self.sandboxes[remote.sandbox_id] = remote
        return str(remote.sandbox_id)

    def _may_have_made(self, exc: Exception) -> bool:
        """Whether a create that raised ``exc`` may have made its sandbox all the same: it timed out or
        failed on e2b's side (a 5xx but 503), rather than being refused or never sent.
        """
        import httpx  # the SDK's HTTP client

        status = getattr(exc, "status_code", None)
        if isinstance(exc, httpx.ConnectError) or (isinstance(status, int) and status < 500):
            return False
        return self.failure(exc).kind == "error"

    def exec(
        self,
        sandbox_id: str,
        command: str,
        envs: dict[str, str],
        timeout_s: float,
        stdin: bytes | None,
        max_output_bytes: int,
        output_kill_bytes: int,
    ) -> dict[str, Any]:
        """Run ``command`` and wait; what happened (the provider maps it to an ``ExecResult``).

        The helper enforces the limit itself (see :class:`_Limit`): e2b, which kills the process at
        its request's timeout, is given :data:`END_GRACE_S` more, so that a command still running at
        its limit (a time-out) is told from one that had ended but whose end e2b withholds.
        """
        e2b = self.e2b
        remote = self._sandbox(sandbox_id)
        out, err = OutputCapture(max_output_bytes), OutputCapture(max_output_bytes)

        def sink(capture: OutputCapture) -> Any:
            def take(text: str) -> None:
                capture.add(_written(text))
                if out.total + err.total > output_kill_bytes:
                    raise _OutputFlood

            return take

        started = time.monotonic()
        try:
            # with background=True this returns once e2b reports the process started
            handle = remote.commands.run(
                command,
                background=True,
                envs=envs,
                timeout=timeout_s + END_GRACE_S,
                stdin=bool(stdin),
                retain_output=False,
            )
        except Exception as exc:
            raise self._unfinished(remote, None, exc) from exc
        if time.monotonic() - started >= timeout_s:  # it had no fair share of its time: not its timeout
            late = TimeoutError(f"its start was reported after its {timeout_s:g}s limit")
            raise self._unfinished(remote, handle, late, starting=True)
        limit = _Limit(remote, handle, started + timeout_s)
        exit_code, flooded, error = -1, False, None
        try:
            if stdin:
                handle.send_stdin(stdin)
                handle.close_stdin()
            exit_code = handle.wait(on_stdout=sink(out), on_stderr=sink(err)).exit_code
        except e2b.CommandExitException as exc:
            exit_code = exc.exit_code
        except _OutputFlood:
            flooded = True
        except Exception as exc:
            error = exc
        finally:
            at_limit = limit.settle()
        timed_out = at_limit == "overran" and not flooded
        if error is not None:
            # The SDK raises TimeoutException at the stream's timeout, but also for a sandbox that
            # expired or a cancelled stream: only a command that still ran at its limit timed out.
            gone = self._classes("SandboxNotRunningException", "SandboxUnreachableException")
            stalled = isinstance(error, e2b.TimeoutException) and not isinstance(error, gone)
            if stalled and at_limit == "ended":
                raise _Failure(
                    "broken",
                    f"e2b withheld the outcome of a command that ended by itself within its {timeout_s:g}s"
                    " limit (its end never came); its result is unknown",
                ) from error
            if not (stalled and timed_out):
                raise self._unfinished(remote, handle, error) from error
        if flooded or (timed_out and error is not None):
            self._stop(handle)
        elif not timed_out and exit_code >= 128 and not _running(remote):
            # killed with the sandbox (expired, or stopped from outside): not the command's own end
            raise _Failure("broken", f"the e2b sandbox stopped while the command ran (exit code {exit_code})")
        return {
            "exit_code": -9 if timed_out or flooded else exit_code,
            "stdout": out,
            "stderr": err,
            "wall_s": time.monotonic() - started,
            "timed_out": timed_out,
            "output_exceeded": flooded,
        }

    def _unfinished(self, remote: Any, handle: Any, exc: Exception, starting: bool = False) -> _Failure:
        """Why a command has no outcome: the sandbox is gone (broken), or e2b failed to start or to
        follow it in a sandbox that still runs (an error to retry; a started command is stopped first).
        """
        what = self.failure(exc)
        if what.kind in ("unavailable", "busy", "request"):
            return what
        stopped = handle is None or self._stop(handle)
        if not stopped or not _running(remote):
            return _Failure("broken", f"the e2b sandbox stopped or cannot be reached: {what}")
        when = "starting" if starting or handle is None else "following"
        return _Failure("error", f"e2b failed {when} the command (the sandbox still runs): {what}")

    def _stop(self, handle: Any) -> bool:
        """Kill a started command; whether it is surely not running now (killed, or ended already)."""
        try:
            handle.kill()
        except Exception as exc:  # ended already, or the sandbox is going
            return isinstance(exc, self._classes("NotFoundException"))
        return True

    def write(self, sandbox_id: str, path: str, data: bytes | str) -> None:
        """Write ``data`` at the absolute ``path``."""
        self._sandbox(sandbox_id).files.write(path, data)

    def read(self, sandbox_id: str, path: str, max_bytes: int | None) -> bytes:
        """The bytes at the absolute ``path``, streamed so that no more than ``max_bytes`` are held."""
        data = bytearray()
        with self._sandbox(sandbox_id).files.read(path, format="stream") as stream:
            for chunk in stream:
                data += chunk
                if max_bytes is not None and len(data) > max_bytes:
                    raise _Failure(
                        "too_large", f"{path} holds more than {max_bytes} bytes; read it with bash"
                    )
        return bytes(data)

    def health(self, sandbox_id: str) -> str | None:
        """None while the sandbox answers, else why not."""
        return None if self._sandbox(sandbox_id).is_running() else "the e2b sandbox is not running"

    def ping(self) -> str:
        """An answer at once: the caller checks that this process is not hung."""
        return "pong"

    def kill(self, sandbox_id: str) -> None:
        """Kill the sandbox (gone already is fine); if e2b fails to, it is tried again later."""
        self.involved = True
        with self.lock:
            self.sandboxes.pop(sandbox_id, None)
        self._kill(sandbox_id)

    def _kill(self, sandbox_id: str) -> bool:
        """Whether the sandbox is gone now; if not, another try is scheduled (see :meth:`retry`)."""
        try:
            self.e2b.Sandbox.kill(sandbox_id, **self.connection)  # False if gone already
        except Exception as exc:
            now = time.monotonic()
            with self.lock:
                retry = self.unkilled.get(sandbox_id)
                if retry is None:
                    retry = self.unkilled[sandbox_id] = _Retry(now, now + self.lifetime_s)
                elif retry.due <= now:  # this was the try it scheduled
                    retry.failed(now)
                wait = retry.due - now
            log.warning("killing e2b sandbox %s failed (%s): trying again in %.0f s", sandbox_id, exc, wait)
            return False
        with self.lock:
            self.unkilled.pop(sandbox_id, None)
        return True

    def retry(self) -> None:
        """Try again the kills that are due, and look for the sandboxes of failed creates that are."""
        now = time.monotonic()
        with self.lock:
            for pending in (self.unkilled, self.lost):
                for key in [k for k, r in pending.items() if r.until <= now]:
                    del pending[key]
            due = [i for i, r in self.unkilled.items() if r.due <= now]
            tokens = {t for t, r in self.lost.items() if r.due <= now}
        if tokens:
            try:
                made = {token: sandbox_id for sandbox_id, token in self._tagged().items()}
            except Exception as exc:
                log.warning("listing this provider's e2b sandboxes failed (%s): trying again later", exc)
                made = {}
            with self.lock:
                for token in tokens:
                    if token in made:
                        log.warning(
                            "e2b sandbox %s was made by a create that failed: killing it", made[token]
                        )
                        del self.lost[token]
                        due.append(made[token])
                    else:  # not made (yet): look again later
                        self.lost[token].failed(now)
        for sandbox_id in due:
            self._kill(sandbox_id)

    def _tagged(self) -> dict[str, str]:
        """The live sandboxes with this provider's tag: their ids, and the create that made each."""
        query = self.e2b.SandboxQuery(metadata={OWNER_KEY: self.owner})
        pages = self.e2b.Sandbox.list(query=query, **self.connection)
        found: dict[str, str] = {}
        while pages.has_next:
            for info in pages.next_items():
                found[info.sandbox_id] = info.metadata.get(CREATE_KEY, "")
        return found

    def sweep(self) -> None:
        """Kill every sandbox with this provider's tag, and every one whose kill failed: the provider
        is closed or gone, so none is of use to anyone. Those that live on are logged as errors.
        """
        if not self.involved:  # every create was refused (or none made): nothing of ours can be alive
            return
        with self.lock:
            ids = set(self.unkilled)
        problems = []
        try:
            ids.update(self._tagged())
        except Exception as exc:
            problems.append(f"listing them failed ({exc}), so any that failed creates made were not killed")
        left = sorted(ids)
        for wait in (*_SWEEP_WAITS_S, None):
            left = [i for i in left if not self._kill(i)]
            if not left or wait is None:
                break
            time.sleep(wait)
        if left:
            problems.insert(0, f"e2b sandboxes {', '.join(left)} could not be killed")
        if problems:
            log.error(
                "closing the e2b provider: %s. They run, and are billed, until e2b ends them %.0f s after"
                " their creation (lifetime_s); end them now with: e2b sandbox kill --all --metadata=%s=%s",
                "; ".join(problems),
                self.lifetime_s,
                OWNER_KEY,
                self.owner,
            )

    # --- serving ----------------------------------------------------------------------------------
    def handle(self, conn: Connection) -> None:
        """Answer one request on ``conn``."""
        try:
            op, args = conn.recv()
            if op not in OPERATIONS:
                raise _Failure("request", f"unknown e2b helper operation {op!r}")
            try:
                value = getattr(self, op)(*args)
            except _Failure:
                raise
            except Exception as exc:
                raise self.failure(exc) from exc
            if op == "create" and not _taken(conn, ("ok", value)):
                log.warning("e2b sandbox %s was made after its caller stopped waiting: killing it", value)
                self.kill(value)
                return
            conn.send(("ok", value))
        except _Failure as failure:
            conn.send(("error", failure.kind, str(failure)))
        except (EOFError, OSError):
            pass  # the caller went away (its action was killed)
        finally:
            conn.close()


class _Limit:
    """The helper's own check at a command's limit, in a thread of its own: whether the command still
    ran then ("overran": it is killed, a time-out) or had ended by itself ("ended": e2b owes its end),
    "unknown" where e2b answered neither the process list nor the kill, None before the limit.
    """

    def __init__(self, remote: Any, handle: Any, deadline: float) -> None:
        self.remote, self.handle = remote, handle
        self.verdict: str | None = None
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._check)
        self._timer.daemon = True
        self._timer.start()

    def _check(self) -> None:
        try:
            running: bool | None = any(p.pid == self.handle.pid for p in self.remote.commands.list())
        except Exception:  # the kill's answer tells instead
            running = None
        if running is False:
            self.verdict = "ended"
            return
        try:
            killed = bool(self.handle.kill())  # False: no such process (it ended)
        except Exception:
            self.verdict = "overran" if running else "unknown"
            return
        self.verdict = "overran" if running or killed else "ended"

    def settle(self) -> str | None:
        """The verdict, once a check under way is done (no check is made after this)."""
        self._timer.cancel()
        self._timer.join()
        return self.verdict


def _written(text: str) -> bytes:
    """The bytes a command wrote, as far as the SDK's text tells: it decodes output as UTF-8 with
    ``errors="replace"``, each undecodable byte (a maximal invalid subsequence, as Python's decoder
    goes) becoming one U+FFFD. Each U+FFFD is taken back as one invalid byte, so that limits count what
    the local providers count, not U+FFFD's three; decoded again it reads as the same U+FFFD.
    """
    return text.replace("\ufffd", "\udcff").encode("utf-8", "surrogateescape")


def _taken(conn: Connection, reply: Any) -> bool:
    """Whether the caller received ``reply`` and said so (it sends :data:`TAKEN` back; one that
    stopped waiting closed the connection, and a reply sent into it is lost without an error).
    """
    try:
        conn.send(reply)
        return bool(conn.poll(_TAKE_S)) and conn.recv() == TAKEN
    except (EOFError, OSError):
        return False


def _running(remote: Any) -> bool:
    """Whether e2b says the sandbox runs (an unanswered question counts as no)."""
    try:
        return bool(remote.is_running())
    except Exception:
        return False


def serve(address: str, authkey: bytes, helper: Helper) -> None:
    """Accept calls on ``address`` until stdin closes (the provider that started us is gone)."""
    listener = Listener(address, family="AF_UNIX", authkey=authkey)
    print("ready", flush=True)

    def watch_parent() -> None:
        sys.stdin.read()  # ends when the provider closes it, or when its process (and children) ended
        helper.sweep()
        os._exit(0)

    def retry_forever() -> None:
        while True:
            time.sleep(_RETRY_FIRST_S / 2)
            try:
                helper.retry()
            except Exception:
                log.exception("e2b helper: trying failed kills again raised")

    threading.Thread(target=watch_parent, daemon=True).start()
    threading.Thread(target=retry_forever, daemon=True).start()
    while True:
        try:
            conn = listener.accept()
        except (OSError, EOFError) as exc:  # a caller that failed authentication or hung up
            log.debug("e2b helper: refused a connection: %s", exc)
            continue
        threading.Thread(target=helper.handle, args=(conn,), daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    """``python -m tangram_env.server.sandbox.e2b_helper --address PATH`` (key and settings in env)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", required=True)
    args = parser.parse_args(argv)
    authkey = bytes.fromhex(os.environ.pop("TANGRAM_E2B_HELPER_KEY"))
    connection: dict[str, Any] = {
        "api_key": os.environ.pop("TANGRAM_E2B_API_KEY"),
        "request_timeout": float(os.environ.pop("TANGRAM_E2B_REQUEST_TIMEOUT", "30")),
    }
    for name in ("domain", "api_url"):
        value = os.environ.pop(f"TANGRAM_E2B_{name.upper()}", "")
        if value:
            connection[name] = value
    retries = os.environ.pop("TANGRAM_E2B_RETRIES", "")
    if retries:
        connection["retries"] = int(retries)  # the SDK's own retries of 429/503 (e2b 2.x's ApiParams)
    owner = os.environ.pop("TANGRAM_E2B_OWNER")
    lifetime_s = float(os.environ.pop("TANGRAM_E2B_LIFETIME"))
    logging.basicConfig(level=logging.WARNING)
    serve(args.address, authkey, Helper(connection, owner, lifetime_s))


if __name__ == "__main__":
    main()
