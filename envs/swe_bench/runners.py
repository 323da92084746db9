"""Each repository's own test runner: the command SWE-bench's harness runs and how its log is read.

SWE-bench grades every repository with the test command and log parser of that repository (its
harness's per-repository specs): django runs ``./tests/runtests.py --verbosity 2 --settings=test_sqlite
--parallel 1`` on test *labels* and prints unittest's verbose lines; sympy runs ``bin/test -C --verbose``
and prints ``test_name ok``; the others run pytest with ``-rA`` and are read from its short test summary,
with a few repository quirks (parametrised ids holding absolute paths, colour codes, mouse button
names). This module is that table, written from the published formats:

- :data:`RUNNERS`: ``repo -> Runner`` for every repository of SWE-bench (full, Lite and Verified);
- :func:`runner_for`: the runner of an instance (its own ``runner`` field, the table, or plain pytest
  for other repositories whose tests are pytest node ids), else :class:`UnsupportedInstance`;
- :func:`run_by_log`: run an instance's runner in a sandbox and parse its log *here*, outside the
  sandbox, into the run report grading reads (:class:`.verdict.RunReport`).

Statuses are SWE-bench's vocabulary: ``PASSED``, ``FAILED``, ``SKIPPED``, ``ERROR``, ``XFAIL``.
Runners marked ``native`` are pytest runs whose test ids are plain node ids: grading runs them through
the pytest plugin (exact ids, sharded over the granted cores) and reads the same statuses.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tangram_env.errors import TangramError

if TYPE_CHECKING:
    from tangram_env.envs.swe_bench.canaries import Canaries
    from tangram_env.envs.swe_bench.grading import Box
    from tangram_env.envs.swe_bench.instance import SweBenchInstance
    from tangram_env.envs.swe_bench.verdict import RunReport

PASSED, FAILED, SKIPPED, ERROR, XFAIL = "PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL"
STATUSES = (PASSED, FAILED, SKIPPED, ERROR, XFAIL)
#: Files of a test patch that are data, not tests (SWE-bench leaves them out of the test command).
NON_TEST_SUFFIXES = (
    ".json",
    ".png",
    ".csv",
    ".txt",
    ".md",
    ".jpg",
    ".jpeg",
    ".pkl",
    ".yml",
    ".yaml",
    ".toml",
)
_LOG_TAIL = 4000
_DIFF_TARGET = re.compile(r"^diff --git a/\S+ b/(\S+)$", re.MULTILINE)
_ANSI = re.compile(r"\x1b\[[0-9;]*m|\[(\d+)m")
_CONTROL = {c: None for c in range(1, 32) if c not in (9,)}

Parser = Callable[[str], dict[str, str]]


class UnsupportedInstance(TangramError, ValueError):
    """An instance whose tests no runner here can run (the message says why and what would)."""


# --- log parsers ----------------------------------------------------------------------------------
class _Statuses(dict[str, str]):
    """Statuses read from a log, where a test reported with two different statuses counts as failed.

    A test runs once, so a log that says both is not to be believed; and a patch that prints a
    runner's result lines (at exit, after the real ones) cannot turn a failure into a pass.
    """

    def __setitem__(self, test: str, status: str) -> None:
        if test in self and self[test] != status:
            status = FAILED
            self.contradicted.add(test)
        elif test in self.contradicted:
            status = FAILED
        super().__setitem__(test, status)

    @property
    def contradicted(self) -> set[str]:
        """The tests the log reported with different statuses."""
        return self.__dict__.setdefault("_contradicted", set())


def parse_pytest(log: str) -> dict[str, str]:
    """Read pytest's ``-rA`` short summary: ``PASSED path::test``, ``FAILED path::test - message``, ...

    The id is the first word after the status, as SWE-bench reads it (a parametrised id holding a
    space is cut there in the published test lists as well).
    """
    out: dict[str, str] = _Statuses()
    for line in log.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] in STATUSES and not words[1].startswith("["):
            out[words[1]] = words[0]
    return out


_OPTION = re.compile(r"^(.*?)\[(.*)\]$")


def _short_option(test: str) -> str:
    """``test[/abs/dir/file]`` -> ``test[/file]``: parametrised ids that hold an absolute path are
    listed by the file name alone (the path differs between machines).
    """
    match = _OPTION.match(test)
    if not match:
        return test
    main, option = match.groups()
    if option.startswith("/") and not option.startswith("//") and "*" not in option:
        option = "/" + option.rsplit("/", 1)[-1]
    return f"{main}[{option}]"


def parse_pytest_options(log: str) -> dict[str, str]:
    """:func:`parse_pytest`, with absolute paths in parametrised ids shortened to the file name
    (requests, pylint, pydicom).
    """
    out: dict[str, str] = _Statuses()
    for test, status in parse_pytest(log).items():
        out[_short_option(test)] = status
    return out


def _clean(line: str) -> str:
    return _ANSI.sub("", line).translate(_CONTROL)


def parse_pytest_v2(log: str) -> dict[str, str]:
    """Read pytest logs with colour codes, and the verbose ``path::test STATUS`` lines of older pytest
    (astropy's ``-vv`` classic output, scikit-learn, sphinx through tox).
    """
    out: dict[str, str] = _Statuses()
    for raw in log.splitlines():
        words = _clean(raw).split()
        if len(words) < 2:
            continue
        if words[0] in STATUSES and not words[1].startswith("["):
            out[words[1]] = words[0]
        elif words[1] in STATUSES and "::" in words[0]:  # ``path::test STATUS [ 50%]``
            out[words[0]] = words[1]
    return out


def parse_seaborn(log: str) -> dict[str, str]:
    """Read seaborn's runs: ``FAILED`` summary lines and ``PASSED`` in either place; nothing else counts."""
    out: dict[str, str] = _Statuses()
    for line in log.splitlines():
        words = line.split()
        if len(words) < 2:
            continue
        if words[0] == FAILED:
            out[words[1]] = FAILED
        elif words[1] == PASSED:
            out[words[0]] = PASSED
        elif words[0] == PASSED:
            out[words[1]] = PASSED
    return out


def parse_matplotlib(log: str) -> dict[str, str]:
    """Read pytest's summary with mouse buttons named by number (``MouseButton.LEFT`` -> ``1``)."""
    return parse_pytest(log.replace("MouseButton.LEFT", "1").replace("MouseButton.RIGHT", "3"))


_DJANGO_PASS = (" ... ok", " ... OK", " ...  OK")


def parse_django(log: str) -> dict[str, str]:
    """Django's ``runtests.py --verbosity 2``: unittest's verbose lines ``name (module.Class) ... ok``
    (``skipped '...'``, ``FAIL``, ``ERROR``), the ``FAIL: name`` / ``ERROR: name`` headers of the
    failure report, and a test whose output broke its line, so that ``ok`` stands alone on a later
    line. The name is what precedes `` ... `` (a docstring's first line when the test has one).
    """
    out: dict[str, str] = _Statuses()
    last: str | None = None
    for raw in log.splitlines():
        line = raw.strip()
        if " ... " in line:
            last = line.split(" ... ", 1)[0]
        if line.endswith(_DJANGO_PASS):
            out[line.rsplit(" ...", 1)[0]] = PASSED
        elif " ... skipped" in line:
            out[line.split(" ... skipped", 1)[0]] = SKIPPED
        elif line.endswith(" ... FAIL"):
            out[line[: -len(" ... FAIL")]] = FAILED
        elif line.endswith(" ... ERROR"):
            out[line[: -len(" ... ERROR")]] = ERROR
        elif line.startswith(("FAIL: ", "ERROR: ")):
            status, name = line.split(": ", 1)
            out[name.strip()] = FAILED if status == "FAIL" else ERROR
        elif line.startswith("ok") and line[2:].strip() == "" and last is not None:
            out[last] = PASSED
    return out


#: A failure report's header: ``path.py:test`` (``path.py::test`` in later releases).
_SYMPY_FAILURE = re.compile(r"^_+ (\S+\.py)(::?)(\S+) _+$", re.MULTILINE)
_SYMPY_LINE = {"ok": PASSED, "F": FAILED, "E": ERROR}


def parse_sympy(log: str) -> dict[str, str]:
    """Read sympy's ``bin/test -C --verbose``: ``test_name ok`` / ``F`` / ``E`` under each file's header,
    and ``___ path.py:test_name ___`` headers of the failure report.
    """
    out: dict[str, str] = _Statuses()
    for match in _SYMPY_FAILURE.finditer(log):
        out["".join(match.groups())] = FAILED
    for raw in log.splitlines():
        words = raw.strip().split()
        # ``test_name ok``; the last test of a file also carries the file's verdict: ``ok   [OK]``
        if len(words) >= 2 and words[0].startswith("test_") and words[1] in _SYMPY_LINE:
            out[words[0]] = _SYMPY_LINE[words[1]]
    return out


def parse_r2e(log: str) -> dict[str, str]:
    """R2E-Gym's ``run_tests.sh``: pytest's short summary, each test named by its node id without the
    file (``Class.test``), as R2E-Gym's expected outputs name them.
    """
    out: dict[str, str] = _Statuses()
    for line in log.splitlines():
        words = _clean(line).split()
        if len(words) >= 2 and words[0] in STATUSES and "::" in words[1]:
            out[".".join(words[1].split("::")[1:])] = words[0]
    return out


def _exception_of(block: list[str]) -> str:
    """The exception at the end of a traceback block (what follows its last indented line)."""
    last = max((i for i, line in enumerate(block) if line.startswith("  ")), default=-1)
    return "\n".join(line for line in block[last + 1 :] if line.strip() and not set(line) <= {"-", "="})


_SUBTEST = re.compile(r"^(\S+ \([\w.]+\)) \(.*\)$")
_BLOCK_END = re.compile(r"^(=+( .* =+)?|-{20,}|Ran \d+ tests? in .*|_{20,})$")


def failure_messages(log: str) -> dict[str, str]:
    """The exception each failing test ended with, from the failure reports of unittest (django:
    ``FAIL: name`` then a traceback) and of sympy (``___ path.py:test ___`` then a traceback); keyed as
    the parsers name the tests (sympy's under both ``test`` and ``path.py:test``).
    """
    out: dict[str, str] = {}
    names: list[str] = []
    block: list[str] = []

    def close() -> None:
        message = _exception_of(block)
        for name in names:
            if message:
                out.setdefault(name, message)

    for line in log.splitlines():
        sympy = _SYMPY_FAILURE.match(line)
        if line.startswith(("FAIL: ", "ERROR: ")) or sympy:
            close()
            if sympy:
                names = [sympy.group(3), "".join(sympy.groups())]
            else:
                name = line.split(": ", 1)[1].strip()
                sub = _SUBTEST.match(name)  # a subtest's report names its parameters after the test
                names = [name, sub.group(1)] if sub else [name]
            block = []
        elif names and _BLOCK_END.match(line.strip()) and block:
            close()
            names, block = [], []
        elif names:
            block.append(line)
    close()
    return out


# --- directives: what the command line names ------------------------------------------------------
def test_patch_files(instance: SweBenchInstance) -> list[str]:
    """The test files the instance's test patch touches (data files left out), as SWE-bench runs them."""
    files = [f for f in _DIFF_TARGET.findall(instance.test_patch) if not f.endswith(NON_TEST_SUFFIXES)]
    return list(dict.fromkeys(files))


def _test_ids(instance: SweBenchInstance) -> list[str]:
    return [*instance.FAIL_TO_PASS, *instance.PASS_TO_PASS]


def pytest_directives(instance: SweBenchInstance) -> list[str]:
    """Files to hand pytest: the instance's own list, the test patch's files, else the files its
    node ids live in.
    """
    if instance.test_directives:
        return list(instance.test_directives)
    files = test_patch_files(instance)
    return files or list(dict.fromkeys(t.split("::", 1)[0] for t in _test_ids(instance)))


_DJANGO_ID = re.compile(r"^\S+ \(([\w.]+)\)")


def django_directives(instance: SweBenchInstance) -> list[str]:
    """Django test labels: ``tests/a/test_b.py`` -> ``a.test_b`` for each test patch file, else the
    classes the test ids name (``test_x (a.test_b.Case)`` -> ``a.test_b.Case``).
    """
    if instance.test_directives:
        return list(instance.test_directives)
    labels = [
        f.removeprefix("tests/").removesuffix(".py").replace("/", ".")
        for f in test_patch_files(instance)
        if f.endswith(".py")
    ]
    if labels:
        return list(dict.fromkeys(labels))
    for test in _test_ids(instance):
        match = _DJANGO_ID.match(test)
        if match:
            name, where = test.split(" ", 1)[0], match.group(1)
            labels.append(where.removesuffix(f".{name}"))  # Python 3.11+ also names the method
    return list(dict.fromkeys(labels))


def sympy_directives(instance: SweBenchInstance) -> list[str]:
    """Files for sympy's runner: the instance's own list or the test patch's files (sympy's test ids
    are bare function names, which name no file).
    """
    if instance.test_directives:
        return list(instance.test_directives)
    return [f for f in test_patch_files(instance) if f.endswith(".py")]


# --- the table ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Runner:
    """How one repository's tests run and how their log reads."""

    name: str
    command: str  # run from the repository root; ``{python}`` is the instance's interpreter
    parse: Parser
    directives: Callable[[SweBenchInstance], list[str]] = pytest_directives
    env: dict[str, str] = field(default_factory=dict)
    native: bool = False  # pytest with plain node ids: graded through the plugin instead
    #: The planted tests it runs beside the instance's (:mod:`.canaries`): ``"pytest"`` functions, a
    #: ``"unittest"`` case, or None where its command cannot name an extra module.
    planted: str | None = "pytest"
    #: The runner's own files in the repository: restored before grading, like the tests.
    machinery: tuple[str, ...] = ()

    def test_files(self, instance: SweBenchInstance) -> list[str]:
        """Files grading puts back as they are at the base commit: the runner's own, and every file a
        directive may name (a Django label ``a.b.C`` may be ``tests/a.py``, ``tests/a/b.py``, ...; a
        path that is not at the base commit is removed, which is harmless).
        """
        files = list(self.machinery)
        for name in self.directives(instance):
            if name.endswith(".py") or "/" in name:
                files.append(name)
            elif self is DJANGO:
                parts = name.split(".")
                files += [f"tests/{'/'.join(parts[:i])}.py" for i in range(1, len(parts) + 1)]
                files.append(f"tests/{parts[0]}")
        return list(dict.fromkeys(files))

    def command_line(
        self, instance: SweBenchInstance, python: str | None = None, first: tuple[str, ...] = ()
    ) -> str:
        """The shell command that runs ``instance``'s tests (its ``test_command`` if it has one), and
        the directives ``first`` before them; ``{python}`` in the command becomes the instance's
        interpreter (or ``python``, a shell word).
        """
        base = (instance.test_command or self.command).replace(
            "{python}", python or shlex.quote(instance.python)
        )
        names = [*first, *self.directives(instance)]
        if "pytest" in base and instance.pytest_args:  # the instance's own pytest options come first
            names = [*instance.pytest_args, *names]
        return f"{base} {' '.join(shlex.quote(n) for n in names)}".rstrip()


_PYTEST = "{python} -m pytest --no-header -rA --tb=no -p no:cacheprovider"
_PYTEST_PLAIN = "{python} -m pytest -rA"

PYTEST = Runner("pytest", _PYTEST_PLAIN, parse_pytest, native=True)
PYTEST_OPTIONS = Runner("pytest-options", _PYTEST_PLAIN, parse_pytest_options)
DJANGO = Runner(
    "django",
    "{python} ./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1",
    parse_django,
    django_directives,
    env={"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf8"},
    machinery=("tests/runtests.py", "tests/test_sqlite.py"),
    planted="unittest",
)
SYMPY = Runner(
    "sympy",
    "{python} bin/test -C --verbose",
    parse_sympy,
    sympy_directives,
    env={"PYTHONWARNINGS": "ignore::UserWarning,ignore::SyntaxWarning"},
    machinery=("bin/test", "sympy/testing/runtests.py", "sympy/utilities/runtests.py"),
    planted=None,  # not yet: its log names tests by function alone
)
#: R2E-Gym's images ship ``run_tests.sh`` at the repository's root and the tests at ``/r2e_tests``; its
#: runtime moves both under ``/root`` (out of the agent's sight) and links the tests into the repository
#: for a run, which ``run_tests.sh`` names by a relative path. The same here, in a fresh container.
R2E_TEST = (
    "tests=/root/r2e_tests; [ -d $tests ] || tests=/r2e_tests; rm -rf r2e_tests && ln -s $tests r2e_tests"
    " && if [ -f /root/run_tests.sh ]; then bash /root/run_tests.sh; else bash run_tests.sh; fi"
)
R2E = Runner(
    "r2e-gym", R2E_TEST, parse_r2e, lambda instance: [], planted=None
)  # run_tests.sh names its tests

#: Runners by name (an instance's ``runner`` field names one of these).
BY_NAME: dict[str, Runner] = {
    r.name: r
    for r in (
        PYTEST,
        PYTEST_OPTIONS,
        DJANGO,
        SYMPY,
        R2E,
        Runner("pytest-v2", _PYTEST_PLAIN, parse_pytest_v2, native=True),
        # pytest read from its log: for pytest's own repository, where the pytest under test must be
        # the one that runs (the plugin path imports the environment's pytest before the repository).
        Runner("pytest-log", _PYTEST_PLAIN, parse_pytest),
        Runner(
            "astropy",
            "{python} -m pytest -rA -vv -o console_output_style=classic --tb=no",
            parse_pytest_v2,
            native=True,
        ),
        Runner("seaborn", "{python} -m pytest --no-header -rA", parse_seaborn, native=True),
        Runner("matplotlib", _PYTEST, parse_matplotlib),
        Runner("sphinx", "{python} -m tox --current-env -epy39 -v --", parse_pytest_v2, native=True),
    )
}

#: SWE-bench's repositories and their runners (the harness's per-repository test specs).
RUNNERS: dict[str, Runner] = {
    "astropy/astropy": BY_NAME["astropy"],
    "django/django": DJANGO,
    "marshmallow-code/marshmallow": PYTEST,
    "matplotlib/matplotlib": BY_NAME["matplotlib"],
    "mwaskom/seaborn": BY_NAME["seaborn"],
    "pallets/flask": PYTEST,
    "psf/requests": PYTEST_OPTIONS,
    "pvlib/pvlib-python": PYTEST,
    "pydata/xarray": PYTEST,
    "pydicom/pydicom": PYTEST_OPTIONS,
    "pylint-dev/astroid": PYTEST,
    "pylint-dev/pylint": PYTEST_OPTIONS,
    "pytest-dev/pytest": PYTEST,
    "pyvista/pyvista": PYTEST,
    "scikit-learn/scikit-learn": BY_NAME["pytest-v2"],
    "sqlfluff/sqlfluff": PYTEST,
    "sphinx-doc/sphinx": BY_NAME["sphinx"],
    "sympy/sympy": SYMPY,
}


def _looks_like_pytest(test: str) -> bool:
    path = test.split("::", 1)[0]
    return "::" in test or path.endswith(".py") or "/" in path


def runner_for(instance: SweBenchInstance) -> Runner:
    """The runner that grades ``instance``: the one its ``runner`` field names, its repository's, or
    plain pytest when every test id is a pytest node id; else :class:`UnsupportedInstance`.
    """
    if instance.runner:
        try:
            return BY_NAME[instance.runner]
        except KeyError:
            raise UnsupportedInstance(
                f"{instance.instance_id}: unknown runner {instance.runner!r} "
                f"(known: {', '.join(sorted(BY_NAME))})"
            ) from None
    if instance.repo in RUNNERS:
        return RUNNERS[instance.repo]
    odd = [t for t in _test_ids(instance) if not _looks_like_pytest(t)]
    if odd:
        raise UnsupportedInstance(
            f"{instance.instance_id}: {instance.repo} has no runner here and its tests are not pytest node "
            f"ids (e.g. {odd[0]!r}); set the instance's 'runner' (one of {', '.join(sorted(BY_NAME))}) "
            "or 'test_command' with a runner whose log format matches"
        )
    return PYTEST


def check_runnable(instance: SweBenchInstance) -> None:
    """:class:`UnsupportedInstance` unless a runner can grade ``instance`` (a log runner must also know
    what to run: django and sympy need a test patch or ``test_directives``).
    """
    runner = runner_for(instance)
    if (
        not runner.native
        and runner is not R2E
        and not instance.test_command
        and not runner.directives(instance)
    ):
        raise UnsupportedInstance(
            f"{instance.instance_id}: the {runner.name} runner needs test files to run (a test_patch or "
            "'test_directives')"
        )


# --- running --------------------------------------------------------------------------------------
def run_by_log(
    box: Box,
    instance: SweBenchInstance,
    runner: Runner,
    *,
    root: str,
    cores: tuple[int, ...] = (),
    timeout_s: float = 600.0,
    plant: Canaries | None = None,
) -> tuple[RunReport | None, str | None, tuple[str, ...]]:
    """Run ``instance``'s tests with ``runner``'s command in ``box`` and read the log here, outside
    the sandbox: ``(report, why there is none, limits the run hit)``, the report one shard holding
    each test's status and failure message. ``plant``: a planted module, written for the run and
    named first on the command line. A log cut at the sandbox's output cap is
    :class:`.verdict.ReportError` (tests past the cut would read as failed).
    """
    from tangram_env.envs.swe_bench.grading import put_file
    from tangram_env.envs.swe_bench.verdict import MAX_MESSAGE, MAX_TAIL, ReportError, RunReport

    cmd = runner.command_line(instance, first=(plant.directive,) if plant else ())
    script = f"{cmd} 2>&1"
    if plant is not None:
        put_file(box, f"{root}/{plant.path}", plant.source)
        script = f"{script}; status=$?; rm -f -- {shlex.quote(plant.path)}; exit $status"
    env = {**runner.env, **instance.test_env}
    res = box.exec(["sh", "-c", script], cwd=root, env=env, cores=cores, timeout_s=timeout_s)
    limits = tuple(res.limits_hit)
    if res.killed_by is not None and res.killed_by != "timeout":
        return None, f"the test run was stopped: {res.killed_by} limit", limits
    if res.stdout_truncated or res.stderr_truncated:
        raise ReportError(f"the {runner.name} run's log is larger than the sandbox's output cap")
    log = res.stdout + res.stderr
    statuses = runner.parse(log)
    messages = failure_messages(log) if runner.name in ("django", "sympy") else {}
    tail = f"$ {cmd}\n{log[-_LOG_TAIL:]}"[-MAX_TAIL:]
    shard = {
        "returncode": res.exit_code,
        "timed_out": res.killed_by == "timeout",
        "tail": tail,
        "tests": {
            t: {"status": st, "message": messages.get(t, "")[:MAX_MESSAGE]} for t, st in statuses.items()
        },
    }
    try:
        report = RunReport.model_validate({"shards": [shard], "wall_s": max(0.0, res.wall_s)})
    except ValueError as exc:  # a test id or message beyond what a real run prints
        raise ReportError(f"the {runner.name} run's log does not read as a test run: {exc}") from None
    return report, None, limits
