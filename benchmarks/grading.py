"""What the trusted swe-bench grader costs: the gold patch graded with and without its checks.

    python -m benchmarks.grading [--json] [--repeats 3] [--instances N] [--shards 1] [--legacy]

For each instance of the offline set (prepared on first use; ``--instances`` keeps the first N), the
gold patch is graded in a local sandbox of its image by ``grading.grade`` twice per repeat: the
trusted path (patch filter, check of what the patch changed, planted tests, the runner that imports
pytest first, strict report parsing) and ``legacy=True``, the path as it was before those checks.
The two alternate, and which goes first alternates, so that other work on a shared machine weighs
on both alike; each grade starts from a freshly reset sandbox. An instance's time is the median of
its repeats; the figures are means over instances. ``--legacy`` times the legacy path alone.

JSON (always printed last; with ``--json`` nothing else): ``trusted_vs_legacy_ratio`` (mean trusted
time over mean legacy time; the goal is at most 1.2), ``trusted_mean_s``, ``legacy_mean_s``,
``per_instance`` and the machine's load average before and after.

``--code`` also times the ``code`` env's harness on every task's reference solution (in a plain
subprocess: the sandbox around it costs both paths the same): the judge-and-solution harness against
the single-process harness it replaced, read from git (``--code-legacy-rev``, the last commit that had
it). Under ``code``: ``trusted_vs_legacy_ratio``, both means and medians, and the slowest tasks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import print_table
from tangram_env.envs.swe_bench.grading import grade
from tangram_env.envs.swe_bench.prepare import offline_instances
from tangram_env.sandbox import SandboxSpec
from tangram_env.server.sandbox.local import LocalProvider

PATHS = ("trusted", "legacy")
#: The last commit whose ``code`` harness ran the solution in the process that judged it.
CODE_LEGACY_REV = "3e61306"


def code_figures(repeats: int, legacy_rev: str) -> dict[str, Any]:
    """The ``code`` env's harness on every reference solution, against the harness of ``legacy_rev``."""
    from tangram_env.envs.code_tasks import HarnessSpec, load_tasks, read_report
    from tangram_env.envs.code_tasks.local import run_unsandboxed

    root = Path(__file__).resolve().parent.parent
    shown = subprocess.run(
        ["git", "show", f"{legacy_rev}:envs/code_tasks/harness.py"], cwd=root, capture_output=True
    )
    if shown.returncode != 0:
        why = shown.stderr.decode(errors="replace")[:200]
        return {"error": f"cannot read the legacy harness from git ({legacy_rev}): {why}"}
    with tempfile.TemporaryDirectory(prefix="tangram-legacy-") as tmp:
        legacy_file = Path(tmp, "harness.py")
        legacy_file.write_bytes(shown.stdout)

        def legacy(spec: Any) -> Any:
            report = Path(tmp, "report.json")
            command = [sys.executable, "-I", str(legacy_file), "-", str(report)]
            subprocess.run(command, input=spec.to_json().encode(), capture_output=True, cwd=tmp, timeout=120)
            return read_report(report.read_bytes() if report.exists() else None, spec)

        times: dict[str, dict[str, list[float]]] = {"trusted": {}, "legacy": {}}
        for r in range(repeats):
            for task in load_tasks():
                spec = HarnessSpec.for_task(task, task.reference_solution, timeout_s=30.0)
                order = [("trusted", run_unsandboxed), ("legacy", legacy)]
                for path, run in order if r % 2 == 0 else order[::-1]:
                    started = time.perf_counter()
                    report = run(spec)
                    times[path].setdefault(task.id, []).append(time.perf_counter() - started)
                    if report.passed != report.total:
                        raise RuntimeError(f"{task.id}: the reference solution failed ({path}): {report}")
    per = {p: {t: statistics.median(v) for t, v in by.items()} for p, by in times.items()}
    out: dict[str, Any] = {}
    for p in per:
        out[f"{p}_mean_s"] = round(statistics.mean(per[p].values()), 4)
        out[f"{p}_median_s"] = round(statistics.median(per[p].values()), 4)
    ratios = sorted(((per["trusted"][t] / per["legacy"][t], t) for t in per["trusted"]), reverse=True)
    return {
        "trusted_vs_legacy_ratio": round(out["trusted_mean_s"] / out["legacy_mean_s"], 4),
        "median_ratio": round(out["trusted_median_s"] / out["legacy_median_s"], 4),
        **out,
        "tasks": len(per["trusted"]),
        "slowest_vs_legacy": [{"task": t, "ratio": round(x, 2)} for x, t in ratios[:4]],
    }


def time_instance(
    provider: LocalProvider, inst: Any, repeats: int, paths: tuple[str, ...], shards: int
) -> dict[str, Any]:
    """Median grading time of the gold patch on ``inst`` along each path (all must resolve)."""
    box = provider.create(SandboxSpec(image=inst.sandbox_image, mem_mb=2048))
    times: dict[str, list[float]] = {p: [] for p in paths}
    try:
        for r in range(repeats):
            order = paths if r % 2 == 0 else tuple(reversed(paths))
            for path in order:
                box.reset()
                started = time.perf_counter()
                out = grade(box, inst, inst.patch, shards=shards, timeout_s=600, legacy=path == "legacy")
                times[path].append(time.perf_counter() - started)
                if not out["resolved"]:
                    raise RuntimeError(
                        f"{inst.instance_id}: the gold patch did not resolve ({path}): {out['reason']}"
                    )
    finally:
        box.close()
    return {"instance_id": inst.instance_id, **{f"{p}_s": statistics.median(t) for p, t in times.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and print its table and JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the JSON only")
    ap.add_argument("--repeats", type=int, default=3, help="grades per path and instance (default 3)")
    ap.add_argument("--instances", type=int, default=0, help="the first N instances only (default all)")
    ap.add_argument("--shards", type=int, default=1, help="test shards per grade (default 1)")
    ap.add_argument("--legacy", action="store_true", help="time the legacy path alone")
    ap.add_argument("--code", action="store_true", help="also time the code env's harness")
    ap.add_argument("--code-legacy-rev", default=CODE_LEGACY_REV, help="git revision of the old harness")
    args = ap.parse_args(argv)
    paths = ("legacy",) if args.legacy else PATHS
    instances = offline_instances(None)
    if args.instances:
        instances = instances[: args.instances]
    load_before = os.getloadavg()
    provider = LocalProvider()
    try:
        rows = [time_instance(provider, inst, args.repeats, paths, args.shards) for inst in instances]
    finally:
        provider.close()
    out: dict[str, Any] = {}
    for p in paths:
        out[f"{p}_mean_s"] = round(statistics.mean(r[f"{p}_s"] for r in rows), 4)
    if "trusted" in paths:
        out = {"trusted_vs_legacy_ratio": round(out["trusted_mean_s"] / out["legacy_mean_s"], 4), **out}
    if args.code:
        out["code"] = code_figures(args.repeats, args.code_legacy_rev)
    out.update(
        instances=len(rows),
        repeats=args.repeats,
        shards=args.shards,
        per_instance=rows,
        loadavg_before=[round(x, 2) for x in load_before],
        loadavg_after=[round(x, 2) for x in os.getloadavg()],
        cpus=os.cpu_count(),
    )
    if not args.json:
        print_table(
            "Grading the gold patch (seconds per instance, median of repeats)",
            [(r["instance_id"], " / ".join(f"{p} {r[f'{p}_s']:.3f}" for p in paths)) for r in rows],
        )
    print(json.dumps(out, indent=None if args.json else 2))
    return out


if __name__ == "__main__":
    main()
