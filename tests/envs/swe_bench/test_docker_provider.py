"""The Docker provider for official SWE-bench images. Needs a Docker engine; without one only the
clear error is tested (as on the project's machines, which run no engine)."""

from __future__ import annotations

import os

import pytest

from tangram_env.sandbox import SandboxSpec, SandboxUnavailable

docker = pytest.importorskip("docker")


def engine_running() -> bool:
    try:
        docker.from_env().ping()
    except Exception:
        return False
    return True


needs_engine = pytest.mark.skipif(not engine_running(), reason="no Docker engine runs here")


def test_no_engine_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from tangram_env.envs.swe_bench.docker_provider import DockerProvider

    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(SandboxUnavailable, match="no Docker engine answers here"):
        DockerProvider()


@needs_engine
def test_a_container_sandbox_runs_commands_and_files() -> None:
    from tangram_env.envs.swe_bench.docker_provider import DockerProvider

    provider = DockerProvider()
    image = os.environ.get("TANGRAM_DOCKER_TEST_IMAGE", "python:3.11-slim")
    try:
        box = provider.create(SandboxSpec(image=image, wall_timeout_s=30))
        assert box.exec("pwd").stdout.strip() == "/testbed"
        box.write_file("a.txt", "hello")
        assert box.read_file("a.txt") == b"hello"
        assert box.exec(["cat", "a.txt"]).stdout == "hello"
        assert box.exec("cat", stdin=b"piped").stdout == "piped"
        assert box.exec("sleep 10", timeout_s=1).killed_by == "timeout"
        box.reset()
        assert box.exec("test -e a.txt").exit_code != 0  # a fresh container
    finally:
        provider.close()


@needs_engine
@pytest.mark.skipif(
    not os.environ.get("TANGRAM_SWEBENCH_INSTANCES"),
    reason="set TANGRAM_SWEBENCH_INSTANCES to a "
    "JSON/JSONL file of real SWE-bench instances to grade one in its official image",
)
def test_an_official_instance_grades_with_its_gold_patch() -> None:
    from tangram_env.envs.swe_bench.docker_provider import DockerProvider
    from tangram_env.envs.swe_bench.grading import grade
    from tangram_env.envs.swe_bench.instance import NON_PYTEST_REPOS, load_instances

    inst = next(
        i for i in load_instances(os.environ["TANGRAM_SWEBENCH_INSTANCES"]) if i.repo not in NON_PYTEST_REPOS
    )
    provider = DockerProvider()
    try:
        box = provider.create(SandboxSpec(image=inst.sandbox_image, mem_mb=8192, wall_timeout_s=1800))
        assert grade(box, inst, inst.patch, timeout_s=1800)["resolved"]
        box.reset()
        assert not grade(box, inst, None, timeout_s=1800)["resolved"]
    finally:
        provider.close()
