"""Choosing a provider by name: ``local`` (isolated, the default), ``e2b`` (cloud), ``docker`` (a Docker
engine), ``none`` (opt-out), or one that another package declares as an entry point.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from tangram_env.errors import UnknownNameError, did_you_mean
from tangram_env.sandbox import SandboxProvider

#: Entry-point group where other packages declare providers (``name = "module:Class"``).
ENTRY_POINT_GROUP = "tangram_env.sandbox_providers"

_BUILT_IN = {
    "local": "tangram_env.server.sandbox.local:LocalProvider",
    "e2b": "tangram_env.server.sandbox.e2b_provider:E2BProvider",
    "docker": "tangram_env.server.sandbox.docker:DockerProvider",
    "none": "tangram_env.server.sandbox.unisolated:UnisolatedProvider",
}
PROVIDERS = tuple(_BUILT_IN)


def provider_names() -> list[str]:
    """Every provider name :func:`make_provider` accepts: the built-in ones, then the declared ones."""
    declared = [ep.name for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in _BUILT_IN]
    return [*PROVIDERS, *sorted(declared)]


def make_provider(name: str = "local", **opts: Any) -> SandboxProvider:
    """The sandbox provider called ``name``, configured with ``opts``.

    - ``local``: :class:`~tangram_env.server.sandbox.local.LocalProvider` (``state_dir``,
      ``image_dir``, ``uid_base``, ``uid_count``); refuses to start without isolation.
    - ``e2b``: :class:`~tangram_env.server.sandbox.e2b_provider.E2BProvider` (``api_key`` or
      ``$E2B_API_KEY``, ``template``, ``templates``, ``lifetime_s``, ``domain``, ``api_url``,
      ``retries``).
    - ``docker``: :class:`~tangram_env.server.sandbox.docker.DockerProvider` (``base_url``, ``images``,
      ``pull``, ``workspace``, ``request_timeout_s``, ``sweep``); needs the ``docker`` SDK and an
      engine (``DOCKER_HOST`` is honoured).
    - ``none``: :class:`~tangram_env.server.sandbox.unisolated.UnisolatedProvider`, the explicit
      opt-out: commands run on the host without isolation (logged as a warning).
    - any other name: the class an installed package declares in the ``tangram_env.sandbox_providers``
      entry-point group, or ``module:Class`` (a class importable here, such as a benchmark's wrapper).
    """
    if name in _BUILT_IN:
        module, _, attr = _BUILT_IN[name].partition(":")
        cls = getattr(importlib.import_module(module), attr)
    elif ":" in name:
        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise UnknownNameError(f"cannot load the sandbox provider {name!r}: {exc}") from exc
    else:
        declared = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
        if name not in declared:
            names = provider_names()
            extra = did_you_mean(name, names, n=1)
            raise UnknownNameError(f"no sandbox provider named {name!r} (have {', '.join(names)}){extra}")
        cls = declared[name].load()
    provider: SandboxProvider = cls(**opts)
    return provider
