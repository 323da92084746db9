"""Each repository's runner: its log parser on log text in the published formats (some of it made by
running the real tool here), the test labels it runs, and instances refused when loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tangram_env.envs.swe_bench.instance import InstanceError, SweBenchInstance, load_jsonl, validate_instance
from tangram_env.envs.swe_bench.runners import (
    RUNNERS,
    UnsupportedInstance,
    django_directives,
    failure_messages,
    parse_django,
    parse_matplotlib,
    parse_pytest,
    parse_pytest_options,
    parse_pytest_v2,
    parse_r2e,
    parse_seaborn,
    parse_sympy,
    runner_for,
)

GOLD = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"

#: The 18 repositories of SWE-bench (full, Lite and Verified are drawn from them).
SWE_BENCH_REPOS = {
    "astropy/astropy",
    "django/django",
    "marshmallow-code/marshmallow",
    "matplotlib/matplotlib",
    "mwaskom/seaborn",
    "pallets/flask",
    "psf/requests",
    "pvlib/pvlib-python",
    "pydata/xarray",
    "pydicom/pydicom",
    "pylint-dev/astroid",
    "pylint-dev/pylint",
    "pytest-dev/pytest",
    "pyvista/pyvista",
    "scikit-learn/scikit-learn",
    "sqlfluff/sqlfluff",
    "sphinx-doc/sphinx",
    "sympy/sympy",
}


def record(**fields: object) -> dict[str, object]:
    base: dict[str, object] = {
        "instance_id": "o__r-1",
        "repo": "o/r",
        "base_commit": "abcdef12",
        "problem_statement": "it breaks",
        "patch": GOLD,
        "FAIL_TO_PASS": ["tests/test_m.py::test_x"],
    }
    return {**base, **fields}


# --- parsers --------------------------------------------------------------------------------------
def test_pytest_summary_from_a_real_run(tmp_path: Path) -> None:
    (tmp_path / "test_demo.py").write_text(
        "import pytest\n\n"
        "def test_ok():\n    pass\n\n"
        "def test_bad():\n    assert 1 == 2\n\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('setup')\n\n"
        "def test_err(broken):\n    pass\n\n"
        "@pytest.mark.skip(reason='no')\ndef test_skip():\n    pass\n\n"
        "@pytest.mark.xfail\ndef test_xf():\n    assert 0\n\n"
        "@pytest.mark.parametrize('v', [1, 2])\ndef test_p(v):\n    assert v == 1\n"
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--no-header",
            "-rA",
            "--tb=no",
            "-p",
            "no:cacheprovider",
            "test_demo.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    statuses = parse_pytest(run.stdout)
    assert statuses == {
        "test_demo.py::test_ok": "PASSED",
        "test_demo.py::test_bad": "FAILED",
        "test_demo.py::test_err": "ERROR",
        "test_demo.py::test_xf": "XFAIL",
        "test_demo.py::test_p[1]": "PASSED",
        "test_demo.py::test_p[2]": "FAILED",
    }, run.stdout  # a skip is reported as "SKIPPED [1] file:line: reason": no test id, not counted


def test_pytest_options_shortens_absolute_paths_in_parametrised_ids() -> None:
    log = (
        "PASSED tests/test_self.py::TestRunTC::test_x[/testbed/tests/regrtest_data/a.py]\n"
        "FAILED tests/test_y.py::test_url[//host/share] - AssertionError\n"
        "PASSED tests/test_y.py::test_glob[/tmp/*.py]\n"
        "PASSED tests/test_y.py::test_plain\n"
    )
    assert parse_pytest_options(log) == {
        "tests/test_self.py::TestRunTC::test_x[/a.py]": "PASSED",
        "tests/test_y.py::test_url[//host/share]": "FAILED",
        "tests/test_y.py::test_glob[/tmp/*.py]": "PASSED",
        "tests/test_y.py::test_plain": "PASSED",
    }


def test_pytest_v2_reads_colour_and_verbose_lines() -> None:
    log = (
        "astropy/units/tests/test_q.py::test_a PASSED                      [ 50%]\n"
        "astropy/units/tests/test_q.py::test_b FAILED                      [100%]\n"
        "\x1b[32mPASSED\x1b[0m sklearn/tests/test_c.py::test_c\n"
        "\x1b[31mFAILED\x1b[0m sklearn/tests/test_c.py::test_d - ValueError: no\n"
    )
    assert parse_pytest_v2(log) == {
        "astropy/units/tests/test_q.py::test_a": "PASSED",
        "astropy/units/tests/test_q.py::test_b": "FAILED",
        "sklearn/tests/test_c.py::test_c": "PASSED",
        "sklearn/tests/test_c.py::test_d": "FAILED",
    }


def test_seaborn_and_matplotlib_quirks() -> None:
    seaborn = (
        "tests/test_core.py::TestA::test_x PASSED [ 10%]\n"
        "PASSED tests/test_core.py::TestA::test_y\n"
        "FAILED tests/test_core.py::TestA::test_z - AssertionError\n"
        "ERROR tests/test_core.py::TestA::test_w\n"
    )
    assert parse_seaborn(seaborn) == {
        "tests/test_core.py::TestA::test_x": "PASSED",
        "tests/test_core.py::TestA::test_y": "PASSED",
        "tests/test_core.py::TestA::test_z": "FAILED",
    }
    mpl = "PASSED lib/matplotlib/tests/test_widgets.py::test_span[MouseButton.LEFT-True]\n"
    assert parse_matplotlib(mpl) == {"lib/matplotlib/tests/test_widgets.py::test_span[1-True]": "PASSED"}


def test_django_verbose_log_from_a_real_unittest_run(tmp_path: Path) -> None:
    # Django's runtests.py --verbosity 2 prints unittest's verbose runner lines; make some for real.
    (tmp_path / "demo_tests.py").write_text(
        "import sys, unittest\n\n"
        "class T(unittest.TestCase):\n"
        "    def test_ok(self):\n        pass\n"
        "    def test_doc(self):\n        '''Doc line of a test.'''\n"
        "    def test_fail(self):\n        self.assertEqual(1, 2)\n"
        "    def test_err(self):\n        raise RuntimeError('x')\n"
        "    @unittest.skip('why')\n    def test_skip(self):\n        pass\n"
        "    def test_noisy(self):\n        sys.stderr.write('Internal Server Error: /x/\\n')\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "unittest", "-v", "demo_tests"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    log = run.stdout + run.stderr
    method = sys.version_info >= (3, 11)  # newer unittest names the method inside the parentheses too

    def name(test: str) -> str:
        return f"{test} (demo_tests.T.{test})" if method else f"{test} (demo_tests.T)"

    statuses = parse_django(log)
    assert statuses[name("test_ok")] == "PASSED"
    assert statuses["Doc line of a test."] == "PASSED"  # named by its docstring, as SWE-bench lists it
    assert statuses[name("test_fail")] == "FAILED"
    assert statuses[name("test_err")] == "ERROR"
    assert statuses[name("test_skip")] == "SKIPPED"
    assert statuses[name("test_noisy")] == "PASSED", log  # its "ok" came on the next line
    messages = failure_messages(log)
    assert messages[name("test_fail")] == "AssertionError: 1 != 2"
    assert messages[name("test_err")] == "RuntimeError: x"


def test_django_log_in_the_older_format() -> None:
    log = (
        "Testing against Django installed in '/testbed/django'\n"
        "Importing application utils_tests\n"
        "test_truncate (utils_tests.test_text.TestUtilsText) ... ok\n"
        "test_wrap (utils_tests.test_text.TestUtilsText) ... FAIL\n"
        "test_slugify (utils_tests.test_text.TestUtilsText) ... skipped 'needs unicode'\n"
        "test_format (utils_tests.test_text.TestUtilsText) ... ERROR\n"
        "======================================================================\n"
        "FAIL: test_wrap (utils_tests.test_text.TestUtilsText)\n"
    )
    assert parse_django(log) == {
        "test_truncate (utils_tests.test_text.TestUtilsText)": "PASSED",
        "test_wrap (utils_tests.test_text.TestUtilsText)": "FAILED",
        "test_slugify (utils_tests.test_text.TestUtilsText)": "SKIPPED",
        "test_format (utils_tests.test_text.TestUtilsText)": "ERROR",
    }


def test_a_test_reported_with_two_statuses_counts_as_failed() -> None:
    log = (
        "test_wrap (utils_tests.test_text.TestUtilsText) ... FAIL\n"
        "test_ok (utils_tests.test_text.TestUtilsText) ... ok\n"
        "test_wrap (utils_tests.test_text.TestUtilsText) ... ok\n"  # printed by the code under test
    )
    assert parse_django(log) == {
        "test_wrap (utils_tests.test_text.TestUtilsText)": "FAILED",
        "test_ok (utils_tests.test_text.TestUtilsText)": "PASSED",
    }
    summary = "FAILED tests/t.py::test_a - boom\nPASSED tests/t.py::test_a\nPASSED tests/t.py::test_a\n"
    assert parse_pytest(summary) == {"tests/t.py::test_a": "FAILED"}
    assert parse_sympy("test_x F\ntest_x ok\n") == {"test_x": "FAILED"}


def test_sympy_verbose_log() -> None:
    log = (
        "============================= test process starts ==============================\n"
        "executable:         /opt/miniconda3/envs/testbed/bin/python  (3.9.19-final-0) [CPython]\n"
        "architecture:       64-bit\n"
        "random seed:        12345678\n\n"
        "sympy/core/tests/test_basic.py[3] \n"
        "test__aresame ok\n"
        "test_structure F\n"
        "test_subs E\n"
        "sympy/core/tests/test_expr.py[1] \n"
        "test_issue_1234 ok                                                   [OK]\n\n"
        "________________________________________________________________________________\n"
        "___________ sympy/core/tests/test_basic.py:test_structure ___________\n"
        "AssertionError\n"
    )
    assert parse_sympy(log) == {
        "test__aresame": "PASSED",
        "test_structure": "FAILED",
        "test_subs": "ERROR",
        "test_issue_1234": "PASSED",
        "sympy/core/tests/test_basic.py:test_structure": "FAILED",
    }


def test_sympy_failure_reports_of_later_releases() -> None:
    log = (
        "sympy/utilities/tests/test_iterables.py[2] \n"
        "test_connected_components F\n"
        "test_signed_permutations ok                                               [FAIL]\n\n\n"
        "________________________________________________________________________________\n"
        "______ sympy/utilities/tests/test_iterables.py::test_connected_components ______\n"
        "Traceback (most recent call last):\n"
        '  File "/testbed/sympy/utilities/tests/test_iterables.py", line 290, in test_connected_components\n'
        "    assert connected_components(([1, 2, 3], [])) == [[1], [2], [3]]\n"
        "AssertionError\n\n"
        "============= tests finished: 1 passed, 1 failed, in 0.78 seconds =============\n"
    )
    assert parse_sympy(log) == {
        "test_connected_components": "FAILED",
        "test_signed_permutations": "PASSED",
        "sympy/utilities/tests/test_iterables.py::test_connected_components": "FAILED",
    }
    assert failure_messages(log)["test_connected_components"] == "AssertionError"


def test_r2e_names_tests_without_their_file() -> None:
    log = (
        "=========================== short test summary info ============================\n"
        "PASSED r2e_tests/test_1.py::TestCookies::test_set\n"
        "FAILED r2e_tests/test_1.py::TestCookies::test_del - KeyError\n"
        "PASSED r2e_tests/test_2.py::test_top\n"
    )
    assert parse_r2e(log) == {
        "TestCookies.test_set": "PASSED",
        "TestCookies.test_del": "FAILED",
        "test_top": "PASSED",
    }


# --- the table and directives ---------------------------------------------------------------------
def test_every_swe_bench_repository_has_a_runner() -> None:
    assert set(RUNNERS) == SWE_BENCH_REPOS
    for repo in SWE_BENCH_REPOS:
        assert runner_for(SweBenchInstance.model_validate(record(repo=repo))).name


def test_django_labels_from_the_test_patch_or_the_ids() -> None:
    patch = (
        "diff --git a/tests/utils_tests/test_text.py b/tests/utils_tests/test_text.py\n"
        "--- a/tests/utils_tests/test_text.py\n+++ b/tests/utils_tests/test_text.py\n@@ -1 +1 @@\n-a\n+b\n"
        "diff --git a/tests/utils_tests/files/x.json b/tests/utils_tests/files/x.json\n"
        "--- a/tests/utils_tests/files/x.json\n+++ b/tests/utils_tests/files/x.json\n@@ -1 +1 @@\n-a\n+b\n"
    )
    inst = SweBenchInstance.model_validate(
        record(
            repo="django/django",
            FAIL_TO_PASS=["test_wrap (utils_tests.test_text.TestUtilsText)"],
            test_patch=patch,
        )
    )
    assert django_directives(inst) == ["utils_tests.test_text"]
    cmd = runner_for(inst).command_line(inst)
    assert cmd.endswith(
        "tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 utils_tests.test_text"
    )
    no_patch = inst.model_copy(
        update={
            "test_patch": "",
            "FAIL_TO_PASS": ["test_wrap (utils_tests.test_text.TestUtilsText.test_wrap)", "Doc line."],
        }
    )
    assert django_directives(no_patch) == ["utils_tests.test_text.TestUtilsText"]


# --- refused when loaded --------------------------------------------------------------------------
def test_an_instance_no_runner_can_grade_is_refused_when_loaded(tmp_path: Path) -> None:
    odd = record(repo="someone/thing", FAIL_TO_PASS=["test_wrap (mod.Case)"])
    with pytest.raises(InstanceError, match="no runner here") as info:
        validate_instance(odd)
    assert "'runner'" in str(info.value)  # says how to fix it
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps(record()) + "\n" + json.dumps(odd) + "\n")
    with pytest.raises(InstanceError, match="record 1"):
        load_jsonl(path)
    # Named explicitly, the same instance loads.
    assert validate_instance({**odd, "runner": "django", "test_directives": ["mod"]}).runner == "django"
    with pytest.raises(InstanceError, match="unknown runner"):
        validate_instance({**odd, "runner": "nose"})


def test_django_and_sympy_instances_load_and_need_something_to_run() -> None:
    django = record(repo="django/django", FAIL_TO_PASS=["test_wrap (utils_tests.test_text.TestUtilsText)"])
    assert validate_instance(django).repo == "django/django"  # labels come from the ids
    sympy = record(repo="sympy/sympy", FAIL_TO_PASS=["test_subs"])
    with pytest.raises(InstanceError, match="sympy runner needs test files"):
        validate_instance(sympy)
    ok = validate_instance({**sympy, "test_directives": ["sympy/core/tests/test_basic.py"]})
    assert runner_for(ok).command_line(ok).endswith("bin/test -C --verbose sympy/core/tests/test_basic.py")
    with pytest.raises(UnsupportedInstance):
        runner_for(SweBenchInstance.model_validate(record(repo="a/b", FAIL_TO_PASS=["test_subs"])))


# --- the offline set's SWE-bench repositories -----------------------------------------------------
def test_packages_by_repository_and_the_cli_refusing_an_unknown_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tangram_env.envs.swe_bench.packages import SWE_BENCH_PACKAGES, packages_of_repos
    from tangram_env.envs.swe_bench.prepare import prepare_main

    assert [p.name for p in packages_of_repos(["django", "sympy/sympy", "flask"])] == [
        "Django",
        "sympy",
        "flask",
    ]
    assert {p.repo for p in SWE_BENCH_PACKAGES} <= SWE_BENCH_REPOS
    assert {p.runner for p in SWE_BENCH_PACKAGES} == {"django", "sympy", "pytest", "pytest-log"}
    assert prepare_main(["--repos", "nosuch/repo"]) == 1
    assert "no package of repository 'nosuch/repo'" in capsys.readouterr().err


def test_new_package_settings_keep_the_small_packages_caches() -> None:
    import zlib

    from tangram_env.envs.swe_bench.generate import _config_key
    from tangram_env.envs.swe_bench.packages import PACKAGES

    for pkg in PACKAGES:  # the key of a package with the new settings at their defaults is as before
        fields = ", ".join(
            f"{n}={getattr(pkg, n)!r}"
            for n in ("name", "version", "repo", "sources", "tests", "pythonpath", "pytest_args", "deselect")
        )
        old = f"Package({fields}, requirements={pkg.requirements!r}, max_instances={pkg.max_instances!r})"
        assert _config_key(pkg) == f"{zlib.crc32(old.encode()):08x}"
