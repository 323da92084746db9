"""The ``code`` env end to end: real orchestrator, real sandboxes, hostile agents."""

from __future__ import annotations

import string
from collections.abc import Iterator

import pytest
from gymnasium.utils.env_checker import check_env

import tangram_env
from tangram_env.envs.code import CodeEnv

RIGHT = """
def run_length_encode(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        j = i
        while j < len(text) and text[j] == text[i]:
            j += 1
        out.append(f"{j - i}{text[i]}")
        i = j
    return "".join(out)
"""


@pytest.fixture
def env(server) -> Iterator[CodeEnv]:  # type: ignore[no-untyped-def]
    e = tangram_env.make("code", address=server.address, max_turns=2)
    yield e
    e.close()


def test_check_env_passes(env: CodeEnv) -> None:
    check_env(env, skip_render_check=True)


def test_spaces_accept_any_printable_source(env: CodeEnv) -> None:
    assert env.action_space.contains("def f():\n\treturn {'a': [1]}  # ~!@#$%^&*()\n")
    assert env.action_space.contains("")
    assert set(string.printable) <= set(env.action_space.character_set)


def test_observations_quoting_unicode_tests_and_errors_are_in_the_observation_space(server) -> None:  # type: ignore[no-untyped-def]
    # The feedback quotes the task's tests ('été ß') and the solution's own errors; the space held
    # only printable ASCII, so gymnasium's contract (every observation in the space) broke.
    with tangram_env.make("code", address=server.address, max_turns=3, hidden_tests=0.0) as e:
        e.reset(options={"task_id": "caesar-shift"})
        obs, *_ = e.step("def caesar_shift(text, shift):\n    return None\n")
        assert "é" in obs and e.observation_space.contains(obs)
        obs, *_ = e.step("raise ValueError('café → naïve')\n")
        assert "naïve" in obs and e.observation_space.contains(obs) and e.action_space.contains("# café")


def test_right_answer_scores_one_and_ends_the_episode(env: CodeEnv) -> None:
    obs, info = env.reset(options={"task_id": "run-length-encode"})
    assert "run_length_encode" in obs and info["task_id"] == "run-length-encode"
    obs, reward, terminated, truncated, info = env.step(RIGHT)
    assert reward == 1.0 and terminated and not truncated
    assert info["passed"] == info["total"] >= 5
    assert all(t["passed"] for t in info["tests"])
    assert info["wall_s"] > 0 and info["cpu_s"] > 0  # what the grading cost, for its declared demand
    (action,) = info["actions"]
    assert action["ok"] and action["act_s"] >= action["run_s"] > 0


def test_wrong_answer_scores_below_one_and_may_retry(env: CodeEnv) -> None:
    env.reset(options={"task_id": "run-length-encode"})
    obs, reward, terminated, truncated, info = env.step("def run_length_encode(text):\n    return text\n")
    assert 0.0 <= reward < 1.0 and not terminated and not truncated
    assert "FAILED" in obs  # the feedback names the failing tests
    first = reward
    obs, reward, terminated, truncated, info = env.step(RIGHT)  # second and last turn
    assert info["score"] == 1.0 and terminated
    assert first + reward == pytest.approx(1.0)  # the return is the last submission's score


def test_the_return_is_the_last_score_however_many_turns_it_took(server) -> None:  # type: ignore[no-untyped-def]
    # Each step paid its submission's whole score: three near misses returned 2.1 and two near misses
    # then the answer 2.4, against 1.0 for solving at once, so a policy learned to stall.
    near_miss = "def run_length_encode(text):\n    return ''.join(f'1{c}' for c in text)\n"
    with tangram_env.make("code", address=server.address, max_turns=3) as e:
        returns = {}
        for name, answers in {
            "at once": [RIGHT],
            "stalled": [near_miss, near_miss, RIGHT],
            "never": [near_miss] * 3,
        }.items():
            e.reset(options={"task_id": "run-length-encode"})
            total, scores = 0.0, []
            for answer in answers:
                _, reward, terminated, truncated, info = e.step(answer)
                total += reward
                scores.append(info["score"])
            assert terminated or truncated
            returns[name] = total
            assert total == pytest.approx(scores[-1])
        assert returns["at once"] == pytest.approx(returns["stalled"]) == pytest.approx(1.0)
        assert 0.0 < returns["never"] < 1.0


