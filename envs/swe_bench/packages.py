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
    deselect: tuple[str, ...] = ()  # node id prefixes left out (slow or environment-bound tests)
    requirements: tuple[str, ...] = field(default=(PYTEST_REQUIREMENT,))
    max_instances: int = 10

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


def get_packages(names: list[str] | None = None) -> list[Package]:
    """The packages named (all when ``names`` is empty), or ``KeyError`` with the known names."""
    if not names:
        return list(PACKAGES)
    by_name = {p.name: p for p in PACKAGES}
    missing = [n for n in names if n not in by_name]
    if missing:
        from tangram_env.errors import UnknownNameError

        raise UnknownNameError(f"unknown package(s) {', '.join(missing)}; known: {', '.join(by_name)}")
    return [by_name[n] for n in names]
