"""Building the orchestrator's resource managers from its settings (sandbox pool, local workers)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import Any

from tangram_env.kinds import kind_registry
from tangram_env.server.config import ServerSettings

log = logging.getLogger(__name__)


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
    return SandboxPool(provider, spec_for_image=settings.spec_for_image)


def make_configured_scheduler(settings: ServerSettings) -> Any:
    """The scheduling policy ``settings.scheduler`` with ``settings.scheduler_options``."""
    from tangram_env.server.quota_hooks import scheduler_options
    from tangram_env.server.scheduler import DEFAULT_SCHEDULER, make_scheduler

    options = {**settings.scheduler_options, **scheduler_options(settings)}
    return make_scheduler(settings.scheduler or DEFAULT_SCHEDULER, **options)


def start_local_workers(settings: ServerSettings, address: str) -> list[subprocess.Popen[bytes]]:
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
    ]
    for module in settings.plugins:
        cmd += ["--plugin", module]
    for path in settings.plugin_files:
        cmd += ["--plugin-file", path]
    log.info("starting the local reward-model worker")
    return [subprocess.Popen(cmd)]
