"""The embedded orchestrator: a ``tangram-server`` child process for users who configured none.

One per process, shared by every client in it, started on first use and stopped when the last client
closes (or the process exits). It imports the modules in which this process registered tools and
reward models, so they run there exactly as on a real server.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import tempfile
import threading

from tangram_env.errors import ServerUnavailable
from tangram_env.kinds import kind_registry
from tangram_env.launch import ServerProcess
from tangram_env.plugins import SAFE_PATH_MARKER

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0


def _plugin_args() -> list[str]:
    """``--plugin``/``--plugin-file`` flags for the modules that registered kinds in this process."""
    args: list[str] = []
    for module in kind_registry.user_modules():
        if module == "__main__":
            main_file = getattr(sys.modules.get("__main__"), "__file__", None)
            if not main_file:
                raise RuntimeError(
                    "tools or reward models registered in an interactive session cannot run on an "
                    "embedded orchestrator: define them in a module (or a script) and import it"
                )
            args += ["--plugin-file", os.path.abspath(main_file)]
        else:
            args += ["--plugin", module]
    return args


class EmbeddedServer:
    """A running child orchestrator and the number of clients using it."""

    def __init__(self) -> None:
        self._owner = os.getpid()
        self._dir = tempfile.mkdtemp(prefix="tangram-")
        self.address = f"ipc://{self._dir}/orchestrator.sock"
        self.users = 0
        env = dict(os.environ)
        # The child must import what this process did: its sys.path (tests, scripts' folders) travels,
        # in order ("" is the working directory), and nothing goes ahead of it: `python -m` would put
        # the working directory first, where another tools.py would shadow this process's.
        path = [os.path.abspath(p or os.curdir) for p in sys.path]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in path if os.path.exists(p)))
        if not env.get("PYTHONSAFEPATH"):
            env["PYTHONSAFEPATH"] = "1"
            env[SAFE_PATH_MARKER] = "1"  # actions' processes unset both (plugins.end_safe_path)
        env.pop("TANGRAM_ADDRESS", None)
        #: The modules it imports: a kind registered later is unknown to it (see unknown_kind_hint).
        self.modules = frozenset(kind_registry.user_modules())
        try:
            self._server = ServerProcess(
                "--parent-pid",
                str(os.getpid()),
                *_plugin_args(),
                bind=self.address,
                log_level=os.environ.get("TANGRAM_EMBEDDED_LOG_LEVEL", "WARNING"),
                env=env,
                new_session=True,
                timeout_s=_START_TIMEOUT_S,
            )
        except ServerUnavailable as exc:
            self._remove_dir()
            raise ServerUnavailable(
                f"the embedded orchestrator did not start: {exc}; or set TANGRAM_ADDRESS"
            ) from None
        self.process = self._server.process
        log.info("embedded orchestrator %d on %s", self.process.pid, self.address)

    def exited(self) -> str | None:
        """Why this client can never reach the child again, if it exited (None while it runs)."""
        code = self.process.poll()
        if code is None or os.getpid() != self._owner:
            return None
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"with status {code}"
        return (
            f"the embedded orchestrator (process {self.process.pid}) exited {how}: its clients cannot "
            "reach it again; make a new env or Client, which starts a new one (set "
            "TANGRAM_EMBEDDED_LOG_LEVEL=INFO to see its log)"
        )

    def release(self) -> None:
        """One client fewer; the last one stops the server."""
        with _lock:
            self.users -= 1
            if self.users > 0:
                return
            global _current
            if _current is self:
                _current = None
        self.stop()

    def stop(self) -> None:
        """Terminate and reap the child (SIGTERM, then SIGKILL after a grace period); only in the
        process that started it, never in one forked from it.
        """
        if os.getpid() != self._owner:
            return
        self._server.stop(grace_s=10)
        self._remove_dir()

    def _remove_dir(self) -> None:
        try:
            for name in os.listdir(self._dir):
                os.unlink(os.path.join(self._dir, name))
            os.rmdir(self._dir)
        except OSError:
            pass


_lock = threading.Lock()
_current: EmbeddedServer | None = None


def _forget_after_fork() -> None:
    """A forked child starts its own embedded server when it needs one: the parent's stops with the
    parent (and its clients' connections stayed there).
    """
    global _lock, _current
    _lock, _current = threading.Lock(), None


os.register_at_fork(after_in_child=_forget_after_fork)


def acquire_embedded() -> EmbeddedServer:
    """The process's embedded server (started if needed), counted as used once more."""
    from tangram_env.plugins import importing_file

    script = importing_file()
    if script is not None:  # an orchestrator importing a script for its tools, which makes a client
        raise ServerUnavailable(
            f"{script} makes a client (or an env) when imported, and the orchestrator imports it to load "
            'the tools it registers: put that code under `if __name__ == "__main__":`'
        )
    global _current
    with _lock:
        if _current is None or _current.process.poll() is not None:
            _current = EmbeddedServer()
        _current.users += 1
        return _current


def unknown_kind_hint(kind: str, address: str) -> str:
    """Why the orchestrator at ``address`` may not know ``kind``, when this process registered it
    (appended to its ``unknown_kind`` error); empty when this process does not know it either.
    """
    if kind not in kind_registry:
        return ""
    module = kind_registry.get(kind).module
    server = _current
    if server is not None and server.address == address:
        if module not in server.modules:
            how = "register it" if module == "__main__" else f"import {module}"
            return (
                f"; {kind!r} was registered in this process (by {module}) after its embedded orchestrator "
                "started, which imports only the modules that had registered tools and reward models by "
                f"then: {how} before the first Client or make()"
            )
        return (
            f"; {kind!r} is registered in this process by {module}, but not when the embedded "
            "orchestrator imports that module: register it at the module's top level (not under "
            '`if __name__ == "__main__":` or a condition)'
        )
    flag = "--plugin-file <this script>" if module == "__main__" else f"--plugin {module}"
    return (
        f"; {kind!r} is registered in this process (by {module}) but the orchestrator at {address} does "
        f"not import that module: start it with {flag} (or install the module as a tangram_env.plugins "
        "entry point)"
    )


@atexit.register
def _stop_at_exit() -> None:
    if _current is not None:
        _current.stop()
