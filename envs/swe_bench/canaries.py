"""Planted tests whose outcome the grader knows: how it tells a run it can trust from a tampered one.

The agent's code runs inside the pytest process it is graded by, and a report that code could have
written proves nothing on its own. So each run also collects a test module the grader writes just
before the run (pytest functions; a ``unittest`` case for Django's runner), with names drawn at
random then (the agent cannot know them when it writes its patch): some of its tests must pass and
some must fail. Code that marks every test skipped, passed or
xfailed, exits the interpreter early, rewrites pytest's reports or forges the report file gets at
least one of them wrong or missing, and the whole run is then void.

Every shard runs them first (a runner read from its log gets them first on its command line), so a
shard that stopped after running real tests (its time ran out, or code under test hung) must have
reported them as well.

What this cannot catch: code that tells planted tests from real ones at run time (it can read the
planted module in the sandbox) and tampers with the real ones alone. The patch filter
(:mod:`.patch_filter`) and the runner (which imports pytest before the repository is on
``sys.path``) narrow that down; the planted tests catch everything that acts on all tests alike.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

#: The statuses planted tests must come back with.
MUST_PASS = "PASSED"
MUST_FAIL = "FAILED"


@dataclass(frozen=True)
class Canaries:
    """A planted test module: where it goes, its source, each test's expected status, what a runner's
    command line names to run it (``directive``), and other ids a runner may report a test under
    (``aliases``: that id -> the test's own).
    """

    path: str
    source: str
    expected: dict[str, str]
    directive: str = ""
    aliases: dict[str, str] = field(default_factory=dict)

    @property
    def ids(self) -> set[str]:
        """Every id a planted test may be reported under."""
        return set(self.expected) | set(self.aliases)


def _name() -> str:
    return f"test_{secrets.token_hex(6)}"


def _cases(passing: int, failing: int) -> list[tuple[str, str, str]]:
    """``(name, assertion, status)`` of each planted test, in random order."""
    cases = [MUST_PASS] * passing + [MUST_FAIL] * failing
    out = []
    for i in sorted(range(len(cases)), key=lambda _: secrets.randbits(32)):
        a, b = secrets.randbelow(10**6) + 1, secrets.randbelow(10**6) + 1
        claimed = a * b if cases[i] == MUST_PASS else a * b + 1 + secrets.randbelow(97)
        out.append((_name(), f"assert {a} * {b} == {claimed}", cases[i]))
    return out


def make_canaries(test_dir: str, passing: int = 2, failing: int = 2) -> Canaries:
    """A pytest module of ``passing`` tests that must pass and ``failing`` that must fail, in
    ``test_dir`` (relative to the repository root; "" for the root), under names drawn now.
    """
    path = f"{test_dir}/{_name()}.py" if test_dir else f"{_name()}.py"
    # Nothing in it says what it is: code under test has to work that out.
    cases = _cases(passing, failing)
    source = "\n\n".join(f"def {name}():\n    {check}\n" for name, check, _ in cases)
    return Canaries(path, source, {f"{path}::{name}": want for name, _, want in cases}, directive=path)


def make_unittest_canaries(test_dir: str, package: str, passing: int = 2, failing: int = 2) -> Canaries:
    """:func:`make_canaries` as a ``unittest`` case in ``test_dir``, the folder of the importable
    ``package`` (Django's runner takes the module's label, ``package.module``). unittest's verbose
    lines name a test ``method (module.Class)``, and from Python 3.11 ``method (module.Class.method)``.
    """
    module, case = _name(), f"Test{secrets.token_hex(6)}"
    label = f"{package}.{module}"
    cases = _cases(passing, failing)
    methods = "".join(f"\n    def {name}(self):\n        {check}\n" for name, check, _ in cases)
    source = f"import unittest\n\n\nclass {case}(unittest.TestCase):{methods}"
    expected = {f"{name} ({label}.{case})": want for name, _, want in cases}
    aliases = {f"{name} ({label}.{case}.{name})": f"{name} ({label}.{case})" for name, _, _ in cases}
    return Canaries(f"{test_dir}/{module}.py", source, expected, directive=label, aliases=aliases)


def check_canaries(canaries: Canaries, statuses: dict[str, str]) -> list[str]:
    """What is wrong with the planted tests' outcomes in one run's ``statuses`` (empty: all right)."""
    problems = []
    reported = dict(statuses)
    for alias, test in canaries.aliases.items():
        if alias in statuses:
            reported.setdefault(test, statuses[alias])
    for test, want in canaries.expected.items():
        got = reported.get(test)
        if got is None:
            problems.append(f"a planted test that must {_verb(want)} did not report")
        elif got != want:
            problems.append(f"a planted test that must {_verb(want)} came back {got}")
    return sorted(set(problems))


def _verb(status: str) -> str:
    return "pass" if status == MUST_PASS else "fail"
