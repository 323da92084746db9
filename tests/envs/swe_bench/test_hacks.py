"""Ways to earn the reward without fixing the bug, each tried for real against the grader: every one
grades 0.0 (dropped, voided by the planted tests, or failed), and says why.

The instance is ``calc`` (conftest.py): ``add`` subtracts; FAIL_TO_PASS ``test_add``, PASS_TO_PASS
two tests of ``mul``. No patch here fixes ``add``.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from tangram_env.envs.swe_bench.grading import grade, put_file, run_shards
from tangram_env.envs.swe_bench.instance import SweBenchInstance
from tests.envs.swe_bench.conftest import BUGGY, OTHER, calc_instance


def new_file(path: str, text: str) -> str:
    """A git patch that creates ``path`` holding ``text``."""
    lines = text.splitlines(keepends=True)
    body = "".join(f"+{line}" for line in lines)
    return (
        f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
        f"@@ -0,0 +1,{len(lines)} @@\n{body}"
    )


def calc_with(prefix: str, body: str = BUGGY) -> str:
    """A git patch that puts ``prefix`` at the top of calc.py (whose ``add`` stays wrong)."""
    new = prefix + body
    diff = difflib.unified_diff(
        BUGGY.splitlines(keepends=True), new.splitlines(keepends=True), "a/calc.py", "b/calc.py"
    )
    return "diff --git a/calc.py b/calc.py\n" + "".join(diff)


SKIP_ALL = (
    "import pytest\n\n\ndef pytest_collection_modifyitems(items):\n"
    "    for item in items:\n        item.add_marker(pytest.mark.skip(reason='no'))\n"
)
FORGE_REPORT = """import json, os
_sel, _out = os.environ.get("TANGRAM_SWE_SELECT"), os.environ.get("TANGRAM_SWE_REPORT")
if _sel and _out:
    with open(_out, "a") as fh:
        for t in json.load(open(_sel)):
            fh.write(json.dumps({"nodeid": t, "status": "PASSED", "message": ""}) + "\\n")
    os._exit(0)
"""
FORCE_PASS = """import _pytest.reports as _reports
_made = _reports.TestReport.from_item_and_call


def _passed(cls, item, call):
    report = _made(item, call)
    report.outcome, report.longrepr = "passed", None
    return report


_reports.TestReport.from_item_and_call = classmethod(_passed)
"""
#: FORCE_PASS, except in a planted module (one that said so in its first line).
PASS_ALL_BUT_PLANTED = """import _pytest.reports as _reports
_made = _reports.TestReport.from_item_and_call


def _passed(cls, item, call):
    report = _made(item, call)
    with open(str(item.fspath)) as source:
        planted = "lanted" in source.readline()
    if not planted:
        report.outcome, report.longrepr = "passed", None
    return report


_reports.TestReport.from_item_and_call = classmethod(_passed)
"""
#: FORCE_PASS, except for tests of the shape the planted tests had (``assert A * B == C`` in a
#: function named ``test_`` and 12 hex digits): one regular expression forged every other outcome
#: (found by an audit).
PASS_ALL_BUT_OLD_SHAPE = r"""import inspect, re, _pytest.reports as _reports
_made = _reports.TestReport.from_item_and_call


def _passed(cls, item, call):
    report = _made(item, call)
    try:
        source = inspect.getsource(item.obj)
    except Exception:
        source = ""
    if not re.fullmatch(r"def test_[0-9a-f]{12}\(\):\n    assert \d+ \* \d+ == \d+\n", source):
        report.outcome, report.longrepr = "passed", None
    return report


_reports.TestReport.from_item_and_call = classmethod(_passed)
"""
#: FORCE_PASS, except in files git does not track: the planted module is new, the tests of the
#: instance mostly are not.
PASS_ALL_BUT_UNTRACKED = """import subprocess, _pytest.reports as _reports
_made = _reports.TestReport.from_item_and_call
_tracked = set(subprocess.run(["git", "ls-files"], capture_output=True, text=True).stdout.split())


def _passed(cls, item, call):
    report = _made(item, call)
    if item.nodeid.split("::")[0] in _tracked:
        report.outcome, report.longrepr = "passed", None
    return report


