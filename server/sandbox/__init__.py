"""Sandboxes: the CPU resource manager that runs every code action, pooled across trajectories.

``make_provider(name)`` gives a provider (``local``: isolated on this host, the default; ``e2b``:
cloud; ``none``: the explicit unisolated opt-out), :class:`SandboxPool` lends its sandboxes to
actions and sessions, and :func:`detect_protections` says what isolation this host offers.
"""

from __future__ import annotations

from tangram_env.images import Image, build_image, get_image, list_images, remove_image
from tangram_env.server.sandbox.pool import SandboxPool
from tangram_env.server.sandbox.protections import detect_protections
from tangram_env.server.sandbox.providers import PROVIDERS, make_provider

__all__ = [
    "PROVIDERS",
    "Image",
    "SandboxPool",
    "build_image",
    "detect_protections",
    "get_image",
    "list_images",
    "make_provider",
    "remove_image",
]
