"""Offline instances made from SWE-bench's own repositories (one each of Django, sympy, flask, requests
and pytest), graded through the env by each repository's own runner: the gold patch gets 1.0, no change
gets 0.0. Preparing them downloads the five source releases once; later runs read the cache.
"""

from __future__ import annotations

from typing import Any

import pytest

from tangram_env.envs.swe_bench import SweBenchEnv, SweBenchInstance
from tangram_env.envs.swe_bench.runners import runner_for
from tests.envs.swe_bench.test_env import apply_gold, call

REPOS = ["Django", "sympy", "flask", "requests", "pytest"]


@pytest.fixture(scope="module")
def repo_instances() -> dict[str, SweBenchInstance]:
    """One prepared instance per repository (with its sandbox image), by repository."""
    from tangram_env.envs.swe_bench.prepare import prepare

    report = prepare(REPOS, limit=len(REPOS), jobs=2)
    by_repo = {i.repo: i for i in report.instances}
    assert len(by_repo) == len(REPOS), report.per_package
    return by_repo


@pytest.mark.slow
@pytest.mark.parametrize(
    ("repo", "runner"),
    [
        ("django/django", "django"),
        ("sympy/sympy", "sympy"),
        ("pallets/flask", "pytest"),
        ("psf/requests", "pytest-options"),
        ("pytest-dev/pytest", "pytest-log"),
    ],
)
def test_gold_gets_1_and_no_change_gets_0_by_the_repositorys_runner(
    repo_instances: dict[str, SweBenchInstance], swe_server: Any, repo: str, runner: str
) -> None:
    inst = repo_instances[repo]
    assert runner_for(inst).name == runner
    env = SweBenchEnv(instances=[inst], address=swe_server.address, max_turns=4)
    try:
        env.reset(seed=0)
        obs, reward, terminated, _, _ = env.step(apply_gold(inst))
        assert "exit code: 0" in obs
        obs, reward, terminated, _, info = env.step(call("submit"))
        assert (reward, terminated) == (1.0, True), obs
        status = info["report"][inst.instance_id]["tests_status"]
        assert status["FAIL_TO_PASS"]["success"] == inst.FAIL_TO_PASS
        assert sorted(status["PASS_TO_PASS"]["success"]) == sorted(inst.PASS_TO_PASS)

        env.reset(seed=0)
        obs, reward, terminated, _, info = env.step(call("submit"))
        assert (reward, terminated) == (0.0, True), obs
        assert "grade_error" not in info  # a verdict, not an infrastructure failure
        failed = info["report"][inst.instance_id]["tests_status"]["FAIL_TO_PASS"]["failure"]
        assert failed == inst.FAIL_TO_PASS
    finally:
        env.close()
