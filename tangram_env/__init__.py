"""Tangram: agent environments for RL of LLMs, with tools and rewards scheduled per action."""

from __future__ import annotations

from tangram_env.errors import (
    ActionCancelled,
    ActionError,
    ActionRejected,
    ActionTimeout,
    AlreadyPendingCallError,
    ClosedEnvError,
    NoAsyncCallError,
    ProtocolError,
    RegistryError,
    ServerUnavailable,
    TangramError,
    UnknownNameError,
)
from tangram_env.kinds import ActionContext, KindSpec, reward_model, tool, tools
from tangram_env.protocol import Action, Demand, Elastic, Result

__version__ = "0.1.0"

__all__ = [
    "Action",
    "ActionCancelled",
    "ActionContext",
    "ActionError",
    "ActionRejected",
    "ActionTimeout",
    "AlreadyPendingCallError",
    "ClosedEnvError",
    "Demand",
    "Elastic",
    "KindSpec",
    "NoAsyncCallError",
    "ProtocolError",
    "RegistryError",
    "Result",
    "ServerUnavailable",
    "TangramError",
    "UnknownNameError",
    "__version__",
    "reward_model",
    "tool",
    "tools",
]
