"""The ``swe-bench`` env: SWE-bench instances (the offline set made from PyPI packages, or the real
data sets), tools that run in the episode's sandbox, grading by the instance's tests.

    env = tangram_env.make("swe-bench")     # offline set, prepared on first use
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step('{"name": "bash", "arguments": {"command": "ls"}}')
"""

from __future__ import annotations

from tangram_env.envs.swe_bench.env import SweBenchEnv, grade_action, tool_schemas
from tangram_env.envs.swe_bench.instance import (
    DatasetUnavailable,
    InstanceError,
    SweBenchInstance,
    load_instances,
    validate_instance,
)

__all__ = [
    "DatasetUnavailable",
    "InstanceError",
    "SweBenchEnv",
    "SweBenchInstance",
    "grade_action",
    "load_instances",
    "tool_schemas",
    "validate_instance",
]
