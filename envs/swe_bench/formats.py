"""The published formats of SWE-style RL data, read from local files into :class:`SweBenchInstance`.

- **SWE-bench** (and **SWE-Gym**, which publishes SWE-bench's own fields): ``instance_id``, ``repo``,
  ``base_commit``, ``patch``, ``test_patch``, ``problem_statement``, ``FAIL_TO_PASS``, ``PASS_TO_PASS``
  (JSON strings), ``version``, ``environment_setup_commit``... SWE-Gym's images are named
  ``xingyaoww/sweb.eval.x86_64.<id with "__" as "_s_", lower case>`` (as SWE-Gym's OpenHands fork
  names them), with SWE-bench's layout (``/testbed``, ``/opt/miniconda3/envs/testbed``).
- **SWE-smith**: SWE-bench's test fields plus ``image_name``; ``repo`` is the mirror
  (``swesmith/<owner>__<name>.<commit8>``), each bug lives on a branch named by ``instance_id``, and
  ``patch`` is the change that *introduced* the bug, so the fix (the gold patch here) is its reverse.
- **R2E-Gym**: ``repo_name``, ``commit_hash``, ``docker_image``, ``problem_statement``,
  ``parsed_commit_content`` (the fix commit as JSON: ``old_commit_hash``, ``file_diffs`` of hunks),
  ``relevant_files`` (the fix's non-test files) and ``expected_output_json`` (each test's status after
  the fix, tests named ``Class.test``). Its images hold the repository at ``/testbed`` with its
  environment in ``/testbed/.venv``, ``run_tests.sh`` at the repository's root and the tests at
  ``/r2e_tests`` (R2E-Gym's runtime moves both under ``/root``; see ``runners.R2E_TEST``).

:func:`load_file` reads JSON, JSON Lines or parquet, detects the format per row (or takes it), and
validates every row; a bad row raises :class:`InstanceError` naming it, or with ``skip_bad=True`` is
left out and listed in the returned :class:`LoadReport`.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tangram_env.envs.swe_bench.instance import (
    TESTBED,
    TESTBED_PYTHON,
    InstanceError,
    SweBenchInstance,
    validate_instance,
)

log = logging.getLogger(__name__)

FORMATS = ("swe-bench", "swe-gym", "swe-smith", "r2e-gym")
#: Where R2E-Gym's images keep the repository's environment.
R2E_PYTHON = "/testbed/.venv/bin/python"
_HUNK = re.compile(r"^@@ -(\d+(?:,\d+)?) \+(\d+(?:,\d+)?) @@(.*)$")


@dataclass
class BadRow:
    """A row left out of a load: where it was, its id if it had one, and why."""

    index: int
    instance_id: str
    error: str


@dataclass
class LoadReport:
    """The instances of a file and the rows left out (only with ``skip_bad=True``)."""

    instances: list[SweBenchInstance]
    skipped: list[BadRow] = field(default_factory=list)
    formats: dict[str, int] = field(default_factory=dict)


# --- format detection and conversion --------------------------------------------------------------
def detect_format(row: dict[str, Any]) -> str:
    """The format of one row, from the fields only that format has."""
    if "expected_output_json" in row or "parsed_commit_content" in row or "docker_image" in row:
        return "r2e-gym"
    if "image_name" in row or str(row.get("repo", "")).startswith("swesmith/"):
        return "swe-smith"
    return "swe-bench"


def reverse_patch(patch: str) -> str:
    """``patch`` undone: old and new sides swapped (file names, modes, hunk ranges, ``+``/``-`` lines)."""
    out: list[str] = []
    lines = patch.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            match = re.match(r"^diff --git a/(\S+) b/(\S+)$", line)
            out.append(f"diff --git a/{match.group(2)} b/{match.group(1)}" if match else line)
        elif line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = line[4:], lines[i + 1][4:]
            out.append("--- " + ("/dev/null" if new == "/dev/null" else "a/" + new.removeprefix("b/")))
            out.append("+++ " + ("/dev/null" if old == "/dev/null" else "b/" + old.removeprefix("a/")))
            i += 1
        elif line.startswith("new file mode "):
            out.append("deleted" + line[3:])
        elif line.startswith("deleted file mode "):
            out.append("new" + line[7:])
        elif line.startswith("index ") and ".." in line:
            words = line.split()
            a, b = words[1].split("..", 1)
            out.append(" ".join(["index", f"{b}..{a}", *words[2:]]))
        elif (hunk := _HUNK.match(line)) is not None:
            out.append(f"@@ -{hunk.group(2)} +{hunk.group(1)} @@{hunk.group(3)}")
        elif line.startswith("+") and not line.startswith("+++ "):
            out.append("-" + line[1:])
        elif line.startswith("-") and not line.startswith("--- "):
            out.append("+" + line[1:])
        else:
            out.append(line)
        i += 1
    return "\n".join(out) + "\n"


def _test_list(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as exc:
            raise InstanceError(f"{name} is not a JSON list: {exc}") from None
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, list):
        raise InstanceError(f"{name} must be a list of test ids")
    return value


def from_swe_gym(row: dict[str, Any]) -> dict[str, Any]:
    """A SWE-Gym row: SWE-bench's fields, run in SWE-Gym's published image."""
    iid = str(row.get("instance_id", ""))
    image = f"xingyaoww/sweb.eval.x86_64.{iid.replace('__', '_s_')}".lower()
    return {"image": image, "workdir": TESTBED, "python": TESTBED_PYTHON, **row}


def from_swe_smith(row: dict[str, Any]) -> dict[str, Any]:
    """A SWE-smith row: the gold patch is the bug's patch reversed; the bug is the branch ``instance_id``."""
    bug = row.get("patch")
    if not isinstance(bug, str) or "@@" not in bug:
        raise InstanceError("patch (the change that introduced the bug) must be a unified diff")
    if not row.get("image_name"):
        raise InstanceError("image_name is missing (SWE-smith's image of the repository)")
    out = {k: v for k, v in row.items() if k not in ("patch", "image_name")}
    out.update(
        patch=reverse_patch(bug),
        base_commit=row.get("base_commit") or row.get("instance_id"),
        image=row["image_name"],
        workdir=TESTBED,
        python=TESTBED_PYTHON,
    )
    return out


