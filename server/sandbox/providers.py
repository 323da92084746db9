"""Choosing a provider by name: ``local`` (isolated, the default), ``e2b`` (cloud), ``none`` (opt-out)."""

from __future__ import annotations

import difflib
from typing import Any

from tangram_env.errors import UnknownNameError
from tangram_env.sandbox import SandboxProvider

PROVIDERS = ("local", "e2b", "none")


def make_provider(name: str = "local", **opts: Any) -> SandboxProvider:
    """The sandbox provider called ``name``, configured with ``opts``.

    - ``local``: :class:`~tangram_env.server.sandbox.local.LocalProvider` (``state_dir``,
      ``image_dir``, ``uid_base``, ``uid_count``); refuses to start without isolation.
    - ``e2b``: :class:`~tangram_env.server.sandbox.e2b_provider.E2BProvider` (``api_key`` or
      ``$E2B_API_KEY``, ``template``, ``templates``, ``lifetime_s``, ``domain``, ``api_url``).
    - ``none``: :class:`~tangram_env.server.sandbox.unisolated.UnisolatedProvider`, the explicit
      opt-out: commands run on the host without isolation (logged as a warning).
    """
    if name == "local":
        from tangram_env.server.sandbox.local import LocalProvider

        return LocalProvider(**opts)
    if name == "e2b":
        from tangram_env.server.sandbox.e2b_provider import E2BProvider

        return E2BProvider(**opts)
    if name == "none":
        from tangram_env.server.sandbox.unisolated import UnisolatedProvider

        return UnisolatedProvider(**opts)
    hint = difflib.get_close_matches(name, PROVIDERS, n=1)
    extra = f"; did you mean {hint[0]!r}?" if hint else ""
    raise UnknownNameError(f"no sandbox provider named {name!r} (have {', '.join(PROVIDERS)}){extra}")
