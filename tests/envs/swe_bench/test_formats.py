"""SWE-Gym, SWE-smith and R2E-Gym rows read from local files in their published formats (samples
written here from the published schemas), bad rows named or skipped and reported; the patches they
carry checked by applying them with git.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tangram_env.envs.swe_bench.formats import detect_format, load_file, reverse_patch
from tangram_env.envs.swe_bench.instance import TESTBED, InstanceError, load_instances
from tangram_env.envs.swe_bench.runners import R2E_TEST, runner_for
from tests.envs.swe_bench.conftest import git

CLEAN = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
BUGGY = CLEAN.replace("return w * h", "return w + h")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A one-commit repository holding the clean code."""
    path = tmp_path / "repo"
    path.mkdir()
    (path / "shapes.py").write_text(CLEAN)
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "clean")
    return path


def bug_patch(repo: Path) -> str:
    (repo / "shapes.py").write_text(BUGGY)
    out = git(repo, "diff")
    git(repo, "checkout", "-q", "--", ".")
    return out


def applies(repo: Path, patch: str) -> bool:
    (repo.parent / "p.diff").write_text(patch)
    done = subprocess.run(
        ["git", "apply", str(repo.parent / "p.diff")], cwd=repo, capture_output=True, check=False
    )
    return done.returncode == 0


def swe_gym_row(**extra: object) -> dict[str, object]:
    patch = "diff --git a/moto/s3/models.py b/moto/s3/models.py\n"
    patch += "--- a/moto/s3/models.py\n+++ b/moto/s3/models.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
    row: dict[str, object] = {
        "instance_id": "getmoto__moto-5752",
        "repo": "getmoto/moto",
        "base_commit": "b2300f1eae1323e3e8bc45f97e530ce129dff12e",
        "patch": patch,
        "test_patch": "",
        "problem_statement": "S3 object tagging is lost on copy",
        "hints_text": "",
        "created_at": "2022-12-09T19:47:48Z",
        "version": "4.0",
        "FAIL_TO_PASS": json.dumps(["tests/test_s3/test_s3_copyobject.py::test_copy_object_keeps_tags"]),
        "PASS_TO_PASS": json.dumps(["tests/test_s3/test_s3_copyobject.py::test_copy_key_boto3"]),
        "environment_setup_commit": "b2300f1eae1323e3e8bc45f97e530ce129dff12e",
    }
    return {**row, **extra}


def swe_smith_row(bug: str, **extra: object) -> dict[str, object]:
    row: dict[str, object] = {
        "instance_id": "shapes__shapes.1a2b3c4d.func_pm_op_swap__abcd1234",
        "repo": "swesmith/shapes__shapes.1a2b3c4d",
        "patch": bug,
        "FAIL_TO_PASS": ["tests/test_shapes.py::test_area"],
        "PASS_TO_PASS": ["tests/test_shapes.py::test_perimeter"],
        "created_at": "2025-03-14T00:00:00",
        "image_name": "jyangballin/swesmith.x86_64.shapes_1776_shapes.1a2b3c4d",
        "base_commit": "shapes__shapes.1a2b3c4d.func_pm_op_swap__abcd1234",
        "problem_statement": "area() adds its sides",
    }
    return {**row, **extra}


def r2e_row(fix_old: str, fix_new: str, **extra: object) -> dict[str, object]:
    """An R2E-Gym row whose parsed commit holds the fix of ``shapes.py`` (one hunk) and a test file."""
    parsed = {
        "old_commit_hash": "1111111111111111111111111111111111111111",
        "new_commit_hash": "2222222222222222222222222222222222222222",
        "file_diffs": [
            {
                "header": {"file": {"path": "shapes.py"}},
                "is_binary_file": False,
                "hunks": [
                    {
                        "descriptor": {
                            "old_range": {"start": 1, "length": 5},
                            "new_range": {"start": 1, "length": 5},
                        },
                        "line_group": {
                            "all_lines": [
                                {"content": "def area(w, h):", "type": "context"},
                                {"content": fix_old, "type": "deleted"},
                                {"content": fix_new, "type": "added"},
                                {"content": "", "type": "context"},
                                {"content": "", "type": "context"},
                                {"content": "def perimeter(w, h):", "type": "context"},
                            ]
                        },
                    }
                ],
            },
            {
                "header": {"file": {"path": "tests/test_shapes.py"}},
                "hunks": [
                    {
                        "descriptor": {
                            "old_range": {"start": 0, "length": 0},
                            "new_range": {"start": 1, "length": 1},
                        },
                        "line_group": {"all_lines": [{"content": "def test_area(): pass", "type": "added"}]},
                    }
                ],
            },
        ],
    }
    row: dict[str, object] = {
        "repo_name": "shapes",
        "docker_image": "namanjain12/shapes_final:2222222222222222222222222222222222222222",
        "commit_hash": "2222222222222222222222222222222222222222",
        "parsed_commit_content": json.dumps(parsed),
        "execution_result_content": json.dumps({"new_commit_res_code": 0, "old_commit_res_code": 1}),
        "modified_files": ["shapes.py", "tests/test_shapes.py"],
        "modified_entity_summaries": [],
        "relevant_files": ["shapes.py"],
        "num_non_test_files": 1,
        "num_non_test_func_methods": 1,
        "num_non_test_lines": 2,
        "prompt": "",
        "problem_statement": "area() adds its sides",
        "expected_output_json": json.dumps(
            {
                "TestShapes.test_area": "PASSED",
                "TestShapes.test_perimeter": "PASSED",
                "test_known_bad": "FAILED",
            }
        ),
    }
    return {**row, **extra}


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_formats_are_told_apart_by_their_fields() -> None:
    assert detect_format(swe_gym_row()) == "swe-bench"
    assert detect_format(swe_smith_row("x")) == "swe-smith"
    assert detect_format(r2e_row("a", "b")) == "r2e-gym"


