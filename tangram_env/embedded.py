"""The embedded orchestrator: a ``tangram-server`` child process for users who configured none.

One per process, shared by every client in it, started on first use and stopped when the last client
closes (or the process exits). It imports the modules in which this process registered tools and
reward models, so they run there exactly as on a real server.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import tempfile
import threading

from tangram_env.errors import ServerUnavailable
from tangram_env.kinds import kind_registry
from tangram_env.launch import ServerProcess

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
        self._dir = tempfile.mkdtemp(prefix="tangram-")
        self.address = f"ipc://{self._dir}/orchestrator.sock"
        self.users = 0
        env = dict(os.environ)
        # The child must import what this process can: its sys.path (tests, scripts' folders) travels.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        env.pop("TANGRAM_ADDRESS", None)
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
        """Terminate and reap the child (SIGTERM, then SIGKILL after a grace period)."""
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


def acquire_embedded() -> EmbeddedServer:
    """The process's embedded server (started if needed), counted as used once more."""
    global _current
    with _lock:
        if _current is None or _current.process.poll() is not None:
            _current = EmbeddedServer()
        _current.users += 1
        return _current


@atexit.register
def _stop_at_exit() -> None:
    if _current is not None:
        _current.stop()
