"""The deep-search env on a real orchestrator and a real local search service."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gymnasium.utils.env_checker import check_env

import tangram_env
from tangram_env.envs.deep_search import exact_match, f1_score, normalize_answer
from tangram_env.envs.deep_search.scripted import call, solve


def test_answer_normalisation_exact_match_and_f1() -> None:
    assert normalize_answer("  The Eiffel-Tower. ") == "eiffeltower"
    assert exact_match("the Ada Quill", "Ada Quill") == 1.0
    assert exact_match("Hergé", "herge") == 1.0
    assert f1_score("Ada Quill", "Ada") == pytest.approx(2 / 3)
    assert f1_score("1850", "1851") == 0.0


def test_tiny_corpus_yields_both_kinds_of_question(tiny_index: tuple[Path, list[dict[str, Any]]]) -> None:
    _, questions = tiny_index
    kinds = {q["type"] for q in questions}
    assert kinds == {"two-hop", "comparison"}
    two_hop = {q["id"]: q for q in questions}["2hop-the_silent_river"]
    assert two_hop["answer"] == "1850" and two_hop["path"] == ["the_silent_river", "ada_quill"]


def test_scripted_agent_scores_one_and_a_wrong_answer_zero(
    server: Any, tiny_index: tuple[Path, list[dict[str, Any]]], search_service: Any
) -> None:
    index, questions = tiny_index
    env = tangram_env.make("deep-search", index=index, search_url=search_service.url, address=server.address)
    try:
        for q in questions:
            reward, info = solve(env, q)
            assert reward == 1.0, (q, info)
            assert info["em"] == 1.0 and info["f1"] == 1.0
        env.reset(options={"question_id": "2hop-the_silent_river"})
        _, reward, terminated, truncated, info = env.step(call("answer", answer="1901"))
        assert (reward, terminated, truncated, info["em"], info["f1"]) == (0.0, True, False, 0.0, 0.0)
    finally:
        env.close()


def test_bad_calls_cost_a_turn_and_the_budget_truncates(
    server: Any, tiny_index: tuple[Path, list[dict[str, Any]]], search_service: Any
) -> None:
    env = tangram_env.make(
        "deep-search", index=tiny_index[0], search_url=search_service.url, address=server.address, max_turns=3
    )
    try:
        env.reset(seed=1)
        obs, reward, terminated, truncated, info = env.step("not json")
        assert "Invalid action" in obs and "not JSON" in obs and not (terminated or truncated)
        obs, *_ = env.step(call("search", query=""))
        assert "Invalid action" in obs
        obs, reward, terminated, truncated, info = env.step(call("open", doc_id="no_such_page"))
        assert "Cannot open" in obs and reward == 0.0 and truncated and not terminated
    finally:
        env.close()


def test_passes_gymnasiums_checker(
    server: Any, tiny_index: tuple[Path, list[dict[str, Any]]], search_service: Any
) -> None:
    env = tangram_env.make(
        "deep-search", index=tiny_index[0], search_url=search_service.url, address=server.address
    )
    try:
        check_env(env.unwrapped, skip_render_check=True)
    finally:
        env.close()


def test_tool_schemas_are_function_calls(tiny_index: tuple[Path, list[dict[str, Any]]]) -> None:
    env = tangram_env.make("deep-search", index=tiny_index[0], search_url="http://127.0.0.1:9")
    try:
        assert [s["function"]["name"] for s in env.unwrapped.tool_schemas] == ["search", "open", "answer"]
        json.dumps(env.unwrapped.tool_schemas)
    finally:
        env.close()


def test_missing_index_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tangram-env prepare deep-search"):
        tangram_env.make("deep-search", index=tmp_path / "none.sqlite")


def test_vector_env_searches_for_every_env_at_once(
    server: Any, tiny_index: tuple[Path, list[dict[str, Any]]]
) -> None:
    envs = tangram_env.make_vec("deep-search", 3, index=tiny_index[0], address=server.address)
    try:
        envs.reset(seed=0)  # no search URL: the three envs share one local service
        calls = [call("search", query="Ada Quill"), call("search", query="Borin Vale")]
        calls.append(call("answer", answer="x"))
        obs, rewards, terminated, truncated, infos = envs.step(calls)
        assert "[ada_quill] Ada Quill" in obs[0] and "[borin_vale] Borin Vale" in obs[1]
        assert list(terminated) == [False, False, True] and list(rewards) == [0.0, 0.0, 0.0]
    finally:
        envs.close()
