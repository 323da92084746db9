"""An orchestrator built in the test's own process and served on a thread of it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from tangram_env.kinds import KindRegistry
from tangram_env.server.cli import build
from tangram_env.server.config import ServerSettings
from tangram_env.server.orchestrator import Orchestrator


@contextlib.contextmanager
def serving(settings: ServerSettings, registry: KindRegistry, sandbox_pool: Any) -> Iterator[Orchestrator]:
    """The orchestrator ``build`` makes of these, serving until the block ends (then stopped)."""
    orchestrator = build(settings, registry=registry, sandbox_pool=sandbox_pool)
    thread = threading.Thread(target=orchestrator.serve_forever, daemon=True)
    thread.start()
    try:
        yield orchestrator
    finally:
        orchestrator.stop()
        thread.join(30)
