"""SweBenchEnv episodes through a real orchestrator, on instances of the prepared offline set."""

from __future__ import annotations

import json
from typing import Any

import pytest
from gymnasium.utils.env_checker import check_env

from tangram_env import Client, TangramVectorEnv
from tangram_env.envs.swe_bench import SweBenchEnv, SweBenchInstance


def call(name: str, **arguments: Any) -> str:
    return json.dumps({"name": name, "arguments": arguments})


def apply_gold(inst: SweBenchInstance) -> str:
    return call("bash", command=f"git apply <<'TANGRAM_PATCH_END'\n{inst.patch}TANGRAM_PATCH_END\n")


@pytest.fixture
def env(offline_subset: list[SweBenchInstance], swe_server: Any) -> Any:
    e = SweBenchEnv(instances=offline_subset, address=swe_server.address, max_turns=5)
    yield e
    e.close()


def test_check_env_passes(env: SweBenchEnv) -> None:
    check_env(env, skip_render_check=True)


def test_seeds_pick_instances_reproducibly_and_options_pick_by_id(
    env: SweBenchEnv, offline_subset: list[SweBenchInstance]
) -> None:
    picks = [env.reset(seed=s)[1]["instance_id"] for s in range(12)]
    assert picks == [env.reset(seed=s)[1]["instance_id"] for s in range(12)]
    assert len(set(picks)) > 1
    target = offline_subset[-1].instance_id
    obs, info = env.reset(seed=0, options={"instance_id": target})
    assert info["instance_id"] == target
    assert offline_subset[-1].problem_statement.strip() in obs
    assert {t["function"]["name"] for t in info["tools"]} == {
        "bash",
        "view",
        "str_replace",
        "create",
        "submit",
    }
    with pytest.raises(KeyError, match="did you mean"):
        env.reset(options={"instance_id": target[:-1]})


def test_the_gold_patch_gets_1_and_no_change_gets_0(
    env: SweBenchEnv, offline_subset: list[SweBenchInstance]
) -> None:
    inst = offline_subset[0]
    env.reset(options={"instance_id": inst.instance_id})
    obs, reward, terminated, _, info = env.step(apply_gold(inst))
    assert (reward, terminated) == (0.0, False) and "exit code: 0" in obs
    obs, reward, terminated, truncated, info = env.step(call("submit"))
    assert (reward, terminated, truncated) == (1.0, True, False), obs
    report = info["report"][inst.instance_id]
    assert report["resolved"] and report["patch_successfully_applied"]
    assert report["tests_status"]["FAIL_TO_PASS"]["success"] == inst.FAIL_TO_PASS
    assert sorted(report["tests_status"]["PASS_TO_PASS"]["success"]) == sorted(inst.PASS_TO_PASS)
    assert [a["ok"] for a in info["actions"]] == [True, True]  # the diff, then the grading
    assert info["patch"].strip() == inst.patch.strip()

    env.reset(options={"instance_id": inst.instance_id})  # a fresh sandbox: the fix is gone
    obs, reward, terminated, _, info = env.step("submit")
    assert (reward, terminated) == (0.0, True)
    report = info["report"][inst.instance_id]
    assert report["patch_exists"] is False and report["resolved"] is False
    assert report["tests_status"]["FAIL_TO_PASS"]["failure"] == inst.FAIL_TO_PASS


def test_bad_calls_are_observations(env: SweBenchEnv) -> None:
    env.reset(seed=1)
    for text, needle in [
        ("what now?", "no tool call found"),
        (call("rm", path="/"), "unknown tool 'rm'"),
        (call("bash"), "command: Field required"),
    ]:
        obs, reward, terminated, truncated, info = env.step(text)
        assert obs.startswith("Error:") and needle in obs
        assert (reward, terminated, truncated) == (0.0, False, False)
        assert info["actions"] == []  # nothing was sent to the orchestrator
    obs, *_ = env.step(call("view", path="no/such/file.py"))
    assert obs.startswith("Error:") and "no such file" in obs


def test_the_step_limit_grades_the_working_tree(
    offline_subset: list[SweBenchInstance], swe_server: Any
) -> None:
    inst = offline_subset[1]
    env = SweBenchEnv(instances=[inst], address=swe_server.address, max_turns=2)
    try:
        env.reset(seed=0)
        obs, reward, terminated, truncated, _ = env.step(apply_gold(inst))
        assert not (terminated or truncated)
        obs, reward, terminated, truncated, info = env.step(call("bash", command="git diff --stat"))
        # Out of turns: truncated (not terminated), yet graded as the tree stood, and resolved.
        assert truncated and not terminated and reward == 1.0
        assert "Out of turns" in obs and info["report"][inst.instance_id]["resolved"]
    finally:
        env.close()


@pytest.mark.slow
def test_16_concurrent_episodes_through_one_orchestrator(
    offline_subset: list[SweBenchInstance], swe_server: Any
) -> None:
    client = Client(swe_server.address)
    envs = [
        SweBenchEnv(instances=offline_subset, address=swe_server.address, client=client, max_turns=4)
        for _ in range(16)
    ]
    vec = TangramVectorEnv(envs, client=client)
    try:
        vec.reset(seed=100)
        insts = [e.instance for e in envs]
        fix = [i % 2 == 0 for i in range(16)]  # even envs apply the gold patch, odd ones change nothing
        _, rewards, terms, _, _ = vec.step(
            [
                apply_gold(inst) if f else call("bash", command="git status --short")
                for inst, f in zip(insts, fix, strict=True)
            ]
        )
        assert rewards.tolist() == [0.0] * 16 and not terms.any()
        # Each episode has its own sandbox: the working trees differ exactly where a patch was applied.
        obs, _, _, _, _ = vec.step([call("bash", command="git diff --name-only | wc -l")] * 16)
        assert [o.split("stdout:\n", 1)[1].strip() for o in obs] == ["1" if f else "0" for f in fix]
        _, rewards, terms, _, _ = vec.step([call("submit")] * 16)
        assert terms.all()
        assert rewards.tolist() == [1.0 if f else 0.0 for f in fix]
    finally:
        vec.close()
        client.close()


def test_a_sandbox_that_dies_mid_episode_leaves_the_episode_without_a_reward(env: SweBenchEnv) -> None:
    # The session's edits went with the sandbox: the episode used to go on in a fresh one and its
    # working tree (the original repository) was graded 0.0, an infrastructure failure as a reward.
    import os
    import signal
    import uuid

    from tangram_env.errors import RewardUnavailable
    from tests.test_session import _agent_of_workspace

    env.reset(seed=0)
    marker = f"marker-{uuid.uuid4().hex}"
    env.step(call("bash", command=f"touch /workspace/{marker}"))
    agent = _agent_of_workspace(marker)
    if agent is None:
        pytest.skip("this host gives sandboxes no exec agent, or its workspace is elsewhere")
    os.kill(agent, signal.SIGKILL)
    with pytest.raises(RewardUnavailable, match="sandbox"):
        env.step(call("bash", command="ls"))
    with pytest.raises(Exception, match="did not finish"):
        env.step(call("submit"))
