"""Moved: the Docker provider is :mod:`tangram_env.server.sandbox.docker` (``make_provider("docker")``).

This name stays importable for code written against it.
"""

from __future__ import annotations

from tangram_env.server.sandbox.docker import DockerProvider, DockerSandbox

__all__ = ["DockerProvider", "DockerSandbox"]
