"""What of an agent's patch is graded: changes to the source only, never to the test machinery.

SWE-bench resets the test files before it runs them; this goes further, because any file that pytest
or the interpreter reads before or around the tests can decide what they report. A patch is split into
its per-file sections, and a section is dropped when any path it names is:

- a test file: one the instance's test patch or test ids name, ``test_*.py``, ``*_test.py``, or a
  file under a ``tests/`` or ``test/`` directory;
- a ``conftest.py`` anywhere;
- test or packaging configuration: ``pytest.ini``, ``pytest.toml``, ``tox.ini``, ``setup.cfg``,
  ``pyproject.toml`` (read by pytest for its options);
- code the interpreter runs on its own: a ``sitecustomize`` or ``usercustomize`` module or package
  (any file named so, or under a folder named so), ``*.pth``;
- installation metadata (``*.egg-info/``, ``*.dist-info/``, ``*.egg-link``: entry points load pytest
  plugins), compiled code (``*.pyc``, ``__pycache__/``: an unchecked ``.pyc`` replaces its source);
- a symbolic link, or a path outside the repository (absolute, ``..``, ``.git``).

The same rule (:func:`protected_reason`) judges the paths found changed in the sandbox after the patch
is applied, so a patch this parser misreads still cannot change what grades it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import fnmatch

_CONFIG_FILES = frozenset(
    # run_tests.sh: the test command R2E-Gym's images ship at the repository's root
    {
        "pytest.ini",
        ".pytest.ini",
        "pytest.toml",
        ".pytest.toml",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        "run_tests.sh",
    }
)
#: Modules ``site`` imports in every interpreter whose ``sys.path`` holds them: a file of any suffix
#: (``.py``, a compiled extension) or a package.
_STARTUP_MODULES = frozenset({"sitecustomize", "usercustomize"})
_TEST_DIRS = frozenset({"tests", "test", "r2e_tests"})
_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\", "a": "\a", "b": "\b", "f": "\f", "r": "\r", "v": "\v"}


def protected_reason(path: str, test_files: frozenset[str] | set[str] = frozenset()) -> str | None:
    """Why a change to ``path`` (relative to the repository root) is not graded, or None if it is."""
    parts = path.split("/")
    name = parts[-1]
    if path.startswith("/") or ".." in parts or ".git" in parts or not name:
        return "outside the repository's source"
    if path in test_files:
        return "a test file of the instance"
    if name == "conftest.py":
        return "pytest configuration (conftest.py)"
    if fnmatch(name, "test_*.py") or fnmatch(name, "*_test.py") or _TEST_DIRS.intersection(parts[:-1]):
        return "a test file"
    if name in _CONFIG_FILES:
        return "test or packaging configuration"
    if (
        name.split(".", 1)[0] in _STARTUP_MODULES
        or _STARTUP_MODULES.intersection(parts[:-1])
        or name.endswith(".pth")
    ):
        return "code the interpreter runs at start-up"
    if any(p.endswith((".egg-info", ".dist-info")) for p in parts[:-1]) or name.endswith(".egg-link"):
        return "installation metadata (entry points load pytest plugins)"
    if name.endswith((".pyc", ".pyo")) or "__pycache__" in parts:
        return "compiled code"
    return None


@dataclass
class FileDiff:
    """One file's section of a patch: its text and every path its headers name."""

    text: str = ""
    paths: set[str] = field(default_factory=set)
    symlink: bool = False


@dataclass(frozen=True)
class FilteredPatch:
    """The patch to grade and what was dropped from it (``{"path", "reason"}`` each)."""

    patch: str
    dropped: list[dict[str, str]]


def _unquote(name: str) -> str:
    """A path as git writes it in headers: C-quoted when it has special characters."""
    if not (len(name) >= 2 and name[0] == name[-1] == '"'):
        return name
    raw, out, i = name[1:-1], bytearray(), 0
    while i < len(raw):
        ch = raw[i]
        if ch == "\\" and i + 1 < len(raw):
            nxt = raw[i + 1]
            if len(raw) - i >= 4 and all(c in "01234567" for c in raw[i + 1 : i + 4]):
                out.append(int(raw[i + 1 : i + 4], 8) & 0xFF)
                i += 4
                continue
            out.extend(_ESCAPES.get(nxt, nxt).encode())
            i += 2
            continue
        out.extend(ch.encode())
        i += 1
    return out.decode("utf-8", "replace")


