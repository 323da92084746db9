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
from tangram_env.errors import ActionError, ClosedEnvError

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


def test_a_command_the_sandbox_refuses_is_an_observation_and_the_env_stays_open(swe_server: Any) -> None:
    # A NUL byte used to raise ActionError and close the environment, ending the run; mini-swe-agent's
    # own environments give the agent an observation (returncode -1) and carry on.
    with Client(swe_server.address) as client, TangramEnvironment(client=client) as env:
        for command in ["echo a\x00b", "echo a\x00b " + "y" * 120_000]:  # a command line, and a file
            out = env.execute({"command": command})
            assert out["returncode"] == -1 and "NUL bytes" in out["exception_info"]
            assert not env.session.closed
        assert env.execute({"command": "echo still here"})["output"] == "still here\n"


def test_a_lost_sandbox_raises_and_closes_the_environment(tmp_path: Any) -> None:
    # An infrastructure failure is never an observation: an agent that read it would go on, and be
    # graded on a sandbox it never worked in.
    import time

    from tests.envs.swe_bench.conftest import Orchestrator

    config = tmp_path / "settings.json"
    config.write_text('{"session_idle_s": 1.0}')
    srv = Orchestrator("--config", str(config))
    try:
        with Client(srv.address) as client:
            env = TangramEnvironment(client=client)
            assert env.execute({"command": "echo hi"})["output"] == "hi\n"
            time.sleep(2.5)  # the server ends the idle session, and its sandbox with it
            with pytest.raises(ActionError, match="session_idle_s") as lost:
                env.execute({"command": "echo hi"})
            assert lost.value.error_type == "sandbox_died" and env.session.closed
    finally:
        srv.stop()


def test_mini_swe_agents_swebench_yaml_starts_in_the_instances_repository(
    offline_subset: list[SweBenchInstance], swe_server: Any
) -> None:
    # swebench.yaml's cwd, /testbed, used to win over the instance's repository: on an instance whose
    # repository is not at /testbed every command failed to start.
    from pathlib import Path

    import minisweagent
    import yaml

    config = yaml.safe_load(
        (Path(minisweagent.__file__).parent / "config/benchmarks/swebench.yaml").read_text()
    )
    fields = {k: v for k, v in config["environment"].items() if k != "environment_class"}
    inst = offline_subset[0]
    assert fields["cwd"] == "/testbed" and inst.workdir is None  # its repository is the workspace
    with Client(swe_server.address) as client:
        with TangramEnvironment.for_swe_bench(inst, client=client, **fields) as env:
            out = env.execute({"command": "git status --short && git log -1 --format=%H"})
            assert (out["returncode"], out["output"]) == (0, f"{inst.base_commit}\n")
        under = TangramEnvironment.for_swe_bench(inst, client=client, cwd="/testbed/src")
        chosen = TangramEnvironment.for_swe_bench(inst, client=client, cwd="/elsewhere")
        official = inst.model_copy(update={"image": None, "workdir": "/testbed"})
        kept = TangramEnvironment.for_swe_bench(official, client=client, **fields)
        assert (under.config.cwd, chosen.config.cwd, kept.config.cwd) == ("src", "/elsewhere", "/testbed")
        for env in (under, chosen, kept):  # never ran a command: no sandbox was taken
            env.close()


