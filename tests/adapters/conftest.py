"""The adapters' tests run swe-bench episodes: they share the swe-bench tests' offline set and server."""

from __future__ import annotations

from tests.envs.swe_bench.conftest import offline_subset, swe_server

__all__ = ["offline_subset", "swe_server"]
