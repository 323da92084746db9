"""gymnasium's ``vector_entry_point`` of every ``tangram/<id>``: ``"tangram_env.vector_entry:<id>"``.

A string rather than a callable, so that the spec stays serialisable (``EnvSpec.to_json``, which
refuses callables); gymnasium imports this module and reads the id as an attribute of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def __getattr__(id: str) -> Callable[..., Any]:
    if id.startswith("__"):  # Python's own probes (__path__, __wrapped__ ...): not env ids
        raise AttributeError(id)
    from tangram_env.registration import make_vec

    return functools.partial(make_vec, id)
