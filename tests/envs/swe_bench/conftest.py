"""Fixtures for the swe-bench env: a small prepared offline set and an orchestrator that serves its tools.

The offline set is built from real PyPI source distributions into the user's cache
(``$TANGRAM_CACHE_DIR/swe-bench``, default ``~/.cache/tangram/swe-bench``) the first time, then read
from there; the fixture prepares only two packages, a few instances each.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tangram_env.envs.swe_bench.instance import SweBenchInstance
from tests.conftest import ServerProcess

PLUGINS = ("tangram_env.shell_tools", "tangram_env.envs.swe_bench.tools")
SUBSET = ["inflection", "isodate"]


@pytest.fixture(scope="session")
def offline_subset() -> list[SweBenchInstance]:
    """Instances of two packages, prepared (with sandbox images) or read from the cache."""
    from tangram_env.envs.swe_bench.prepare import prepare

    report = prepare(SUBSET, limit=6, jobs=2)
    assert report.instances, "prepare validated no instance"
    return report.instances


class Orchestrator(ServerProcess):
    """The test suite's ``tangram-server`` child, with the generic and swe-bench tools named explicitly."""

    def __init__(self, *extra: str, timeout_s: float = 60.0) -> None:
        super().__init__(*(a for p in PLUGINS for a in ("--plugin", p)), *extra, timeout_s=timeout_s)


@pytest.fixture(scope="session")
def swe_server() -> Iterator[Orchestrator]:
    """One orchestrator for the session's episodes and tool calls."""
    srv = Orchestrator()
    yield srv
    srv.stop()
