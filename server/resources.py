"""Building the orchestrator's resource managers from its settings (sandbox pool, local workers)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

from tangram_env.kinds import kind_registry
from tangram_env.server.config import ServerSettings
from tangram_env.server.security import read_public_key

log = logging.getLogger(__name__)

#: How long an action no worker here fits waits for Ray capacity: the workers of the nodes already in
#: the cluster register within seconds; a node the autoscaler adds boots in minutes.
RAY_AWAIT_NODES_S = 30.0
RAY_AWAIT_AUTOSCALE_S = 900.0


def make_sandbox_pool(settings: ServerSettings) -> Any:
    """The sandbox pool of ``settings.sandbox_provider`` with its options, giving each image's sandboxes
    the spec the settings say; the protections this host offers are logged.
    """
    from tangram_env.server.sandbox import SandboxPool, detect_protections, make_provider

    protections = detect_protections()
    log.info(
        "sandbox protections: %s", ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in protections.items())
    )
    provider = make_provider(settings.sandbox_provider, **settings.provider_options())
    return SandboxPool(provider, spec_for_image=settings.spec_for_image, max_idle_s=settings.warm_idle_s)


def make_configured_scheduler(settings: ServerSettings) -> Any:
    """The scheduling policy ``settings.scheduler`` with ``settings.scheduler_options``."""
    from tangram_env.server.quota_hooks import scheduler_options
    from tangram_env.server.scheduler import (
        DEFAULT_SCHEDULER,
        SCHEDULERS,
        ActionLevelScheduler,
        make_scheduler,
    )

    name = settings.scheduler or DEFAULT_SCHEDULER
    options = {**settings.scheduler_options, **scheduler_options(settings)}
    factory = SCHEDULERS.get(name)
    action_level = isinstance(factory, type) and issubclass(factory, ActionLevelScheduler)
    if settings.ray.address is not None and action_level:
        # Ray's nodes register their workers after the orchestrator is up, and its autoscaler adds
        # nodes for what the queue lacks: what no worker here fits yet waits for them a while.
        wait = RAY_AWAIT_AUTOSCALE_S if settings.ray.autoscale else RAY_AWAIT_NODES_S
        options.setdefault("await_capacity_s", wait)
    return make_scheduler(name, **options)


def start_local_workers(settings: ServerSettings, address: str) -> list[SupervisedWorker]:
    """Worker processes the orchestrator starts on its own host: a reward-model worker, when any
    reward models are registered (it loads them on the first action that needs them).
    """
    if not settings.gpu_worker or not any(s.role == "reward_model" for s in kind_registry):
        return []
    cmd = [
        sys.executable,
        "-m",
        "tangram_env.server.worker",
        "--connect",
        address,
        "--runner",
        "gpu",
        "--worker-id",
        "local-gpu",
        "--parent-pid",
        str(os.getpid()),
        "--max-body",
        str(settings.max_body),
        "--stuck-after-s",
        f"{settings.gpu_stuck_after_s:g}",
        # The orchestrator's own level: an embedded one (WARNING) printed the worker's INFO lines.
        "--log-level",
        logging.getLevelName(logging.getLogger("tangram_env").getEffectiveLevel()),
    ]
    for module in settings.plugins:
        cmd += ["--plugin", module]
    for path in settings.plugin_files:
        cmd += ["--plugin-file", path]
    env = dict(os.environ)
    if settings.worker_token is not None:  # in its environment, not on a command line others can read
        env["TANGRAM_WORKER_TOKEN"] = settings.worker_token.get_secret_value()
    if settings.curve_secret_key_file:
        # A keyed orchestrator hears no peer without the handshake: the worker gets the public key,
        # and the orchestrator's own pair as its client key, which the orchestrator always accepts
        # (whoever holds that secret can be the orchestrator anyway).
        env["TANGRAM_CURVE_SERVER_KEY"] = read_public_key(settings.curve_secret_key_file)
        env["TANGRAM_CURVE_CLIENT_KEY_FILE"] = settings.curve_secret_key_file
    return [SupervisedWorker("the local reward-model worker", cmd, env)]


class SupervisedWorker:
    """A worker process the orchestrator started itself, started again whenever it dies: nothing
    else would, and the actions only it serves (reward models) would wait for it forever. A worker
    that dies soon after each start is restarted after a doubling delay (at most a minute).
    """

    STABLE_S = 60.0  # alive this long: its next death restarts it at once

    def __init__(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.name, self.cmd, self.env = name, cmd, env
        self._stopping = threading.Event()
        self._proc = self._start()
        self._watcher = threading.Thread(target=self._watch, name="supervise-worker", daemon=True)
        self._watcher.start()

    def _start(self) -> subprocess.Popen[bytes]:
        log.info("starting %s", self.name)
        self._started = time.monotonic()
        return subprocess.Popen(self.cmd, env=self.env)

    def _watch(self) -> None:
        delay = 1.0
        while not self._stopping.wait(0.5):
            code = self._proc.poll()
            if code is None:
                continue
            if time.monotonic() - self._started >= self.STABLE_S:
                delay = 1.0
            log.warning("%s exited (status %s); starting it again in %.0fs", self.name, code, delay)
            if self._stopping.wait(delay):
                return
            self._proc = self._start()
            delay = min(60.0, delay * 2)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop supervising, then the worker (killed if it does not stop within ``timeout_s``)."""
        self._stopping.set()
        self._watcher.join()
        self._proc.terminate()
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
