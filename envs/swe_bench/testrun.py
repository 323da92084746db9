"""Runs a list of pytest node ids in shards, in parallel, and merges the per-test reports.

It runs inside a sandbox with the instance's interpreter (``python testrun.py SPEC OUT``), so it
uses the standard library only. SPEC is JSON: ``tests`` (node ids), ``shards``, ``pytest_args``,
``env``, ``timeout_s``, ``plugin_dir`` (where ``tangram_swe_report.py`` lies) and ``trace_root``
(optional). OUT gets ``{"tests": {nodeid: {status,
message[, calls]}}, "shards": [{returncode, timed_out, tail}], "wall_s"}``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

_TAIL = 4000


def split_shards(tests: list[str], shards: int) -> list[list[str]]:
    """Contiguous runs of whole test files, balanced by test count (files share module fixtures)."""
    shards = max(1, min(shards, len(tests)))
    by_file: dict[str, list[str]] = {}
    for t in tests:
        by_file.setdefault(t.split("::", 1)[0], []).append(t)
    groups = sorted(by_file.values(), key=len, reverse=True)
    out: list[list[str]] = [[] for _ in range(shards)]
    for group in groups:  # largest first onto the lightest shard; split a file only if it dominates
        if len(group) > len(tests) / shards and shards > 1:
            for t in group:
                min(out, key=len).append(t)
        else:
            min(out, key=len).extend(group)
    return [s for s in out if s]


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="tangram-swe-run-")
    try:
        return _run_in(spec, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_in(spec: dict[str, Any], work: str) -> dict[str, Any]:
    tests: list[str] = list(spec["tests"])
    env = dict(os.environ)
    env.update(spec.get("env") or {})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (spec["plugin_dir"], env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    if spec.get("trace_root"):
        env["TANGRAM_SWE_TRACE"] = spec["trace_root"]
    procs = []
    started = time.monotonic()
    for i, shard in enumerate(split_shards(tests, int(spec.get("shards") or 1))):
        report = os.path.join(work, f"shard{i}.jsonl")
        select = os.path.join(work, f"shard{i}.select.json")
        with open(select, "w", encoding="utf-8") as fh:
            json.dump(shard, fh)
        # Files on the command line, tests picked by the plugin: a test id that no longer exists is
        # not run, instead of making pytest refuse the whole command; a missing file is left out.
        files = [f for f in dict.fromkeys(t.split("::", 1)[0] for t in shard) if os.path.exists(f)]
        log = open(os.path.join(work, f"shard{i}.log"), "wb")  # noqa: SIM115 - closed below
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tangram_swe_report",
            "-p",
            "no:cacheprovider",
            "-q",
            *spec.get("pytest_args", []),
            "--",
            *files,
        ]
        shard_env = dict(env, TANGRAM_SWE_REPORT=report, TANGRAM_SWE_SELECT=select)
        if not files:
            log.close()
            continue
        # No pinning per shard: the whole run is already held to the granted cores, and the kernel
        # spreads the shards' processes over them.
        procs.append(
            (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=shard_env), report, log)
        )
    deadline = started + float(spec.get("timeout_s") or 600)
    results: dict[str, Any] = {}
    shards_out = []
    for proc, report, log in procs:
        timed_out = False
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            timed_out = True
        log.close()
        with open(log.name, "rb") as fh:
            tail = fh.read()[-_TAIL:].decode("utf-8", "replace")
        shards_out.append({"returncode": proc.returncode, "timed_out": timed_out, "tail": tail})
        if os.path.exists(report):
            with open(report, encoding="utf-8") as fh:
                for line in fh:
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue  # a line cut short by a kill
                    results[record.pop("nodeid")] = record
    return {"tests": results, "shards": shards_out, "wall_s": time.monotonic() - started}


def main(argv: list[str]) -> int:
    """``testrun.py SPEC_JSON OUT_JSON``: run the spec's tests and write the merged report."""
    if len(argv) != 2:
        print("usage: testrun.py SPEC_JSON OUT_JSON", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as fh:
        spec = json.load(fh)
    out = _run(spec)
    with open(argv[1], "w", encoding="utf-8") as fh:
        json.dump(out, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