def test_swe_gym_rows_run_in_swe_gym_images(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "swe-gym.jsonl", [swe_gym_row()])
    (inst,) = load_file(path, "swe-gym").instances
    assert inst.sandbox_image == "xingyaoww/sweb.eval.x86_64.getmoto_s_moto-5752"
    assert inst.workdir == TESTBED and inst.FAIL_TO_PASS == [
        "tests/test_s3/test_s3_copyobject.py::test_copy_object_keeps_tags"
    ]
    assert runner_for(inst).name == "pytest"  # not a SWE-bench repository: its node ids run with pytest


def test_swe_smith_gold_patch_is_the_bug_reversed(tmp_path: Path, repo: Path) -> None:
    bug = bug_patch(repo)
    path = write_jsonl(tmp_path / "swe-smith.jsonl", [swe_smith_row(bug)])
    (inst,) = load_instances(path)  # detected through the ordinary loader too
    assert inst.sandbox_image.startswith("jyangballin/swesmith.x86_64.")
    assert inst.base_commit == inst.instance_id  # SWE-smith keeps each bug on a branch of that name
    # The buggy tree, fixed by the gold patch, is the clean tree again.
    (repo / "shapes.py").write_text(BUGGY)
    assert applies(repo, inst.patch), inst.patch
    assert (repo / "shapes.py").read_text() == CLEAN
    assert reverse_patch(reverse_patch(bug)) == bug


def test_reverse_patch_of_a_new_file(repo: Path) -> None:
    (repo / "extra.py").write_text("X = 1\n")
    git(repo, "add", "-N", "extra.py")
    added = git(repo, "diff")
    git(repo, "add", "extra.py")
    git(repo, "commit", "-q", "-m", "extra")
    assert applies(repo, reverse_patch(added))
    assert not (repo / "extra.py").exists()


def test_r2e_gym_rows_rebuild_the_fix_and_expect_its_passing_tests(tmp_path: Path, repo: Path) -> None:
    path = write_jsonl(tmp_path / "r2e.jsonl", [r2e_row("    return w + h", "    return w * h")])
    report = load_file(path)
    (inst,) = report.instances
    assert report.formats == {"r2e-gym": 1}
    assert inst.instance_id == "shapes__2222222222222222222222222222222222222222"
    assert inst.base_commit == "1" * 40 and inst.runner == "r2e-gym"
    assert inst.FAIL_TO_PASS == ["TestShapes.test_area", "TestShapes.test_perimeter"]
    assert runner_for(inst).command_line(inst) == R2E_TEST
    assert "tests/test_shapes.py" not in inst.patch  # only the fix's non-test files
    (repo / "shapes.py").write_text(BUGGY)
    assert applies(repo, inst.patch), inst.patch
    assert (repo / "shapes.py").read_text() == CLEAN


def test_bad_rows_are_named_or_skipped_and_reported(tmp_path: Path, repo: Path) -> None:
    rows: list[object] = [
        swe_gym_row(),
        swe_gym_row(instance_id="getmoto__moto-1", FAIL_TO_PASS="[not json"),
        "{truncated",
        swe_smith_row(bug_patch(repo), image_name=""),
        r2e_row("a", "b", expected_output_json=""),
        swe_gym_row(),  # the first one again
        swe_gym_row(
            instance_id="getmoto__moto-2", repo="someone/else", FAIL_TO_PASS=json.dumps(["test_x (m.C)"])
        ),
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    with pytest.raises(InstanceError, match=r"row 1 \(getmoto__moto-1\).*FAIL_TO_PASS"):
        load_file(path)
    report = load_file(path, skip_bad=True)
    assert [i.instance_id for i in report.instances] == ["getmoto__moto-5752"]
    why = {bad.index: bad.error for bad in report.skipped}
    assert sorted(why) == [1, 2, 3, 4, 5, 6]
    assert "not valid JSON" in why[2]
    assert "image_name" in why[3]
    assert "expected_output_json is missing" in why[4]
    assert "appears twice" in why[5]
    assert "no runner here" in why[6]


def test_a_file_with_no_usable_row(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", ["{", "[1]"])
    with pytest.raises(InstanceError, match="no usable instances"):
        load_file(path, skip_bad=True)


def test_the_env_takes_a_file_in_a_named_format_and_skips_bad_rows(tmp_path: Path) -> None:
    from tangram_env.envs.swe_bench import SweBenchEnv

    path = write_jsonl(tmp_path / "swe-gym.jsonl", [swe_gym_row(), "{truncated"])
    with pytest.raises(InstanceError, match="row 1"):
        SweBenchEnv(instances=path, instance_format="swe-gym", address="tcp://127.0.0.1:1")
    env = SweBenchEnv(
        instances=path, instance_format="swe-gym", skip_bad_rows=True, address="tcp://127.0.0.1:1"
    )
    try:
        assert [i.sandbox_image for i in env.instances] == ["xingyaoww/sweb.eval.x86_64.getmoto_s_moto-5752"]
    finally:
        env.close()
