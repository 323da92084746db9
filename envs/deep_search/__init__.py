"""The ``deep-search`` env: multi-hop questions over an encyclopaedia, through a quota'd search API."""

from __future__ import annotations

from tangram_env.envs.deep_search.env import TOOL_SCHEMAS, DeepSearchEnv, parse_call
from tangram_env.envs.deep_search.grading import exact_match, f1_score, normalize_answer

__all__ = ["TOOL_SCHEMAS", "DeepSearchEnv", "exact_match", "f1_score", "normalize_answer", "parse_call"]
