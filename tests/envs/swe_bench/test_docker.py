"""The offline set under Docker: its instances built as images laid out as SWE-bench's (``/testbed``,
the environment at SWE-bench's interpreter path), then graded through the env on an orchestrator run
with ``--sandbox docker``: the gold patch gets 1.0, no change gets 0.0, for a small package and one
instance of each of SWE-bench's repositories (Django, sympy and three pytest repositories), each by
its own runner. Needs the engine and ``tangram/default`` (`.ci/run` makes both); images are cached by
their inputs, so later runs build nothing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tangram_env.envs.swe_bench import SweBenchEnv, SweBenchInstance
from tests.conftest import ROOT
from tests.envs.swe_bench.conftest import Orchestrator
from tests.envs.swe_bench.test_env import apply_gold, call
from tests.server.sandbox.test_sandbox_docker import needs_engine

pytestmark = needs_engine
PACKAGES = ["inflection", "Django", "sympy", "flask", "requests", "pytest"]


@pytest.fixture(scope="module")
def docker_instances() -> dict[str, SweBenchInstance]:
    """One instance per package, with its Docker image (built, or kept from an earlier run)."""
    from tangram_env.envs.swe_bench.prepare import prepare

    report = prepare(PACKAGES, limit=len(PACKAGES), jobs=2, docker=True)
    by_repo = {i.repo: i for i in report.instances}
    assert len(by_repo) == len(PACKAGES), report.per_package
    return by_repo


@pytest.fixture(scope="module")
def docker_swe_server() -> Iterator[Orchestrator]:
    srv = Orchestrator("--sandbox", "docker")
    yield srv
    srv.stop()


def test_images_are_laid_out_as_swe_benchs(docker_instances: dict[str, SweBenchInstance]) -> None:
    import docker

    from tangram_env.docker_build import docker_image_for
    from tangram_env.envs.swe_bench.docker_images import INPUTS_LABEL, build_docker_images
    from tangram_env.envs.swe_bench.packages import ALL_PACKAGES
    from tangram_env.envs.swe_bench.prepare import cache_root

    inst = docker_instances["jpvanhal/inflection"]
    tag = docker_image_for(inst.sandbox_image)
    client = docker.from_env()
    image = client.images.get(tag)
    assert image.attrs["Config"]["WorkingDir"] == "/testbed" and image.labels[INPUTS_LABEL]
    out = client.containers.run(
        tag,
        ["sh", "-c", "command -v python; git log --format=%H -1; git status --porcelain | wc -l"],
        remove=True,
        network_mode="none",
    )
    assert out.decode().split() == ["/opt/miniconda3/envs/testbed/bin/python", inst.base_commit, "0"]
    by_release = {(p.repo, p.version): p for p in ALL_PACKAGES}
    assert build_docker_images([inst], cache_root(), by_release) == 0  # cached: its inputs are the same


@pytest.mark.slow
@pytest.mark.parametrize(
    ("repo", "runner"),
    [
        ("jpvanhal/inflection", "pytest"),
        ("django/django", "django"),
        ("sympy/sympy", "sympy"),
        ("pallets/flask", "pytest"),
        ("psf/requests", "pytest-options"),
        ("pytest-dev/pytest", "pytest-log"),
    ],
)
def test_gold_gets_1_and_no_change_gets_0_in_containers(
    docker_instances: dict[str, SweBenchInstance], docker_swe_server: Orchestrator, repo: str, runner: str
) -> None:
    from tangram_env.envs.swe_bench.runners import runner_for

    inst = docker_instances[repo]
    assert runner_for(inst).name == runner
    env = SweBenchEnv(instances=[inst], address=docker_swe_server.address, max_turns=4)
    try:
        obs, _info = env.reset(seed=0)
        obs, _, _, _, _ = env.step(call("bash", command="pwd; command -v python"))
        assert "/testbed\n/opt/miniconda3/envs/testbed/bin/python" in obs  # a container of its image
        obs, reward, terminated, _, _ = env.step(apply_gold(inst))
        assert "exit code: 0" in obs
        obs, reward, terminated, _, info = env.step(call("submit"))
        assert (reward, terminated) == (1.0, True), obs
        status = info["report"][inst.instance_id]["tests_status"]
        assert status["FAIL_TO_PASS"]["success"] == inst.FAIL_TO_PASS

        env.reset(seed=0)
        obs, reward, terminated, _, info = env.step(call("submit"))
        assert (reward, terminated) == (0.0, True), obs
        assert "grade_error" not in info  # a verdict, not an infrastructure failure
        failed = info["report"][inst.instance_id]["tests_status"]["FAIL_TO_PASS"]["failure"]
        assert failed == inst.FAIL_TO_PASS
    finally:
        env.close()


def test_swe_bench_example_runs_under_docker(docker_instances: dict[str, SweBenchInstance]) -> None:
    inst = docker_instances["jpvanhal/inflection"]
    env = {k: v for k, v in os.environ.items() if k != "TANGRAM_ADDRESS"}
    env["TANGRAM_SERVER_SANDBOX_PROVIDER"] = "docker"  # what `--sandbox docker` sets, for the embedded one
    out = subprocess.run(
        [sys.executable, "examples/swe_bench_scripted.py", "--instance-id", inst.instance_id],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"gold-patch agent: 1.0, do-nothing agent: 0.0 -> as expected", out.stdout), out.stdout


R2E_TESTS = """from shapes import area, perimeter


