"""Tangram: agent environments for RL of LLMs, with tools and rewards scheduled per action.

import tangram_env
env = tangram_env.make("code")          # a gymnasium.Env; starts an embedded orchestrator
obs, info = env.reset(seed=0)
"""

from __future__ import annotations

from tangram_env.aio import AsyncClient
from tangram_env.client import Client
from tangram_env.env import AsyncState, EnvGen, TangramEnv
from tangram_env.errors import (
    ActionCancelled,
    ActionError,
    ActionRejected,
    ActionTimeout,
    AlreadyPendingCallError,
    ApiThrottled,
    ClosedEnvError,
    LoopInUseError,
    NoAsyncCallError,
    ProtocolError,
    RegistryError,
    RewardUnavailable,
    ServerUnavailable,
    SettingsError,
    TangramError,
    UnknownNameError,
)
from tangram_env.kinds import ActionContext, KindSpec, RewardModel, reward_model, tool, tools
from tangram_env.protocol import Action, Demand, Elastic, Resources, Result
from tangram_env.registration import (
    make,
    make_vec,
    pprint_registry,
    register,
    register_entry_point_envs,
    registry,
    spec,
)
from tangram_env.rewards import graded
from tangram_env.session import AsyncSandboxSession, CommandResult, SandboxSession
from tangram_env.vector import TangramVectorEnv

__version__ = "0.1.0"

register_entry_point_envs()

__all__ = [
    "Action",
    "ActionCancelled",
    "ActionContext",
    "ActionError",
    "ActionRejected",
    "ActionTimeout",
    "AlreadyPendingCallError",
    "ApiThrottled",
    "AsyncClient",
    "AsyncSandboxSession",
    "AsyncState",
    "Client",
    "ClosedEnvError",
    "CommandResult",
    "Demand",
    "Elastic",
    "EnvGen",
    "KindSpec",
    "LoopInUseError",
    "NoAsyncCallError",
    "ProtocolError",
    "RegistryError",
    "Resources",
    "Result",
    "RewardModel",
    "RewardUnavailable",
    "SandboxSession",
    "ServerUnavailable",
    "SettingsError",
    "TangramEnv",
    "TangramError",
    "TangramVectorEnv",
    "UnknownNameError",
    "__version__",
    "graded",
    "make",
    "make_vec",
    "pprint_registry",
    "register",
    "registry",
    "reward_model",
    "spec",
    "tool",
    "tools",
]
