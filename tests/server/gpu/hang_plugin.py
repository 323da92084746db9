"""A reward model whose forward pass never returns for the item "hang" (servers and workers of the
stuck-device test import this module as a plugin)."""

from __future__ import annotations

import threading

import tangram_env

_never = threading.Event()


@tangram_env.reward_model(name="test.hangs", gpu=0.5)
def hangs(items: list[str]) -> list[float]:
    """1.0 per item, except that an item "hang" holds the device for good."""
    if "hang" in items:
        _never.wait()
    return [1.0] * len(items)
