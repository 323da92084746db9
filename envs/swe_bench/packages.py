"""The open-source packages the offline task set is made from, pinned to exact releases.

Each is a small pure-Python project whose PyPI source distribution ships its own pytest suite, which
runs in seconds and needs nothing but pytest. ``sources`` are the files bugs are injected into;
``tests`` the test files that the baseline run (and so the instances) use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: The pytest every instance environment gets (one release, so runs are reproducible).
PYTEST_REQUIREMENT = "pytest==8.3.5"


@dataclass(frozen=True)
class Package:
    """A pinned source release and how to test it."""

    name: str  # PyPI name
    version: str
    repo: str  # upstream "owner/name", SWE-bench's ``repo`` field
    sources: tuple[str, ...]  # files (relative to the sdist root) that bugs go into
    tests: tuple[str, ...]  # test files or directories the suite runs
    pythonpath: str = "."  # where the package imports from, relative to the repository root
    pytest_args: tuple[str, ...] = ("-o", "addopts=")  # the sdists' addopts often need plugins we lack
    deselect: tuple[str, ...] = ()  # test id prefixes left out (slow or environment-bound tests)
    requirements: tuple[str, ...] = field(default=(PYTEST_REQUIREMENT,))
    max_instances: int = 10
    #: The runner its instances are graded by (see :mod:`.runners`): ``pytest``, ``django``, ``sympy``.
    runner: str = "pytest"
    #: For a runner other than pytest: the command its tests run with (None: the runner's own).
    test_command: str | None = None
    test_env: tuple[tuple[str, str], ...] = ()

    @property
    def test_paths(self) -> tuple[str, ...]:
        """The files or directories ``tests`` stand for (django names test modules by label)."""
        if self.runner == "django":
            return tuple(f"tests/{label.split('.', 1)[0]}" for label in self.tests)
        return self.tests

    @property
    def slug(self) -> str:
        """The name as used in instance ids and directories."""
        return self.name.replace("-", "_").replace(".", "_")

    @property
    def requirement(self) -> str:
        """``name==version``."""
        return f"{self.name}=={self.version}"


PACKAGES: tuple[Package, ...] = (
    Package(
        "inflection", "0.5.1", "jpvanhal/inflection", ("inflection/__init__.py",), ("test_inflection.py",)
    ),
    Package(
        "isodate",
        "0.7.2",
        "gweis/isodate",
        (
            "src/isodate/isodates.py",
            "src/isodate/isotime.py",
            "src/isodate/isoduration.py",
            "src/isodate/duration.py",
            "src/isodate/isotzinfo.py",
            "src/isodate/isostrf.py",
        ),
        ("tests",),
        pythonpath="src",
    ),
    Package(
        "cachetools",
        "8.0.0",
        "tkem/cachetools",
        ("src/cachetools/__init__.py", "src/cachetools/keys.py", "src/cachetools/_cached.py"),
        ("tests",),
        pythonpath="src",
        deselect=("tests/test_threading.py",),
    ),
    Package(
        "toolz",
        "1.2.0",
        "pytoolz/toolz",
        ("toolz/itertoolz.py", "toolz/dicttoolz.py", "toolz/functoolz.py", "toolz/recipes.py"),
        (
            "toolz/tests/test_itertoolz.py",
            "toolz/tests/test_dicttoolz.py",
            "toolz/tests/test_functoolz.py",
            "toolz/tests/test_recipes.py",
        ),
    ),
    Package(
        "tabulate",
        "0.10.0",
        "astanin/python-tabulate",
        ("tabulate/__init__.py",),
        # test_cli.py runs the command line in subprocesses: most of the suite's time, little coverage.
        (
            "test/test_api.py",
            "test/test_input.py",
            "test/test_internal.py",
            "test/test_output.py",
            "test/test_regression.py",
            "test/test_textwrapper.py",
        ),
    ),
    Package("parse", "1.22.4", "r1chardj0n3s/parse", ("parse/__init__.py",), ("tests",)),
    Package(
        "semver",
        "3.1.1",
        "python-semver/python-semver",
        ("src/semver/version.py", "src/semver/_deprecated.py"),
        ("tests",),
        pythonpath="src",
        deselect=("tests/test_docstrings.py",),
    ),
    Package(
        "boltons",
        "26.2.0",
        "mahmoud/boltons",
        (
            "boltons/strutils.py",
            "boltons/iterutils.py",
            "boltons/listutils.py",
            "boltons/setutils.py",
            "boltons/mathutils.py",
            "boltons/dictutils.py",
        ),
        (
            "tests/test_strutils.py",
            "tests/test_iterutils.py",
            "tests/test_listutils.py",
            "tests/test_setutils.py",
            "tests/test_mathutils.py",
            "tests/test_dictutils.py",
        ),
    ),
)


#: Sympy's source releases carry its tests but not ``bin/test``; this is what ``bin/test -C --verbose``
#: runs (the same runner, in one process so prepare can trace it).
SYMPY_TEST = (
    "{python} -c 'import sys; from sympy.testing.runtests import test; "
    "sys.exit(not test(*sys.argv[1:], subprocess=False, verbose=True, colors=False))'"
)

#: Releases of SWE-bench's own repositories whose source distributions ship their tests, graded by
#: each repository's own runner.
SWE_BENCH_PACKAGES: tuple[Package, ...] = (
    Package(
        "Django",
        "5.1.4",
        "django/django",
        ("django/utils/text.py", "django/utils/html.py"),
        ("utils_tests.test_text", "utils_tests.test_html"),
        # Its outcome depends on the patch release of Python's html.parser (3.11.2 and 3.11.7 differ),
        # so an instance validated on one interpreter would not hold on another (the Docker image's).
        deselect=("test_strip_tags (",),
        requirements=("asgiref==3.8.1", "sqlparse==0.5.3"),
        runner="django",
        max_instances=4,
    ),
    Package(
        "sympy",
        "1.13.3",
        "sympy/sympy",
        ("sympy/utilities/iterables.py",),
        ("sympy/utilities/tests/test_iterables.py",),
        requirements=("mpmath==1.3.0",),
        runner="sympy",
        test_command=SYMPY_TEST,
        test_env=(("SYMPY_USE_CACHE", "no"),),
        max_instances=4,
    ),
    Package(
        "flask",
        "3.1.0",
        "pallets/flask",
        ("src/flask/helpers.py", "src/flask/config.py", "src/flask/json/tag.py"),
        ("tests/test_helpers.py", "tests/test_config.py", "tests/test_json_tag.py"),
        pythonpath="src",
        requirements=(
            PYTEST_REQUIREMENT,
            "Werkzeug==3.1.3",
            "Jinja2==3.1.4",
            "itsdangerous==2.2.0",
            "click==8.1.7",
            "blinker==1.9.0",
        ),
        max_instances=4,
    ),
    Package(
        "requests",
        "2.32.3",
        "psf/requests",
        ("src/requests/utils.py", "src/requests/structures.py"),
        ("tests/test_utils.py", "tests/test_structures.py"),
        pythonpath="src",
        requirements=(
            PYTEST_REQUIREMENT,
            "urllib3==2.2.3",
            "idna==3.10",
            "charset-normalizer==3.4.0",
            "certifi==2024.8.30",
        ),
        max_instances=4,
    ),
    Package(
        "pytest",
        "8.3.5",
        "pytest-dev/pytest",
        ("src/_pytest/mark/expression.py", "src/_pytest/_io/saferepr.py"),
        ("testing/test_mark_expression.py", "testing/io/test_saferepr.py"),
        pythonpath="src",
        pytest_args=("-o", "addopts=", "-p", "pytester"),
        runner="pytest-log",
        max_instances=4,
    ),
    Package(
        "pylint",
        "4.1.5",
        "pylint-dev/pylint",
        ("pylint/checkers/utils.py", "pylint/utils/utils.py"),
        ("tests/checkers/unittest_utils.py", "tests/utils/unittest_utils.py"),
        requirements=(
            "pytest==8.4.2",  # its tests need pytest 8.4 or later
            "astroid==4.3.4",
            "dill==0.4.0",
            "isort==6.0.1",
            "mccabe==0.7.0",
            "platformdirs==4.3.8",
            "tomlkit==0.13.3",
        ),
        max_instances=4,
    ),
    Package(
        "seaborn",
        "0.13.2",
        "mwaskom/seaborn",
        ("seaborn/palettes.py", "seaborn/utils.py", "seaborn/algorithms.py"),
        ("tests/test_palettes.py", "tests/test_utils.py", "tests/test_algorithms.py"),
        # These download seaborn's data sets where the host has a network; sandboxes have none.
        deselect=(
            "tests/test_utils.py::test_get_dataset_names",
            "tests/test_utils.py::test_load_datasets",
            "tests/test_utils.py::test_load_dataset_string_error",
        ),
        requirements=(PYTEST_REQUIREMENT, "numpy==1.26.4", "pandas==2.2.3", "matplotlib==3.9.2"),
        test_env=(("MPLBACKEND", "Agg"),),
        max_instances=4,
    ),
    Package(
        "xarray",
        "2026.9.0",
        "pydata/xarray",
        ("xarray/core/utils.py", "xarray/core/formatting.py"),
        ("xarray/tests/test_utils.py", "xarray/tests/test_formatting.py"),
        requirements=(PYTEST_REQUIREMENT, "numpy==1.26.4", "pandas==2.2.3", "packaging==24.2"),
        max_instances=4,
    ),
    Package(
        "sphinx",
        "9.0.4",
        "sphinx-doc/sphinx",
        ("sphinx/util/matching.py", "sphinx/util/rst.py", "sphinx/util/docstrings.py"),
        (
            "tests/test_util/test_util_matching.py",
            "tests/test_util/test_util_rst.py",
            "tests/test_util/test_util_docstrings.py",
        ),
        requirements=(
            PYTEST_REQUIREMENT,
            "defusedxml==0.7.1",  # its tests' own requirement
            "sphinxcontrib-applehelp==2.0.0",
            "sphinxcontrib-devhelp==2.0.0",
            "sphinxcontrib-htmlhelp==2.1.0",
            "sphinxcontrib-jsmath==2.0.0",
            "sphinxcontrib-qthelp==2.0.0",
            "sphinxcontrib-serializinghtml==2.0.0",
            "Jinja2==3.1.6",
            "Pygments==2.21.0",
            "docutils==0.22.4",
            "snowballstemmer==3.1.1",
            "babel==2.19.0",
            "alabaster==1.0.0",
            "imagesize==2.0.1",
            "requests==2.34.2",
            "roman-numerals==4.1.0",
            "packaging==26.4",
        ),
        max_instances=4,
    ),
)

#: Every package prepare knows, the small fast ones first.
ALL_PACKAGES: tuple[Package, ...] = PACKAGES + SWE_BENCH_PACKAGES


def get_packages(names: list[str] | None = None) -> list[Package]:
    """The packages named (the small default set when ``names`` is empty), or ``KeyError`` with the
    known names.
    """
    if not names:
        return list(PACKAGES)
    by_name = {p.name: p for p in ALL_PACKAGES}
    missing = [n for n in names if n not in by_name]
    if missing:
        from tangram_env.errors import UnknownNameError

        raise UnknownNameError(f"unknown package(s) {', '.join(missing)}; known: {', '.join(by_name)}")
    return [by_name[n] for n in names]


def packages_of_repos(repos: list[str]) -> list[Package]:
    """The packages of the repositories named (``django/django`` or just ``django``), or ``KeyError``."""
    out: list[Package] = []
    for repo in repos:
        found = [p for p in ALL_PACKAGES if repo in (p.repo, p.repo.split("/")[1], p.name)]
        if not found:
            from tangram_env.errors import UnknownNameError

            known = ", ".join(p.repo for p in ALL_PACKAGES)
            raise UnknownNameError(f"no package of repository {repo!r}; known: {known}")
        out.extend(p for p in found if p not in out)
    return out