def _r2e_patch(parsed: dict[str, Any], relevant: list[str]) -> str:
    """The fix's diff of ``relevant`` files, rebuilt from R2E-Gym's parsed commit."""
    sections = []
    for diff in parsed.get("file_diffs") or []:
        path = ((diff.get("header") or {}).get("file") or {}).get("path")
        if path not in relevant or diff.get("is_binary_file"):
            continue
        lines = [f"diff --git a/{path} b/{path}", f"--- a/{path}", f"+++ b/{path}"]
        for hunk in diff.get("hunks") or []:
            desc = hunk.get("descriptor") or {}
            old, new = desc.get("old_range") or {}, desc.get("new_range") or {}
            section = str(desc.get("section") or "").strip()
            lines.append(
                f"@@ -{old.get('start', 0)},{old.get('length', 0)} +{new.get('start', 0)},"
                f"{new.get('length', 0)} @@{' ' + section if section else ''}"
            )
            for item in (hunk.get("line_group") or {}).get("all_lines") or []:
                kind = item.get("type")
                if kind == "note":
                    lines.append(f"\\ {item.get('content', '')}")
                else:
                    lines.append(
                        {"context": " ", "added": "+", "deleted": "-"}.get(kind, " ") + item["content"]
                    )
        sections.append("\n".join(lines))
    return "\n".join(sections) + "\n" if sections else ""


