"""Fixtures of the deep-search tests: the tiny index and an open search service over it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tangram_env.envs.deep_search.service import ServiceProcess
from tests.envs.deep_search.tiny import build_tiny_index


@pytest.fixture(scope="session")
def tiny_index(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """An index of :data:`TINY_DOCS` with its validated questions."""
    return build_tiny_index(tmp_path_factory.mktemp("deep-search"))


@pytest.fixture
def search_service(tiny_index: tuple[Path, list[dict[str, Any]]]) -> Iterator[ServiceProcess]:
    """An open (no keys, no quota) search service over the tiny index."""
    svc = ServiceProcess(tiny_index[0])
    yield svc
    svc.stop()
