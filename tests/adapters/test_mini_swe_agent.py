"""mini-swe-agent's own DefaultAgent and DeterministicModel solve an offline SWE-bench instance through a
Tangram sandbox session; Tangram grades the submission."""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
pytest.importorskip(
    "minisweagent", reason="mini-swe-agent is not installed (pip install 'tangram-env[mini-swe-agent]')"
)

from minisweagent.agents.default import DefaultAgent
from minisweagent.models.test_models import DeterministicModel, make_output

from tangram_env import Client
from tangram_env.adapters.mini_swe_agent import SUBMIT_MARKER, TangramEnvironment
from tangram_env.envs.swe_bench import SweBenchInstance

SYSTEM = "You are a helpful assistant that can interact with a computer."
INSTANCE = "Please solve this issue: {{task}}"


def solve(
    inst: SweBenchInstance, address: str, fix: bool
) -> tuple[dict[str, Any], dict[str, Any], list[dict]]:
    moves = [make_output("Looking around.", [{"command": "git status --short && ls"}])]
    if fix:
        patch = f"git apply <<'TANGRAM_PATCH_END'\n{inst.patch}TANGRAM_PATCH_END\n"
        moves.append(make_output("Applying the fix.", [{"command": patch}]))
    moves.append(
        make_output("Done.", [{"command": f"echo {SUBMIT_MARKER} && git add -A && git diff --cached"}])
    )
    with Client(address) as client:
        env = TangramEnvironment.for_swe_bench(inst, client=client, timeout=60)
        try:
            agent = DefaultAgent(
                DeterministicModel(outputs=moves),
                env,
                system_template=SYSTEM,
                instance_template=INSTANCE,
                step_limit=10,
            )
            result = agent.run(inst.problem_statement)
            return result, env.grade(result.get("submission")), agent.messages
        finally:
            env.close()


def test_default_agent_solves_an_instance_in_a_tangram_sandbox(
    offline_subset: list[SweBenchInstance], swe_server: Any
) -> None:
    inst = offline_subset[0]
    result, grade, messages = solve(inst, swe_server.address, fix=True)
    assert result["exit_status"] == "Submitted"
    assert result["submission"].strip() == inst.patch.strip()
    observation = messages[3]["content"]  # after system, task, first model turn
    assert "<returncode>0</returncode>" in observation
    assert observation.split("<output>")[1].strip() != "</output>"  # the repository's files are listed
    assert grade["resolved"] is True
    assert grade["report"][inst.instance_id]["tests_status"]["FAIL_TO_PASS"]["success"] == inst.FAIL_TO_PASS


def test_an_unchanged_repository_is_graded_unresolved(
    offline_subset: list[SweBenchInstance], swe_server: Any
) -> None:
    inst = offline_subset[0]
    result, grade, _ = solve(inst, swe_server.address, fix=False)
    assert result["exit_status"] == "Submitted" and result["submission"].strip() == ""
    assert grade["resolved"] is False


def test_commands_see_cwd_env_and_time_limits(swe_server: Any) -> None:
    with Client(swe_server.address) as client:
        env = TangramEnvironment(client=client, env={"GREETING": "hi there"}, timeout=2)
        try:
            out = env.execute({"command": "mkdir -p sub && echo $GREETING && echo err >&2 && exit 4"})
            assert (out["returncode"], out["output"]) == (4, "hi there\nerr\n")
            assert env.execute({"command": "pwd"}, cwd="sub")["output"].strip().endswith("/sub")
            slow = env.execute({"command": "sleep 10"}, timeout=1)
            assert slow["returncode"] == -1 and "timeout" in slow["exception_info"]
            assert env.get_template_vars()["system"] == "Linux"
            with pytest.raises(ValueError, match="for_swe_bench"):
                env.grade("")
        finally:
            env.close()
