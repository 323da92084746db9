"""A trainer's mistakes with the built-in envs are errors at once, never a quiet 0.0 or a random task:
misspelt reset options, actions that are not text, turn limits that are not turns.
"""

from __future__ import annotations

import pytest

import tangram_env
from tangram_env.envs.code import CodeEnv
from tangram_env.envs.deep_search.env import DeepSearchEnv
from tangram_env.envs.swe_bench.env import SweBenchEnv


def test_a_misspelt_reset_option_is_refused_not_ignored(server) -> None:  # type: ignore[no-untyped-def]
    # It was ignored: every sample of a group meant to share one task got a random one.
    with tangram_env.make("code", address=server.address) as env:
        with pytest.raises(ValueError, match=r"no reset option 'taskid'; did you mean 'task_id'\?"):
            env.reset(options={"taskid": "run-length-encode"})
        with pytest.raises(TypeError, match="takes a dict"):
            env.reset(options=["task_id"])  # type: ignore[arg-type]
        obs, _ = env.reset(options={"task_id": "run-length-encode"})
        assert obs.startswith("# Task: Run-length encoding")
    assert SweBenchEnv.reset_options == {"instance_id"} and DeepSearchEnv.reset_options == {"question_id"}
    assert CodeEnv.reset_options == {"task_id"}
    assert tangram_env.TangramEnv.reset_options is None  # a user's env takes any options it reads


@pytest.mark.parametrize("action", [123, None, b"def f(): pass", {"source": "def f(): pass"}])
def test_an_action_that_is_not_text_is_a_type_error_and_costs_no_turn(server, action: object) -> None:  # type: ignore[no-untyped-def]
    # str() made each of these a submission graded 0.0, and used a turn.
    with tangram_env.make("code", address=server.address, max_turns=1) as env:
        env.reset(options={"task_id": "run-length-encode"})
        with pytest.raises(TypeError, match=f"takes text actions \\(a str\\), not {type(action).__name__}"):
            env.step(action)  # type: ignore[arg-type]
        _, _, terminated, truncated, info = env.step("def run_length_encode(text): return ''")
        assert info["turn"] == 1 and truncated and not terminated


@pytest.mark.parametrize("env_id", ["code", "deep-search", "swe-bench"])
@pytest.mark.parametrize("turns", [0, -3, "two", 2.5, True])
def test_max_turns_must_be_a_whole_number_of_turns(env_id: str, turns: object) -> None:
    # Each env took what it was given: code truncated after one step at 0 or -3, and failed only at
    # step() on "two"; swe-bench checks before it prepares its instances (minutes on a first run).
    with pytest.raises(ValueError, match=f"max_turns is a whole number of turns, at least 1; got {turns!r}"):
        tangram_env.make(env_id, max_turns=turns)