def from_r2e_gym(row: dict[str, Any]) -> dict[str, Any]:
    """An R2E-Gym row: tests that pass after the fix must pass (R2E-Gym publishes no run before it)."""
    for key in ("repo_name", "commit_hash", "docker_image", "parsed_commit_content", "expected_output_json"):
        if not row.get(key):
            raise InstanceError(f"{key} is missing")
    try:
        parsed = row["parsed_commit_content"]
        parsed = json.loads(parsed) if isinstance(parsed, str) else parsed
        expected = row["expected_output_json"]
        expected = json.loads(expected) if isinstance(expected, str) else expected
    except json.JSONDecodeError as exc:
        raise InstanceError(f"parsed_commit_content or expected_output_json is not JSON: {exc}") from None
    if not isinstance(parsed, dict) or not isinstance(expected, dict):
        raise InstanceError("parsed_commit_content and expected_output_json must be JSON objects")
    relevant = _test_list(row.get("relevant_files") or [], "relevant_files")
    if not relevant:  # the fix's files that are not tests
        relevant = [
            p
            for d in parsed.get("file_diffs") or []
            if (p := ((d.get("header") or {}).get("file") or {}).get("path")) and "test" not in p
        ]
    must_pass = sorted(t for t, s in expected.items() if str(s).upper() == "PASSED")
    repo = str(row["repo_name"])
    return {
        "instance_id": f"{repo}__{row['commit_hash']}",
        "repo": f"r2e-gym/{repo}",
        "base_commit": parsed.get("old_commit_hash") or f"{row['commit_hash']}^",
        "problem_statement": row.get("problem_statement") or "",
        "patch": _r2e_patch(parsed, relevant),
        "FAIL_TO_PASS": must_pass,
        "PASS_TO_PASS": [],
        "image": row["docker_image"],
        "workdir": TESTBED,
        "python": R2E_PYTHON,
        "runner": "r2e-gym",
    }


_CONVERT = {"swe-gym": from_swe_gym, "swe-smith": from_swe_smith, "r2e-gym": from_r2e_gym}


def convert(row: dict[str, Any], fmt: str = "auto") -> SweBenchInstance:
    """One row of ``fmt`` (``auto``: detected) as a validated instance, else :class:`InstanceError`."""
    fmt = detect_format(row) if fmt == "auto" else fmt
    if fmt not in FORMATS:
        raise InstanceError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)}, auto)")
    record = _CONVERT[fmt](row) if fmt in _CONVERT else row
    return validate_instance(record)


# --- files ----------------------------------------------------------------------------------------
def read_rows(path: str | Path) -> list[Any]:
    """The rows of a JSON (a list or one object), JSON Lines or parquet file; a JSON Lines line that is
    not JSON becomes an :class:`InstanceError` in its place (so it can be skipped like any bad row).
    """
    path = Path(path)
    if not path.exists():
        raise InstanceError(f"instance file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise InstanceError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
        return list(pq.read_table(str(path)).to_pylist())
    text = path.read_text(encoding="utf-8")
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InstanceError(f"{path}: not valid JSON: {exc}") from None
        return data if isinstance(data, list) else [data]
    if suffix not in (".jsonl", ".ndjson"):
        raise InstanceError(f"{path}: unknown instance file type {suffix!r} (use .json, .jsonl or .parquet)")
    rows: list[Any] = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                rows.append(InstanceError(f"line {n} is not valid JSON: {exc}"))
    return rows


def load_file(path: str | Path, fmt: str = "auto", *, skip_bad: bool = False) -> LoadReport:
    """Every row of ``path`` in format ``fmt`` (``auto``: detected per row) as an instance.

    A bad row (missing or malformed fields, a repository no runner can grade, a repeated id) raises
    :class:`InstanceError` naming the file, the row and the cause; with ``skip_bad`` it is left out,
    logged and listed in :attr:`LoadReport.skipped` instead.
    """
    report = LoadReport([])
    seen: set[str] = set()
    for index, row in enumerate(read_rows(path)):
        iid = str(row.get("instance_id", "?")) if isinstance(row, dict) else "?"
        try:
            if isinstance(row, Exception):
                raise row
            if not isinstance(row, dict):
                raise InstanceError(f"a {type(row).__name__}, not an object")
            kind = detect_format(row) if fmt == "auto" else fmt
            inst = convert(row, kind)
            if inst.instance_id in seen:
                raise InstanceError(f"instance id {inst.instance_id!r} appears twice")
        except InstanceError as exc:
            message = f"{path}, row {index} ({iid}): {exc}"
            if not skip_bad:
                raise InstanceError(message) from exc
            log.warning("skipping a bad row: %s", message)
            report.skipped.append(BadRow(index, iid, str(exc)))
            continue
        seen.add(inst.instance_id)
        report.instances.append(inst)
        report.formats[kind] = report.formats.get(kind, 0) + 1
    if not report.instances:
        raise InstanceError(f"{path}: no usable instances ({len(report.skipped)} bad rows)")
    return report