def test_long_commands_are_measured_in_bytes_and_run_from_a_file(swe_server: Any) -> None:
    # 60,000 characters of "\u20ac" are 180,000 bytes: measured in characters, the command was sent as a
    # command line and failed to start (127); one of 140,000 ran from a file as one argument of exec
    # again, and failed there (126).
    with Client(swe_server.address) as client:
        with TangramEnvironment(client=client, cwd="sub") as env:
            env.execute({"command": "mkdir sub"}, cwd=".")
            wide = env.execute({"command": "echo " + "\u20ac" * 60_000 + " | wc -c"})
            assert (wide["returncode"], wide["output"]) == (0, "180001\n")
            listing = "ls -A /tmp | grep mini; ls -A"  # the file it ran from is gone from both
            long = env.execute({"command": f"echo {'y' * 140_000} | wc -c; pwd; {listing}"})
            lines = long["output"].splitlines()
            assert long["returncode"] == 0 and lines[0] == "140001" and lines[1].endswith("/sub")
            assert lines[2:] == []  # the file it ran from is gone, from /tmp as from the repository
        with TangramEnvironment(client=client, interpreter=["python3", "-c"]) as py:
            out = py.execute({"command": f"print(len('{'z' * 150_000}'))"})
            assert out["output"] == "150000\n"
        with TangramEnvironment(client=client, interpreter=["sh"]) as sh:
            out = sh.execute({"command": f"echo {'y' * 140_000}"})
            assert out["returncode"] == -1 and "-c" in out["exception_info"]  # said, not failed


def test_background_processes_end_with_their_command(swe_server: Any) -> None:
    # Unlike mini-swe-agent's Docker and local environments, nothing a command starts outlives it
    # (docs/mini-swe-agent.md): a server for a test is started, used and stopped in one command.
    server = (
        "python3 -m http.server 8765 >/tmp/server.log 2>&1 &\n"
        'for i in $(seq 50); do python3 -c "import urllib.request as u;'
        "print(u.urlopen('http://127.0.0.1:8765').status)\" 2>/dev/null && break; sleep 0.1; done\n"
        "kill %1"
    )
    with Client(swe_server.address) as client, TangramEnvironment(client=client) as env:
        assert env.execute({"command": server})["output"] == "200\n"
        assert env.execute({"command": "nohup sleep 100 >/dev/null 2>&1 & echo started"})["returncode"] == 0
        assert env.execute({"command": "ps -eo comm | grep -c '^sleep' || true"})["output"] == "0\n"


def test_carriage_returns_come_back_as_newlines(swe_server: Any) -> None:
    # They came back raw; mini-swe-agent's own environments read output with universal newlines.
    with Client(swe_server.address) as client, TangramEnvironment(client=client) as env:
        assert env.execute({"command": "printf 'x\\r\\ny\\rz\\n'"})["output"] == "x\ny\nz\n"


def test_forward_env_is_taken_and_docker_only_fields_are_refused_with_the_reason(
    swe_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # forward_env, a field of mini-swe-agent's Docker environment with a meaning here, was refused.
    monkeypatch.setenv("TANGRAM_TEST_FORWARDED", "from the host")
    monkeypatch.setenv("TANGRAM_TEST_BOTH", "host")
    monkeypatch.delenv("TANGRAM_TEST_UNSET", raising=False)
    forward = ["TANGRAM_TEST_FORWARDED", "TANGRAM_TEST_BOTH", "TANGRAM_TEST_UNSET"]
    both = {"TANGRAM_TEST_BOTH": "env"}
    with (
        Client(swe_server.address) as client,
        TangramEnvironment(client=client, forward_env=forward, env=both) as env,
    ):
        out = env.execute(
            {"command": 'echo "$TANGRAM_TEST_FORWARDED|$TANGRAM_TEST_BOTH|${TANGRAM_TEST_UNSET-unset}"'}
        )
        assert out["output"] == "from the host|env|unset\n"  # env wins, as in mini-swe-agent
    docker_only = [
        ("executable", "docker"),
        ("run_args", ["--rm"]),
        ("container_timeout", "2h"),
        ("pull_timeout", 9),
    ]
    for field, value in docker_only:
        with pytest.raises(
            ValueError, match=f"'{field}' is a setting of mini-swe-agent's Docker environment"
        ):
            TangramEnvironment(client=None, **{field: value})
    with pytest.raises(ValueError, match="not environment variable names"):
        TangramEnvironment(client=None, forward_env=["A B"])
    with pytest.raises(ValueError, match="NUL"):
        TangramEnvironment(client=None, env={"A": "x\x00y"})
