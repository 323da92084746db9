"""What ``swe_bench.diff`` hands the grader when the agent uses git itself: the fix is taken against
the instance's base commit, whatever was committed, amended or branched since; a base the agent
destroyed is the agent's failure (0.0), not a missing reward. Real episodes through a real
orchestrator, on an instance of the prepared offline set.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tangram_env.envs.swe_bench import SweBenchEnv, SweBenchInstance

COMMIT = "git -c user.name=a -c user.email=a@b commit -q"
CONFTEST = "import pytest\n\n\ndef pytest_collection_modifyitems(items):\n    pass\n"


def call(name: str, **arguments: Any) -> str:
    return json.dumps({"name": name, "arguments": arguments})


def gold(inst: SweBenchInstance) -> str:
    return f"git apply <<'TANGRAM_PATCH_END'\n{inst.patch}TANGRAM_PATCH_END\n"


@pytest.fixture
def episode(offline_subset: list[SweBenchInstance], swe_server: Any) -> Any:
    """Run bash commands in a fresh episode of the first instance, then submit: the last step."""
    inst = offline_subset[0]
    env = SweBenchEnv(instances=[inst], address=swe_server.address, max_turns=10)

    def run(*commands: str) -> tuple[float, dict[str, Any]]:
        env.reset(options={"instance_id": inst.instance_id})
        for command in commands:
            obs, *_ = env.step(call("bash", command=command))
            assert "exit code: 0" in obs, obs
        _, reward, terminated, _, info = env.step(call("submit"))
        assert terminated and info["reward_valid"] is not False
        return reward, info

    yield inst, run
    env.close()


@pytest.mark.parametrize(
    "commands",
    [
        [f"{COMMIT} -am fix"],
        [f"{COMMIT} -am fix", f"{COMMIT} --amend -m 'a better message'"],
        ["git checkout -q -b mine", f"{COMMIT} -am fix"],
        [f"{COMMIT} -am fix", "git checkout -q -b other", "echo '# note' >> NOTES.txt", "git add -A"],
    ],
    ids=["commit", "amend", "branch", "commit-then-more"],
)
def test_a_committed_fix_is_graded(episode: Any, commands: list[str]) -> None:
    inst, run = episode
    reward, info = run(gold(inst), *commands)
    assert reward == 1.0, info["reward_reason"]
    assert info["report"][inst.instance_id]["patch_exists"] is True


def test_rewriting_the_base_commit_itself_keeps_the_fix(episode: Any) -> None:
    # Amending the base makes it unreachable from HEAD; its object is still there to diff against.
    inst, run = episode
    reward, info = run(gold(inst), f"{COMMIT} --amend -am 'base and fix'", "git reflog expire --all")
    assert reward == 1.0, info["reward_reason"]


def test_a_committed_conftest_is_still_dropped(episode: Any) -> None:
    inst, run = episode
    write = f"cat > conftest.py <<'EOF'\n{CONFTEST}EOF\n"
    reward, info = run(gold(inst), write, "git add conftest.py", f"{COMMIT} -am 'fix and conftest'")
    assert reward == 1.0, info["reward_reason"]
    assert [d["path"] for d in info["dropped_edits"]] == ["conftest.py"]


@pytest.mark.parametrize(
    "destroy",
    [
        f"{COMMIT} --amend -am x && git reflog expire --expire=now --all && git gc -q --prune=now",
        f"rm -rf .git && git init -q && git add -A && {COMMIT} -m x",
    ],
    ids=["pruned", "new-repository"],
)
def test_a_base_the_agent_destroyed_is_its_failure(episode: Any, destroy: str) -> None:
    inst, run = episode
    reward, info = run(gold(inst), destroy)
    assert reward == 0.0 and info["reward_valid"] is True, info
    assert "base commit" in info["diff_error"] and info["reward_reason"] == "no patch"
