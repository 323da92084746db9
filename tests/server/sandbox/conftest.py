"""Fixtures that own real sandboxes: a local provider (bubblewrap, cgroups, tmpfs) and its images."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tangram_env.server.sandbox.local import LocalProvider, LocalSandbox
from tests.server.sandbox.helpers import SMALL


@pytest.fixture(scope="session")
def image_dir() -> Iterator[Path]:
    """A private image root for the session."""
    root = Path.home() / ".cache" / "tangram" / f"test-images-{os.getpid()}"
    root.mkdir(parents=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def provider(tmp_path_factory: pytest.TempPathFactory, image_dir: Path) -> Iterator[LocalProvider]:
    """One local provider for the whole session (probing the host once); every sandbox it made is
    closed at the end."""
    state = tmp_path_factory.mktemp("sandboxes")
    made = LocalProvider(state_dir=str(state), image_dir=str(image_dir))
    yield made
    made.close()


@pytest.fixture
def sandbox(provider: LocalProvider) -> Iterator[LocalSandbox]:
    sb = provider.create(SMALL)
    yield sb
    sb.close()