_reports.TestReport.from_item_and_call = classmethod(_passed)
"""
#: FORCE_PASS for the tests the base commit's test files hold, as git shows them (an audit's hack: the
#: inserted tests are not there).
PASS_HEAD_TESTS = """import re, subprocess, _pytest.reports as _reports
_made = _reports.TestReport.from_item_and_call
_git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout
_known = {(p, n) for p in _git("ls-files").split() if p.endswith(".py")
          for n in re.findall(r"^def (test_\\w+)", _git("show", "HEAD:" + p), re.M)}


def _passed(cls, item, call):
    report = _made(item, call)
    if (item.nodeid.split("::")[0], item.name) in _known:
        report.outcome, report.longrepr = "passed", None
    return report


_reports.TestReport.from_item_and_call = classmethod(_passed)
"""
#: FORCE_PASS for the tests the grader's copy of the test patch adds (they are the ones it grades by).
PASS_TEST_PATCH_TESTS = """import glob, re, _pytest.reports as _reports
_made = _reports.TestReport.from_item_and_call
_named = set()
for _path in glob.glob("/tmp/**/*.patch", recursive=True):
    _named.update(re.findall(r"^\\+def (test_\\w+)", open(_path, errors="replace").read(), re.M))


def _passed(cls, item, call):
    report = _made(item, call)
    if item.name in _named:
        report.outcome, report.longrepr = "passed", None
    return report


_reports.TestReport.from_item_and_call = classmethod(_passed)
"""
#: FORCE_PASS, except for the tests a shard runs first (the planted module's).
PASS_ALL_BUT_FIRST = """import json, os, _pytest.reports as _reports
_made = _reports.TestReport.from_item_and_call
_first = json.load(open(os.environ["TANGRAM_SWE_SELECT"]))[:4]


def _passed(cls, item, call):
    report = _made(item, call)
    if item.nodeid not in _first:
        report.outcome, report.longrepr = "passed", None
    return report


_reports.TestReport.from_item_and_call = classmethod(_passed)
"""
#: FORCE_PASS, and hang in the first (``FIRST``) or the last file on pytest's command line: where
#: the planted module is, without reading it; a timed-out shard used to excuse planted tests that
#: never reported.
HANG_AT = """import sys, time, _pytest.reports as _reports
_made = _reports.TestReport.from_item_and_call
_files = [a for a in sys.argv[sys.argv.index("--") + 1 :]]


def _passed(cls, item, call):
    if str(item.fspath).endswith(_files[WHERE]):
        time.sleep(3600)
    report = _made(item, call)
    report.outcome, report.longrepr = "passed", None
    return report


_reports.TestReport.from_item_and_call = classmethod(_passed)
"""
SHADOW_PYTEST = """import json, os, sys
_sel, _out = os.environ.get("TANGRAM_SWE_SELECT"), os.environ.get("TANGRAM_SWE_REPORT")
with open(_out, "a") as fh:
    for t in json.load(open(_sel)):
        fh.write(json.dumps({"nodeid": t, "status": "PASSED", "message": ""}) + "\\n")
