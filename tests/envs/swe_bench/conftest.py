"""Fixtures for the swe-bench env: a small prepared offline set and an orchestrator that serves its tools.

The offline set is built from real PyPI source distributions into the user's cache
(``$TANGRAM_CACHE_DIR/swe-bench``, default ``~/.cache/tangram/swe-bench``) the first time, then read
from there; the fixture prepares only two packages, a few instances each.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tangram_env.envs.swe_bench.instance import SweBenchInstance
from tangram_env.envs.swe_bench.prepare import cache_root, gitconfig_file
from tests.conftest import ServerProcess

PLUGINS = ("tangram_env.shell_tools", "tangram_env.envs.swe_bench.tools")
SUBSET = ["inflection", "isodate"]


@pytest.fixture(scope="session")
def offline_subset() -> list[SweBenchInstance]:
    """Instances of two packages, prepared (with sandbox images) or read from the cache."""
    from tangram_env.envs.swe_bench.prepare import prepare

    report = prepare(SUBSET, limit=6, jobs=2)
    assert report.instances, "prepare validated no instance"
    return report.instances


class Orchestrator(ServerProcess):
    """The test suite's ``tangram-server`` child, with the generic and swe-bench tools named explicitly."""

    def __init__(self, *extra: str, timeout_s: float = 60.0) -> None:
        super().__init__(*(a for p in PLUGINS for a in ("--plugin", p)), *extra, timeout_s=timeout_s)


@pytest.fixture(scope="session")
def swe_server() -> Iterator[Orchestrator]:
    """One orchestrator for the session's episodes and tool calls."""
    srv = Orchestrator()
    yield srv
    srv.stop()


# --- a small repository made here, with a test patch of its own, in a real local sandbox ---------
BUGGY = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
TESTS = "from calc import mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"
OTHER = "from calc import mul\n\n\ndef test_mul_zero():\n    assert mul(0, 5) == 0\n"
GIT = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@x",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@x",
}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **GIT},
    ).stdout


def diff_of(repo: Path, edit: dict[str, str]) -> str:
    """The patch that makes ``edit`` (path -> new text) in ``repo``, which is left as it was."""
    for path, text in edit.items():
        (repo / path).write_text(text)
    out = git(repo, "diff")
    git(repo, "checkout", "-q", "--", ".")
    return out


@pytest.fixture(scope="module")
def calc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SweBenchInstance, object]]:
    """The ``calc`` instance (``add`` subtracts) and a local sandbox of its image."""
    yield from calc_instance(tmp_path_factory.mktemp("calc"), sys.prefix)


#: A ``test_add`` the base commit already has, asserting what ``add`` does there; ``edited=True``
#: makes the test patch rewrite it (as SWE-bench's test patches often edit a test, not add one).
OLD_TEST_ADD = "\n\ndef test_add():\n    from calc import add\n\n    assert add(2, 3) == -1\n"


def calc_instance(
    root: Path, python_env: str, edited: bool = False
) -> Iterator[tuple[SweBenchInstance, object]]:
    """The ``calc`` instance built under ``root`` on the virtual environment ``python_env``, and a
    local sandbox of its image (closed when the generator ends).
    """
    from tangram_env.images import build_image
    from tangram_env.sandbox import SandboxSpec
    from tangram_env.server.sandbox.local import LocalProvider

    repo = root / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text(BUGGY)
    (repo / "tests" / "test_calc.py").write_text(TESTS + OLD_TEST_ADD if edited else TESTS)
    (repo / "tests" / "test_other.py").write_text(OTHER)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "buggy")
    commit = git(repo, "rev-parse", "HEAD").strip()
    gold = diff_of(repo, {"calc.py": BUGGY.replace("a - b", "a + b")})
    new_tests = (
        TESTS.replace("import mul", "import add, mul") + "\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    )
    if edited:
        new_tests = TESTS + OLD_TEST_ADD.replace("== -1", "== 5")
    test_patch = diff_of(repo, {"tests/test_calc.py": new_tests})
    image = f"swe-test-calc-{root.name}"[:60]
    gitconfig = gitconfig_file(cache_root())
    images = root / "images"
    build_image(
        image,
        from_dir=repo,
        python_env=python_env,
        root=images,
        env={"GIT_CONFIG_GLOBAL": str(gitconfig)},
        read_only=[str(gitconfig)],
    )
    inst = SweBenchInstance(
        instance_id="calc__calc-1",
        repo="calc/calc",
        base_commit=commit,
        problem_statement="add() subtracts",
        patch=gold,
        test_patch=test_patch,
        FAIL_TO_PASS=["tests/test_calc.py::test_add"],
        PASS_TO_PASS=["tests/test_calc.py::test_mul", "tests/test_other.py::test_mul_zero"],
        image=image,
        python="python",
    )
    provider = LocalProvider(image_dir=str(images))
    sandbox = provider.create(SandboxSpec(image=image, mem_mb=1024))
    yield inst, sandbox
    provider.close()