class TestShapes:
    def test_area(self):
        assert area(2, 3) == 6

    def test_perimeter(self):
        assert perimeter(2, 3) == 10
"""


def test_an_r2e_gym_row_grades_in_an_image_laid_out_as_r2e_gyms(
    docker_instances: dict[str, SweBenchInstance], tmp_path: Path
) -> None:
    """R2E-Gym's layout: the repository at /testbed with its environment in /testbed/.venv,
    ``run_tests.sh`` at the repository's root naming ``r2e_tests`` by a relative path, the tests at
    /r2e_tests; graded in fresh containers of it: the row's fix gets 1.0, no change 0.0."""
    import docker

    from tangram_env.docker_build import build_from_context, docker_image_for
    from tangram_env.envs.swe_bench.docker_images import ENV_PREFIX, env_image_name
    from tangram_env.envs.swe_bench.formats import convert
    from tangram_env.envs.swe_bench.grading import grade
    from tangram_env.envs.swe_bench.packages import get_packages
    from tangram_env.sandbox import SandboxSpec
    from tangram_env.server.sandbox.docker import DockerProvider
    from tests.envs.swe_bench.conftest import git
    from tests.envs.swe_bench.test_formats import BUGGY, r2e_row

    del docker_instances  # built the environment image this one starts from
    repo = tmp_path / "testbed"
    repo.mkdir()
    (repo / "shapes.py").write_text(BUGGY)
    (repo / "run_tests.sh").write_text(".venv/bin/python -W ignore -m pytest -rA r2e_tests\n")
    git(repo, "init", "-q", "-b", "main")
    (repo / ".git" / "info" / "exclude").write_text(".venv\nrun_tests.sh\nr2e_tests\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "buggy")
    commit = git(repo, "rev-parse", "HEAD").strip()
    (tmp_path / "r2e_tests").mkdir()
    (tmp_path / "r2e_tests" / "test_shapes.py").write_text(R2E_TESTS)
    env_image = docker_image_for(env_image_name(get_packages(["inflection"])[0]))
    tag = f"tangram/test-r2e-layout-{os.getpid()}:latest"
    dockerfile = (
        f"FROM {env_image}\nCOPY testbed/ /testbed/\nCOPY r2e_tests/ /r2e_tests/\n"
        f"RUN ln -s {ENV_PREFIX} /testbed/.venv\nWORKDIR /testbed\nLABEL tangram.test=r2e-layout\n"
    )
    build_from_context(tag, dockerfile, {"testbed": repo, "r2e_tests": tmp_path / "r2e_tests"})
    row = r2e_row("    return w + h", "    return w * h", docker_image=tag)
    parsed = json.loads(str(row["parsed_commit_content"]))
    parsed["old_commit_hash"] = commit
    inst = convert({**row, "parsed_commit_content": json.dumps(parsed)})
    provider = DockerProvider(sweep=False)
    try:
        box = provider.create(SandboxSpec(image=inst.sandbox_image, mem_mb=1024))
        gold = grade(box, inst, inst.patch, timeout_s=120)
        assert gold["resolved"], gold
        box.reset()
        assert not grade(box, inst, None, timeout_s=120)["resolved"]
    finally:
        provider.close()
        docker.from_env().images.remove(tag, force=True)
