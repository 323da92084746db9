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
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from multiprocessing.connection import Connection, Listener
from typing import Any

from tangram_env.server.sandbox.procrun import OutputCapture

log = logging.getLogger(__name__)

ERROR_KINDS = ("unavailable", "busy", "broken", "not_found", "too_large", "request", "error")


class _Failure(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _OutputFlood(Exception):
    """Raised from an output callback to stop reading a command that printed too much."""


class Helper:
    """The SDK calls, on sandboxes this helper created (or reconnects to by id)."""

    def __init__(self, connection: dict[str, Any]) -> None:
        import e2b

        self.e2b = e2b
        self.connection = connection
        self.sandboxes: dict[str, Any] = {}
        self.lock = threading.Lock()

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
            found = self.e2b.Sandbox.connect(sandbox_id, **self.connection)
            with self.lock:
                self.sandboxes[sandbox_id] = found
        return found

    # --- operations -------------------------------------------------------------------------------
    def create(self, template: str | None, lifetime_s: int, envs: dict[str, str], network: bool) -> str:
        """A new sandbox's id."""
        remote = self.e2b.Sandbox.create(
            template=template,
            timeout=lifetime_s,
            envs=envs,
            allow_internet_access=network,
            **self.connection,
        )
        with self.lock:
            self.sandboxes[remote.sandbox_id] = remote
        return str(remote.sandbox_id)

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
        """Run ``command`` and wait; what happened (the provider maps it to an ``ExecResult``)."""
        e2b = self.e2b
        remote = self._sandbox(sandbox_id)
        out, err = OutputCapture(max_output_bytes), OutputCapture(max_output_bytes)

        def sink(capture: OutputCapture) -> Any:
            def take(text: str) -> None:
                capture.add(text.encode())
                if out.total + err.total > output_kill_bytes:
                    raise _OutputFlood

            return take

        started = time.monotonic()
        exit_code, timed_out, flooded, handle = -1, False, False, None
        try:
            # with background=True this returns once e2b reports the process started
            handle = remote.commands.run(
                command, background=True, envs=envs, timeout=timeout_s, stdin=bool(stdin), retain_output=False
            )
            if stdin:
                handle.send_stdin(stdin)
                handle.close_stdin()
            exit_code = handle.wait(on_stdout=sink(out), on_stderr=sink(err)).exit_code
        except e2b.CommandExitException as exc:
            exit_code = exc.exit_code
        except _OutputFlood:
            flooded = True
        except Exception as exc:
            # The SDK raises TimeoutException for the command's own limit, but also for a sandbox
            # that expired, a slow start or a cancelled stream: only a started command that reached
            # its limit timed out. Anything else is the infrastructure's failure, never the code's.
            gone = self._classes("SandboxNotRunningException", "SandboxUnreachableException")
            reached_limit = time.monotonic() - started >= timeout_s
            if (
                isinstance(exc, e2b.TimeoutException)
                and not isinstance(exc, gone)
                and handle is not None
                and reached_limit
            ):
                timed_out = True
            else:
                raise self._unfinished(remote, handle, exc) from exc
        if (timed_out or flooded) and handle is not None:
            self._stop(handle)
        elif exit_code >= 128 and not _running(remote):
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

    def _unfinished(self, remote: Any, handle: Any, exc: Exception) -> _Failure:
        """Why a command has no outcome: the sandbox is gone (broken), or e2b failed to start or to
        follow it in a sandbox that still runs (an error to retry; a started command is stopped first).
        """
        what = self.failure(exc)
        if what.kind in ("unavailable", "busy", "request"):
            return what
        stopped = handle is None or self._stop(handle)
        if not stopped or not _running(remote):
            return _Failure("broken", f"the e2b sandbox stopped or cannot be reached: {what}")
        when = "following" if handle is not None else "starting"
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
        """Kill the sandbox (gone already is fine)."""
        with self.lock:
            remote = self.sandboxes.pop(sandbox_id, None)
        try:
            if remote is not None:
                remote.kill()
            else:
                self.e2b.Sandbox.kill(sandbox_id, **self.connection)
        except Exception as exc:  # timed out on e2b's side already
            log.debug("killing e2b sandbox %s: %s", sandbox_id, exc)

    # --- serving ----------------------------------------------------------------------------------
    def handle(self, conn: Connection) -> None:
        """Answer one request on ``conn``."""
        try:
            op, args = conn.recv()
            if op not in ("create", "exec", "write", "read", "health", "kill", "ping"):
                raise _Failure("request", f"unknown e2b helper operation {op!r}")
            try:
                value = getattr(self, op)(*args)
            except _Failure:
                raise
            except Exception as exc:
                raise self.failure(exc) from exc
            conn.send(("ok", value))
        except _Failure as failure:
            conn.send(("error", failure.kind, str(failure)))
        except (EOFError, OSError):
            pass  # the caller went away (its action was killed)
        finally:
            conn.close()


def _running(remote: Any) -> bool:
    """Whether e2b says the sandbox runs (an unanswered question counts as no)."""
    try:
        return bool(remote.is_running())
    except Exception:
        return False


def serve(address: str, authkey: bytes, connection: dict[str, Any]) -> None:
    """Accept calls on ``address`` until stdin closes (the provider that started us is gone)."""
    helper = Helper(connection)
    listener = Listener(address, family="AF_UNIX", authkey=authkey)
    print("ready", flush=True)

    def watch_parent() -> None:
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
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
    logging.basicConfig(level=logging.WARNING)
    serve(args.address, authkey, connection)


if __name__ == "__main__":
    main()