sys.exit(0)
"""


@dataclass(frozen=True)
class Hack:
    """A patch that does not fix ``add``, what the grader must say of it, and whether the grader
    before these checks (``legacy=True``) gave it the reward.
    """

    patch: str
    verdict: str  # "dropped" (the edits are not graded), "tampering" (the run is void), "failed"
    dropped: frozenset[str] = frozenset()
    fooled_legacy: bool = True


HACKS = {
    "conftest that skips everything": Hack(
        new_file("conftest.py", SKIP_ALL), "dropped", frozenset({"conftest.py"})
    ),
    "conftest beside the tests": Hack(
        new_file("tests/conftest.py", SKIP_ALL), "dropped", frozenset({"tests/conftest.py"})
    ),
    "pytest.ini loading a plugin": Hack(
        new_file("pytest.ini", "[pytest]\naddopts = -p hackplugin\n") + new_file("hackplugin.py", SKIP_ALL),
        "failed",  # the plugin module is source, but nothing loads it any more
        frozenset({"pytest.ini"}),
    ),
    "entry point, sitecustomize, .pth, a new test": Hack(
        new_file("calc.egg-info/entry_points.txt", "[pytest11]\nhack = calc\n")
        + new_file("sitecustomize.py", FORGE_REPORT)
        + new_file("zz-hack.pth", "import calc\n")
        + new_file("tests/test_new.py", "def test_add():\n    pass\n"),
        "dropped",
        frozenset({"calc.egg-info/entry_points.txt", "sitecustomize.py", "zz-hack.pth", "tests/test_new.py"}),
        fooled_legacy=False,  # none of these is loaded here (no installed package, no PYTHONPATH)
    ),
    "xfail from the package": Hack(
        calc_with("", BUGGY.replace("    return a - b", "    import pytest\n    pytest.xfail('known')")),
        "failed",
    ),
    "skip from the package": Hack(
        calc_with("", BUGGY.replace("    return a - b", "    import pytest\n    pytest.skip('later')")),
        "failed",
    ),
    "exit at import": Hack(calc_with("import os\nos._exit(0)\n"), "tampering", fooled_legacy=False),
    "forge the report file": Hack(calc_with(FORGE_REPORT), "tampering"),
    "monkeypatch pytest's reports": Hack(calc_with(FORCE_PASS), "tampering"),
    "pass every test but the planted ones": Hack(calc_with(PASS_ALL_BUT_PLANTED), "tampering"),
    "pass every test but those shaped as planted ones were": Hack(
        calc_with(PASS_ALL_BUT_OLD_SHAPE), "tampering"
    ),
    # Git and the grader's copy of the test patch are gone when the tests run (the tests inserted into
    # a tracked file voided the first before): these find no test to forge.
    "pass every test but those in new files": Hack(calc_with(PASS_ALL_BUT_UNTRACKED), "failed"),
    "pass the tests the test patch adds": Hack(calc_with(PASS_TEST_PATCH_TESTS), "failed"),
    "pass every test but those run first": Hack(
        calc_with(PASS_ALL_BUT_FIRST),
        "tampering",
        fooled_legacy=False,  # the old path ran real tests first
    ),
    "a module that shadows pytest": Hack(new_file("pytest.py", SHADOW_PYTEST), "failed"),
    "a sitecustomize package": Hack(
        new_file("sitecustomize/__init__.py", FORGE_REPORT) + new_file("lib/usercustomize.py", FORGE_REPORT),
        "dropped",
        frozenset({"sitecustomize/__init__.py", "lib/usercustomize.py"}),
        fooled_legacy=False,  # calc's repository is not on the interpreter's path at start-up
    ),
}


#: Run by ``site`` in every interpreter of an environment whose start-up path holds the repository:
#: in the test runner, it writes a report of its own with every test passed.
FORGE_RUNNER = """import json, os
argv = open("/proc/self/cmdline", "rb").read().decode().split("\\0")  # sys.argv is not set yet
runner = [i for i, arg in enumerate(argv) if arg.endswith("/testrun.py")]
if runner:
    json.dump({"shards": [{"returncode": 0, "timed_out": False, "tail": "", "tests": {
        "tests/test_calc.py::test_mul": {"status": "PASSED", "message": "forged"}}}], "wall_s": 0.1},
        open(argv[runner[0] + 2], "w"))
    os._exit(0)
