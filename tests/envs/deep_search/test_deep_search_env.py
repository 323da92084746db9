"""The deep-search env on a real orchestrator and a real local search service."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import tangram_env
from tangram_env.envs.deep_search import exact_match, f1_score, normalize_answer
from tangram_env.envs.deep_search.grading import (
    names_another_choice,
    names_another_number,
    names_no_choice,
)
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


def test_gold_forms_and_answers_that_name_every_choice() -> None:
    assert exact_match("Jonathan Edwards", "Jonathan Edwards (theologian)") == 1.0
    assert exact_match("Jonathan Edwards (theologian)", "Jonathan Edwards (theologian)") == 1.0
    choices = ["Petrarch", "Luis Buñuel"]
    assert names_another_choice("Luis Bunuel, or Petrarch", "Petrarch", choices)
    assert not names_another_choice("Petrarch", "Petrarch", choices)
    assert not names_another_choice("John Smith", "John Smith", ["John Smith", "Adam Smith"])  # shared words
    # Token F1 paid a hedge: half for three years around the right one, half for a word both names share.
    assert names_another_number("1927 1928 1929", "1928") and f1_score("1927 1928 1929", "1928") == 0.5
    assert not names_another_number("in 1928", "1928") and not names_another_number("1927", "Paris")
    choices = ["Guy de Maupassant", "Paco de Lucía"]
    assert names_no_choice("de", "Paco de Lucía", choices)
    # A shared word and one of neither name: F1 paid it 0.4, whichever name was right.
    assert names_no_choice("de zzqx", "Paco de Lucía", choices)
    assert f1_score("de zzqx", "Guy de Maupassant") == 0.4
    assert not names_no_choice("Paco de Lucía", "Paco de Lucía", choices)
    assert not names_no_choice("Lucía", "Paco de Lucía", choices)
    assert not names_no_choice("yes", "yes", choices)  # a yes/no comparison names no choice
    assert not names_no_choice("John Smith", "John Smith", ["John Smith", "John Smith Jr"])
    assert names_no_choice("Smith", "John Smith", ["John Smith", "John Smith Jr"])


def test_agent_mistakes_are_invalid_actions_never_errors(
    server: Any, tiny_index: tuple[Path, list[dict[str, Any]]], search_service: Any
) -> None:
    env = tangram_env.make(
        "deep-search", index=tiny_index[0], search_url=search_service.url, address=server.address, max_turns=8
    )
    try:
        env.reset(seed=0)
        # Each used to raise out of step(): a 400 from the service, then RecursionError.
        for action in (
            call("search", query=" \t"),
            "[" * 3000,
            '{"name": "answer", "arguments": {"answer": ' + "[" * 3000 + "}}",
            "x" * 5000,
        ):
            obs, reward, terminated, truncated, info = env.step(action)
            assert "Invalid action" in obs and reward == 0.0 and not terminated, obs[:200]
    finally:
        env.close()


def test_naming_both_choices_earns_nothing_and_the_episode_ends_at_its_answer(
    server: Any, tiny_index: tuple[Path, list[dict[str, Any]]], search_service: Any
) -> None:
    index, questions = tiny_index
    comparison = next(q for q in questions if q["type"] == "comparison")
    env = tangram_env.make(
        "deep-search", index=index, search_url=search_service.url, address=server.address, reward="f1"
    )
    try:
        env.reset(options={"question_id": comparison["id"]})
        _, reward, terminated, _, info = env.step(call("answer", answer=" ".join(comparison["searches"])))
        assert terminated and reward == 0.0 and info["f1"] == 0.0  # token F1 alone paid about 2/3
        with pytest.raises(gymnasium.error.ResetNeeded, match="episode has ended"):
            env.step(call("answer", answer=comparison["answer"]))  # was graded: 1.0 on a second try
    finally:
        env.close()


def test_a_list_of_guesses_earns_nothing_and_a_non_string_answer_is_refused(
    server: Any, tiny_index: tuple[Path, list[dict[str, Any]]], search_service: Any
) -> None:
    index, questions = tiny_index
    two_hop = next(q for q in questions if q["type"] != "comparison")
    year = int(two_hop["answer"])  # two-hop questions ask for a year
    env = tangram_env.make(
        "deep-search", index=index, search_url=search_service.url, address=server.address, reward="f1"
    )
    try:
        env.reset(options={"question_id": two_hop["id"]})
        obs, reward, terminated, _, _ = env.step(call("answer", answer=[str(year)]))
        assert "Invalid action" in obs and "must be a string" in obs and not terminated, obs[:200]
        _, reward, terminated, _, info = env.step(call("answer", answer=f"{year - 1} {year} {year + 1}"))
        assert terminated and reward == 0.0 and info["f1"] == 0.0  # token F1 alone paid 0.5
    finally:
        env.close()


def test_a_search_service_that_is_down_flags_the_step_in_a_vector_env(
    server: Any, tiny_index: tuple[Path, list[dict[str, Any]]], search_service: Any
) -> None:
    envs = tangram_env.make_vec(
        "deep-search", 2, index=tiny_index[0], search_url="http://127.0.0.1:9", address=server.address
    )
    try:
        envs.reset(seed=0)
        _, rewards, _, truncated, infos = envs.step(
            [call("search", query="Ada Quill"), call("answer", answer="x")]
        )
        assert np.isnan(rewards[0]) and not infos["reward_valid"][0] and truncated[0]  # no reward, not 0.0
        assert rewards[1] == 0.0 and infos["reward_valid"][1]  # the other env's step is kept
    finally:
        envs.close()
