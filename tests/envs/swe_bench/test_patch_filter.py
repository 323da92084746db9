"""The patch filter: which files of a patch are graded, on patches in git's and plain diff formats."""

from __future__ import annotations

import pytest

from tangram_env.envs.swe_bench.patch_filter import filter_patch, protected_reason, split_patch

SOURCE = (
    "diff --git a/pkg/core.py b/pkg/core.py\nindex 1..2 100644\n--- a/pkg/core.py\n+++ b/pkg/core.py\n"
    "@@ -1,2 +1,2 @@\n x = 1\n-y = 2\n+y = 3\n"
)


@pytest.mark.parametrize(
    ("path", "graded"),
    [
        ("pkg/core.py", True),
        ("src/pkg/testing_utils.py", True),
        ("README.rst", True),
        ("setup.py", True),
        ("conftest.py", False),
        ("src/pkg/conftest.py", False),
        ("tests/helpers.py", False),
        ("pkg/test/data.json", False),
        ("test_core.py", False),
        ("pkg/core_test.py", False),
        ("pytest.ini", False),
        ("tox.ini", False),
        ("setup.cfg", False),
        ("pyproject.toml", False),
        ("run_tests.sh", False),  # R2E-Gym's test command
        ("r2e_tests/test_1.py", False),
        ("r2e_tests/__init__.py", False),
        ("sitecustomize.py", False),
        ("lib/usercustomize.py", False),
        ("zz.pth", False),
        ("pkg.egg-info/entry_points.txt", False),
        ("pkg/__pycache__/core.cpython-311.pyc", False),
        ("../outside.py", False),
        (".git/hooks/post-checkout", False),
    ],
)
def test_which_paths_are_graded(path: str, graded: bool) -> None:
    assert (protected_reason(path) is None) is graded


def test_the_instances_own_test_files_are_never_graded() -> None:
    assert protected_reason("checks/verify.py", {"checks/verify.py"}) == "a test file of the instance"


def test_source_sections_are_kept_byte_for_byte_and_the_rest_dropped() -> None:
    conftest = (
        "diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n+++ b/conftest.py\n"
        "@@ -0,0 +1 @@\n+import pytest\n"
    )
    # A removed line that looks like a header ("--- a/x") stays inside its hunk.
    tricky = (
        "diff --git a/pkg/doc.txt b/pkg/doc.txt\n--- a/pkg/doc.txt\n+++ b/pkg/doc.txt\n"
        "@@ -1,3 +1,2 @@\n a\n--- a/tests/conftest.py\n-+++ b/tests/conftest.py\n"
    )
    out = filter_patch("preamble text\n" + SOURCE + conftest + tricky)
    assert out.patch == SOURCE + tricky
    assert out.dropped == [{"path": "conftest.py", "reason": "pytest configuration (conftest.py)"}]


def test_renames_symlinks_and_plain_diffs_are_judged_by_every_path_they_name() -> None:
    rename = (
        "diff --git a/tests/test_a.py b/pkg/a.py\nsimilarity index 100%\n"
        "rename from tests/test_a.py\nrename to pkg/a.py\n"
    )
    link = (
        "diff --git a/pkg/lnk b/pkg/lnk\nnew file mode 120000\n--- /dev/null\n+++ b/pkg/lnk\n"
        "@@ -0,0 +1 @@\n+../tests\n\\ No newline at end of file\n"
    )
    plain = "--- orig/tox.ini\t2024-01-01\n+++ new/tox.ini\t2024-01-02\n@@ -1 +1 @@\n-[tox]\n+[tox] # x\n"
    quoted = 'diff --git "a/pkg/sp\\303\\251cial conftest.py" "b/conftest.py"\n'
    out = filter_patch(SOURCE + rename + link + plain + quoted)
    assert out.patch == SOURCE
    assert {d["path"] for d in out.dropped} == {
        "tests/test_a.py",  # its new name, pkg/a.py, goes with it
        "pkg/lnk",
        "tox.ini",
        "conftest.py",
    }
    assert {d["reason"] for d in out.dropped if d["path"] == "pkg/lnk"} == {"a symbolic link"}
    assert [sorted(s.paths) for s in split_patch(quoted)[1]] == [["conftest.py", "pkg/spécial conftest.py"]]


def test_text_that_is_not_a_diff_grades_as_no_patch() -> None:
    out = filter_patch("just some words\n")
    assert out.patch == "" and out.dropped == [{"path": "?", "reason": "text that is not a unified diff"}]
