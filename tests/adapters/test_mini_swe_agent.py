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
from minisweagent.exceptions import Submitted
from minisweagent.models.test_models import DeterministicModel, make_output

from tangram_env import Client
from tangram_env.adapters.mini_swe_agent import SUBMIT_MARKER, TangramEnvironment
from tangram_env.envs.swe_bench import SweBenchInstance
from tangram_env.errors import ClosedEnvError

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
            assert slow["returncode"] == -1 and "time limit of 1 s" in slow["exception_info"]
            assert env.get_template_vars()["system"] == "Linux"
            with pytest.raises(ValueError, match="for_swe_bench"):
                env.grade("")
        finally:
            env.close()


def test_a_long_submission_arrives_whole_and_a_cut_one_is_never_submitted(swe_server: Any) -> None:
    # The bash tool cuts output at 30,000 characters for models; a submission is output, and a patch
    # missing its middle used to be submitted and graded as a failure.
    with Client(swe_server.address) as client, TangramEnvironment(client=client) as env:
        with pytest.raises(Submitted) as submitted:
            env.execute({"command": f"echo {SUBMIT_MARKER}; head -c 50000 /dev/zero | tr '\\0' x"})
        assert submitted.value.messages[0]["extra"]["submission"] == "x" * 50000
        huge = env.execute({"command": f"echo {SUBMIT_MARKER}; head -c 3000000 /dev/zero | tr '\\0' x"})
        assert huge["returncode"] == 0 and "cut" in huge["exception_info"]  # an observation, not a submission


def test_a_directory_that_is_not_there_stops_the_command_before_it_runs(swe_server: Any) -> None:
    # The failed cd used to be ignored: the command ran in the workspace and said 0.
    with Client(swe_server.address) as client, TangramEnvironment(client=client, cwd="/testbed") as env:
        out = env.execute({"command": f"touch ran && echo {SUBMIT_MARKER}"})
        assert out["returncode"] == -1 and "'/testbed'" in out["exception_info"]
        assert "No such file or directory" in out["output"]
        assert env.execute({"command": "ls ran"}, cwd=".")["returncode"] == 2  # it never ran


def test_long_commands_other_interpreters_and_bad_calls(swe_server: Any) -> None:
    with Client(swe_server.address) as client:
        with TangramEnvironment(client=client) as env:
            long = env.execute({"command": f"echo {'y' * 120_000} | wc -c && ls -A"})  # past bash's 100,000
            assert long["output"] == "120001\n"  # and the script it ran from is gone
            out_of_range = env.execute({"command": "true"}, timeout=3600)
            assert out_of_range["returncode"] == -1 and "1800" in out_of_range["exception_info"]
            assert env.execute({"command": "echo still here"})["output"] == "still here\n"
        assert env.session.closed  # the with block ended the session
        with TangramEnvironment(client=client, interpreter=["python3", "-c"]) as py:
            assert py.execute({"command": "print(6 * 7)"})["output"] == "42\n"
    with pytest.raises(ValueError, match="environment_clas"):  # a setting nobody would read
        TangramEnvironment(client=None, environment_clas="docker")
    with pytest.raises(ValueError, match="not environment variable names"):
        TangramEnvironment(client=None, env={"A=1; echo B": "x"})


def test_closing_the_environment_under_a_command_raises_instead_of_observing(swe_server: Any) -> None:
    import threading

    with Client(swe_server.address) as client:
        env = TangramEnvironment(client=client)
        threading.Timer(1.0, env.close).start()
        with pytest.raises(ClosedEnvError, match="closed while"):
            env.execute({"command": f"echo {SUBMIT_MARKER}; sleep 4"})