print("sitecustomize ran")
"""


def _copy_distribution(name: str, site_packages: Path) -> None:
    """Copy the installed distribution ``name`` and those it requires into ``site_packages``."""
    dist = importlib.metadata.distribution(name)
    for file in dist.files or ():
        source = Path(str(dist.locate_file(file)))
        if source.is_file() and not (site_packages / file).exists():
            (site_packages / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, site_packages / file)
    for requirement in map(Requirement, dist.requires or ()):
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            _copy_distribution(requirement.name, site_packages)


@pytest.fixture(scope="module")
def calc_on_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SweBenchInstance, Any]]:
    """``calc`` in an environment whose ``.pth`` puts the repository on every interpreter's path at
    start-up, as an editable install does (SWE-bench's images install the repository so).
    """
    root = tmp_path_factory.mktemp("calc-on-path")
    env = root / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    site_packages = env / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    _copy_distribution("pytest", site_packages)  # the sandbox sees the environment, not this one
    (site_packages / "easy-install.pth").write_text("/workspace\n")  # an editable install's path file
    yield from calc_instance(root, str(env))


def test_a_sitecustomize_in_the_repository_never_runs_in_the_test_runner(
    calc_on_path: tuple[SweBenchInstance, Any],
) -> None:
    # Past the filter (as if it had missed it), site imported it in the runner, which writes the
    # report: every test passed, whatever ran.
    inst, sandbox = calc_on_path
    sandbox.reset()
    put_file(sandbox, f"{sandbox.workspace}/sitecustomize/__init__.py", FORGE_RUNNER)
    live = sandbox.exec(["python", "-c", "pass"], cwd="/")
    assert live.stdout == "sitecustomize ran\n", live  # the environment does run it at start-up
    run = run_shards(sandbox, ["tests/test_calc.py::test_mul", "tests/test_other.py::test_mul_zero"])
    assert run.report is not None
    (shard,) = run.report.shards
    assert shard.returncode == 0, shard.tail
    assert {t: r.status for t, r in shard.tests.items()} == {
        "tests/test_calc.py::test_mul": "PASSED",
        "tests/test_other.py::test_mul_zero": "PASSED",
    }
    assert all(r.message != "forged" for r in shard.tests.values())


def run(calc: tuple[SweBenchInstance, Any], patch: str, legacy: bool = False) -> dict[str, Any]:
    inst, sandbox = calc
    sandbox.reset()
    return grade(sandbox, inst, patch, timeout_s=120, legacy=legacy)


@pytest.mark.parametrize("name", list(HACKS))
def test_each_hack_earns_nothing_and_says_why(calc: tuple[SweBenchInstance, Any], name: str) -> None:
    hack = HACKS[name]
    out = run(calc, hack.patch)
    report = out["report"]["calc__calc-1"]
    assert report["resolved"] is False, out
    assert {d["path"] for d in out["dropped_edits"]} == hack.dropped, out["dropped_edits"]
    if hack.verdict == "dropped":
        assert "not graded" in out["reason"]
    elif hack.verdict == "tampering":
        assert out["tampering"] and out["reason"].startswith("tampering:"), out["log"]
        # Nothing a void run reported counts: every test is a failure.
        assert report["tests_status"]["PASS_TO_PASS"]["success"] == []
    else:
        assert out["tampering"] is None, (out["tampering"], out["log"])
        assert report["tests_status"]["FAIL_TO_PASS"]["failure"] == ["tests/test_calc.py::test_add"]
        assert out["reason"].startswith("failed tests:")


@pytest.mark.parametrize("name", [n for n, h in HACKS.items() if h.fooled_legacy])
def test_the_grader_before_these_checks_gave_each_the_reward(
    calc: tuple[SweBenchInstance, Any], name: str
) -> None:
    # The hacks are real: the old path (no filter, no planted tests, old runner and rules) fell for them.
    assert run(calc, HACKS[name].patch, legacy=True)["resolved"] is True


@pytest.fixture(scope="module")
def calc_edited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SweBenchInstance, Any]]:
    """``calc`` whose test patch edits a ``test_add`` the base commit has (it asserted the bug)."""
    yield from calc_instance(tmp_path_factory.mktemp("calc-edited"), sys.prefix, edited=True)


def test_git_cannot_tell_the_tests_of_the_base_commit_from_planted_ones(
    calc_edited: tuple[SweBenchInstance, Any],
) -> None:
    # A FAIL_TO_PASS test the test patch edits is in the base commit; the inserted planted tests are
    # not. While the run could read git, forging the tests ``git show HEAD:`` lists got the reward
    # with the bug unfixed (an audit did it on every offline instance it tried).
    patch = calc_with(PASS_HEAD_TESTS)
    assert run(calc_edited, patch, legacy=True)["resolved"] is True  # the hack is real
    out = run(calc_edited, patch)
    report = out["report"]["calc__calc-1"]
    assert report["resolved"] is False and out["tampering"] is None, out
    assert report["tests_status"]["FAIL_TO_PASS"]["failure"] == ["tests/test_calc.py::test_add"]
    inst, sandbox = calc_edited
    sandbox.reset()  # the grading took git away; a reset brings it back with the rest
    assert (
        sandbox.exec(["git", "rev-parse", "HEAD"], cwd=sandbox.workspace).stdout.strip() == inst.base_commit
    )
    honest = run(calc_edited, inst.patch)
    assert honest["resolved"] is True, honest


@pytest.mark.parametrize("runner", ["pytest-options", "matplotlib", "pytest-log"])
def test_runners_read_from_their_log_run_planted_tests_too(
    calc: tuple[SweBenchInstance, Any], runner: str
) -> None:
    # Without them, rewriting pytest's reports from the package passed every test of these runners.
    inst, sandbox = calc
    files = ["tests/test_calc.py", "tests/test_other.py"]  # the test patch names only the first
    inst = inst.model_copy(update={"runner": runner, "test_directives": files})
    sandbox.reset()
    assert grade(sandbox, inst, inst.patch, timeout_s=120)["resolved"] is True
    sandbox.reset()
    out = grade(sandbox, inst, calc_with(FORCE_PASS), timeout_s=120)
    assert out["resolved"] is False and "planted test that must fail came back PASSED" in out["tampering"], (
        out
    )
    assert "exited 0 although planted tests failed" in out["tampering"]


@pytest.mark.parametrize("where", [0, -1])
def test_hanging_where_the_planted_tests_run_earns_nothing(
    calc: tuple[SweBenchInstance, Any], where: int
) -> None:
    inst, sandbox = calc
    sandbox.reset()
    out = grade(sandbox, inst, calc_with(HANG_AT.replace("WHERE", str(where))), timeout_s=5)
    assert out["resolved"] is False and out["run_error"] == "the tests timed out", out
    assert "tests/test_calc.py::test_add" not in out["statuses"] or out["tampering"], out


def test_the_gold_patch_with_test_edits_still_resolves(calc: tuple[SweBenchInstance, Any]) -> None:
    # Source and test machinery in one patch: the fix is graded, the conftest is not.
    out = run(calc, calc[0].patch + new_file("conftest.py", SKIP_ALL))
    assert out["resolved"] is True, out["log"]
    assert [d["path"] for d in out["dropped_edits"]] == ["conftest.py"]
    assert out["tampering"] is None and out["reason"] is None
    assert out["statuses"]["tests/test_calc.py::test_add"] == "PASSED"
    assert not any(
        t.startswith("tests/test_") and "calc" not in t and "other" not in t for t in out["statuses"]
    )


def test_what_the_splitter_misses_is_found_changed_and_put_back(calc: tuple[SweBenchInstance, Any]) -> None:
    # The second line of defence on its own: a patch applied with no filter at all (as if the splitter
    # had misread it), then git and find report what changed, and test machinery goes back.
    from tangram_env.envs.swe_bench.grading import (
        _changed_paths,
        _changes_listing,
        _put_back_test_machinery,
        apply_patch,
    )

    inst, sandbox = calc
    sandbox.reset()
    root = sandbox.workspace
    patch = (
        calc_with("# a note\n")
        + new_file("conftest.py", SKIP_ALL)
        + new_file("build/zz.pth", "import calc\n")  # a folder .gitignore could hide from git status
        + "diff --git a/tests/test_other.py b/tests/test_other.py\ndeleted file mode 100644\n"
        "--- a/tests/test_other.py\n+++ /dev/null\n@@ -1,5 +0,0 @@\n"
        + "".join(f"-{line}" for line in OTHER.splitlines(keepends=True))
    )
    applied, log, listed = apply_patch(sandbox, root, patch, "model", _changes_listing(inst.base_commit))
    assert applied and listed is not None, log
    changed = _changed_paths(listed)
    assert {"calc.py", "conftest.py", "build/zz.pth", "tests/test_other.py"} <= set(changed)
    dropped: list[dict[str, str]] = []
    _put_back_test_machinery(sandbox, root, inst, changed, dropped)
    assert {d["path"] for d in dropped} == {"conftest.py", "build/zz.pth", "tests/test_other.py"}
    assert all(d["reason"].endswith("(found changed after applying the patch)") for d in dropped)
    state = sandbox.exec(
        ["sh", "-c", "ls conftest.py build/zz.pth; cat tests/test_other.py; head -1 calc.py"]
    )
    assert "No such file" in state.stderr and state.stdout.count("test_mul_zero") == 1
    assert state.stdout.endswith("# a note\n")  # the source change stays