def test_seeds_pick_tasks_reproducibly(env: CodeEnv) -> None:
    first = [env.reset(seed=s)[1]["task_id"] for s in range(5)]
    again = [env.reset(seed=s)[1]["task_id"] for s in range(5)]
    assert first == again and len(set(first)) > 1


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("def run_length_encode(text):\n    while True:\n        pass\n", "time"),
        ("raise RuntimeError('at import')\n", "RuntimeError"),
        ("import sys\nsys.stdout.write('x' * 100_000_000)\ndef run_length_encode(t):\n    return None\n", ""),
        ("import os\nos._exit(0)\n", ""),
        ("import sys\nsys.exit(3)\n", ""),
    ],
    ids=["loops-forever", "raises", "prints-100MB", "exits-interpreter", "sys-exit"],
)
def test_hostile_code_scores_zero_with_a_reason(env: CodeEnv, source: str, reason: str) -> None:
    env.reset(options={"task_id": "run-length-encode"})
    obs, reward, terminated, truncated, info = env.step(source)
    assert reward == 0.0
    failures = " ".join(str(t["error"]) for t in info["tests"]) + str(info.get("import_error"))
    assert all(not t["passed"] for t in info["tests"]) and failures.strip()
    assert reason.lower() in failures.lower() or reason.lower() in str(info).lower()
    assert len(info["stdout"]) < 20_000  # output is capped, never shipped whole
    # The env is still usable: the next episode grades normally.
    env.reset(options={"task_id": "run-length-encode"})
    assert env.step(RIGHT)[1] == 1.0


def test_raising_on_every_call_earns_nothing(server) -> None:  # type: ignore[no-untyped-def]
    # Two of int-to-roman's tests check that a bad input raises ValueError: a function that only
    # raised it passed them, for no work at all.
    with tangram_env.make("code", address=server.address, hidden_tests=0.0) as e:
        e.reset(options={"task_id": "int-to-roman"})
        obs, reward, *_, info = e.step("def int_to_roman(n):\n    raise ValueError(n)\n")
        assert reward == 0.0 and info["score"] == 0.0 and info["passed"] == 0
        unearned = [t["name"] for t in info["tests"] if "ordinary tests passes" in (t["error"] or "")]
        assert unearned == ["zero_rejected", "too_large"]
        assert "zero_rejected: FAILED: it raised as required, but" in obs  # the feedback says why


def test_a_per_test_timeout_the_grader_refuses_is_refused_at_once(server) -> None:  # type: ignore[no-untyped-def]
    # 60 was accepted, then every grading was rejected as an invalid payload and reported as an
    # infrastructure failure: RewardUnavailable each step, or NaN masked samples forever in a vector env.
    for bad in (60, 0, -1.0, float("nan"), "2", True):
        with pytest.raises(ValueError, match=r"per_test_timeout_s must be .* at most 30"):
            tangram_env.make("code", address=server.address, per_test_timeout_s=bad)
    vec = tangram_env.make_vec("code", 2, address=server.address, per_test_timeout_s=30)
    try:
        with pytest.raises(ValueError, match="per_test_timeout_s"):
            vec.set_attr("per_test_timeout_s", 60)
        assert vec.get_attr("per_test_timeout_s") == (30.0, 30.0)
        vec.set_attr("per_test_timeout_s", [1, 5.5])
        assert vec.get_attr("per_test_timeout_s") == (1.0, 5.5)
    finally:
        vec.close()


def test_gymnasium_async_vector_env_carries_unicode_observations_in_shared_memory(server) -> None:  # type: ignore[no-untyped-def]
    # gymnasium's AsyncVectorEnv (worker processes, shared memory by default) flattens every
    # observation into its buffer: Text's flattening raised KeyError on a character outside the
    # charset, which feedback quoting the submission's output ('café') has. Its reads, once at start,
    # also handed out the same strings after every step.
    import gymnasium
    from gymnasium import spaces

    from tangram_env.env import AnyText

    space = AnyText(max_length=16, min_length=0, charset=string.printable)
    for text in ("", "café \x00 😀 \ud800", "x" * 16):
        flat = spaces.flatten(space, text)
        assert spaces.flatten_space(space).contains(flat)
        assert spaces.unflatten(space, flat) == text
    vec = gymnasium.make_vec(
        "tangram/code",
        2,
        vectorization_mode="async",
        address=server.address,
        task_ids=["run-length-encode"],
        max_turns=2,
    )
    try:
        first, _ = vec.reset(seed=0)
        assert all(o.startswith("# Task: Run-length encoding") for o in first)
        wrong = "def run_length_encode(text: str) -> str:\n    return 'caf\u00e9'\n"
        obs, rewards, *_ = vec.step([wrong] * 2)
        assert list(rewards) == [0.0, 0.0]
        assert all("caf\u00e9" in o for o in obs), obs
        assert vec.observation_space.contains(obs)
        assert obs != first  # a new step's observations, not the ones read at start
    finally:
        vec.close()
