"""Fixtures for scale-out tests: the processes a test starts, and its private network."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

# The shared checks live in procs.py: let pytest explain their failures as it does in test modules.
pytest.register_assert_rewrite("tests.cluster.procs")

from tests.cluster.netns import Cluster, unavailable_reason  # noqa: E402
from tests.cluster.procs import Processes  # noqa: E402


@pytest.fixture
def procs() -> Iterator[Processes]:
    """Processes started by the test; those still running are stopped at teardown."""
    p = Processes()
    yield p
    p.close()


@pytest.fixture
def netns_cluster() -> Iterator[Cluster]:
    """A bridge and three hosts in namespaces of their own (skipped without root or ``ip netns``)."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    net = Cluster.create(3)
    try:
        yield net
    finally:
        net.close()
