"""Rewards through real episodes: the gold patch earns 1.0 on every offline instance, test machinery
earns nothing, and a grading that fails for real (its sandbox killed, its provider failing) is no
reward at all: the single env raises, the vector env flags that env and serves the others.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import tangram_env
from tangram_env import Client, TangramVectorEnv
from tangram_env.envs.swe_bench import SweBenchEnv, SweBenchInstance
from tangram_env.errors import RewardUnavailable


def call(name: str, **arguments: Any) -> str:
    return json.dumps({"name": name, "arguments": arguments})


def apply_gold(inst: SweBenchInstance) -> str:
    return call("bash", command=f"git apply <<'TANGRAM_PATCH_END'\n{inst.patch}TANGRAM_PATCH_END\n")


def test_the_gold_patch_earns_1_on_every_offline_instance(
    offline_subset: list[SweBenchInstance], swe_server: Any
) -> None:
    client = Client(swe_server.address)
    envs = [SweBenchEnv(instances=[inst], client=client, max_turns=4) for inst in offline_subset]
    vec = TangramVectorEnv(envs, client=client)
    try:
        vec.reset(seed=0)
        vec.step([apply_gold(inst) for inst in offline_subset])
        obs, rewards, terms, _, info = vec.step([call("submit")] * len(envs))
        assert rewards.tolist() == [1.0] * len(envs), obs
        assert terms.all() and info["reward_valid"].all()
        assert all(d == [] for d in info["dropped_edits"]) and not any(info["tampering"])
    finally:
        vec.close()
        client.close()


def test_a_conftest_that_skips_everything_earns_0_and_is_named(
    offline_subset: list[SweBenchInstance], swe_server: Any
) -> None:
    inst = offline_subset[0]
    env = SweBenchEnv(instances=[inst], address=swe_server.address, max_turns=4)
    try:
        env.reset(seed=0)
        hook = (
            "import pytest\n\n\ndef pytest_collection_modifyitems(items):\n"
            "    for item in items:\n        item.add_marker(pytest.mark.skip)\n"
        )
        env.step(call("create", path="conftest.py", file_text=hook))
        obs, reward, terminated, _, info = env.step(call("submit"))
        assert (reward, terminated, info["reward_valid"]) == (0.0, True, True)
        assert info["dropped_edits"] == [
            {"path": "conftest.py", "reason": "pytest configuration (conftest.py)"}
        ]
        assert "not graded" in info["reward_reason"] and "conftest.py" in obs
    finally:
        env.close()


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_sandboxes_under_test_runs(server_pid: int) -> int:
    """SIGKILL the exec agent (the sandbox itself) of every sandbox of the orchestrator that is running
    the test runner now; how many were killed. Killing the runner alone would read as the tests'
    doing (see ``test_runner_kills.py``); a sandbox that dies is not.
    """
    killed = 0
    for pid in _descendants(server_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
            if not (argv[1:3] == [b"-I", b"-S"] and argv[3].endswith(b"/testrun.py")):  # the runner
                continue
            with open(f"/proc/{pid}/stat") as fh:
                parent = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{parent}/cmdline", "rb") as fh:
                if b"The exec agent" not in fh.read():
                    pytest.skip("this host's sandboxes start a bubblewrap per command, with no exec agent")
            os.kill(parent, signal.SIGKILL)
            killed += 1
        except (OSError, ProcessLookupError, IndexError):
            continue
    return killed


def test_the_sandbox_dying_mid_grading_raises_reward_unavailable(
    offline_subset: list[SweBenchInstance], swe_server: Any
) -> None:
    inst = max(offline_subset, key=lambda i: len(i.PASS_TO_PASS))  # the longest run: easiest to catch
    env = SweBenchEnv(instances=[inst], address=swe_server.address, max_turns=4)
    try:
        for _attempt in range(3):
            env.reset(seed=0)
            env.step(apply_gold(inst))
            with ThreadPoolExecutor(1) as pool:
                step = pool.submit(env.step, call("submit"))
                killed = 0
                while not step.done():  # the client retries a sandbox that died once: kill each try
                    killed += _kill_sandboxes_under_test_runs(swe_server.process.pid)
                    time.sleep(0.005)
                if killed < 2:  # a try finished before it could be caught: it must then count
                    assert step.result()[1] == 1.0
                    continue
                with pytest.raises(RewardUnavailable, match="grading failed") as caught:
                    step.result(timeout=300)
            assert "sandbox" in str(caught.value), caught.value
            return
        pytest.fail("the grading always finished before its sandboxes could be killed")
    finally:
        env.close()


def test_a_failing_provider_flags_that_env_and_serves_the_others(
    offline_subset: list[SweBenchInstance], swe_server: Any
) -> None:
    good = offline_subset[0]
    gone = good.model_copy(
        update={"instance_id": f"{good.instance_id}-gone", "image": "swe-bench.no-such-image"}
    )
    vec = tangram_env.make_vec("swe-bench", num_envs=2, instances=[good, gone], address=swe_server.address)
    try:
        # Seeds whose instance picks are [good, gone] (a reset runs no action).
        for seed in range(200):
            vec.reset(seed=seed)
            if [e.unwrapped.instance.instance_id for e in vec.envs] == [good.instance_id, gone.instance_id]:
                break
        # The second env gets no sandbox: its episode cannot go on, so its step is flagged at once.
        obs, rewards, _, truncs, info = vec.step([apply_gold(good), call("bash", command="true")])
        assert rewards[0] == 0.0 and info["reward_valid"][0]
        assert math.isnan(rewards[1]) and truncs[1] and not info["reward_valid"][1]
        assert (
            "the bash call failed" in info["reward_error"][1]
            and info["reward_error_cause"][1] == "sandbox_died"
        )
        obs, rewards, terms, _, info = vec.step([call("submit"), call("bash", command="true")])
        assert rewards[0] == 1.0 and terms[0] and info["reward_valid"][0]  # the other env served on
    finally:
        vec.close()