def _strip_prefix(name: str) -> str | None:
    """The repository path of a ``---``/``+++`` name (applied with ``-p1``), None for /dev/null."""
    name = _unquote(name.split("\t", 1)[0].rstrip("\r"))
    if name == "/dev/null":
        return None
    return name.split("/", 1)[1] if "/" in name else name


def _header_paths(rest: str) -> set[str]:
    """Paths of ``diff --git a/X b/Y``: every way of splitting it (names with spaces are ambiguous,
    and a wider guess only drops more).
    """
    rest = rest.rstrip("\r")
    if rest.startswith('"'):
        end = rest.find('"', 1)
        while end > 0 and rest[end - 1] == "\\":
            end = rest.find('"', end + 1)
        if end > 0:
            pair = (_strip_prefix(rest[: end + 1]), _strip_prefix(rest[end + 1 :].strip()))
            return {p for p in pair if p}
    found: set[str] = set()
    for match in re.finditer(" b/", rest):
        left, right = rest[: match.start()], rest[match.start() + 1 :]
        found.update(p for p in (_strip_prefix(left), _strip_prefix(right)) if p)
    if not found:
        found.update(p for p in (_strip_prefix(w) for w in rest.split()) if p)
    return found


def split_patch(patch: str) -> tuple[str, list[FileDiff]]:
    """``patch`` as its preamble (text before the first file) and its per-file sections."""
    lines = patch.splitlines(keepends=True)
    preamble: list[str] = []
    sections: list[FileDiff] = []
    current: FileDiff | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        starts_plain = (
            line.startswith("--- ")
            and i + 1 < len(lines)
            and lines[i + 1].startswith("+++ ")
            and (current is None or "\n--- " in f"\n{current.text}" or "@@" in current.text)
        )
        if line.startswith("diff --git ") or starts_plain:
            current = FileDiff()
            sections.append(current)
            if line.startswith("diff --git "):
                current.paths |= _header_paths(line[len("diff --git ") :].rstrip("\n"))
        if current is None:
            preamble.append(line)
            i += 1
            continue
        current.text += line
        body = line.rstrip("\n")
        for key in ("--- ", "+++ "):
            if body.startswith(key):
                path = _strip_prefix(body[len(key) :])
                if path:
                    current.paths.add(path)
        for key in ("rename from ", "rename to ", "copy from ", "copy to "):
            if body.startswith(key):
                current.paths.add(_unquote(body[len(key) :]))
        if body.startswith(("new file mode 120000", "new mode 120000")):
            current.symlink = True
        hunk = _HUNK.match(body)
        i += 1
        if hunk:
            old = int(hunk.group(1)) if hunk.group(1) is not None else 1
            new = int(hunk.group(2)) if hunk.group(2) is not None else 1
            while i < len(lines) and (old > 0 or new > 0):
                tag = lines[i][:1]
                if tag in (" ", "\n", "\r"):
                    old, new = old - 1, new - 1
                elif tag == "-":
                    old -= 1
                elif tag == "+":
                    new -= 1
                elif tag != "\\":
                    break  # a hunk cut short: the next line is a header again
                current.text += lines[i]
                i += 1
            while i < len(lines) and lines[i].startswith("\\"):
                current.text += lines[i]
                i += 1
    return "".join(preamble), sections


def filter_patch(patch: str, test_files: frozenset[str] | set[str] = frozenset()) -> FilteredPatch:
    """``patch`` without the sections that touch test machinery (see the module docstring)."""
    preamble, sections = split_patch(patch)
    kept: list[str] = []
    dropped: list[dict[str, str]] = []
    for section in sections:
        reasons = {p: protected_reason(p, test_files) for p in sorted(section.paths)}
        if section.symlink:
            reasons = {p: "a symbolic link" for p in reasons} or {"?": "a symbolic link"}
        bad = {p: r for p, r in reasons.items() if r}
        if not section.paths:
            bad = {"?": "a file section whose path could not be read"}
        if bad:
            dropped.extend({"path": p, "reason": r} for p, r in bad.items())
        else:
            kept.append(section.text)
    text = "".join(kept)
    if text and not text.endswith("\n"):
        text += "\n"
    if not sections and preamble.strip():
        dropped.append({"path": "?", "reason": "text that is not a unified diff"})
    return FilteredPatch(text, dropped)
