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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from benchmarks.common import print_table
from tangram_env.envs.swe_bench.grading import grade
from tangram_env.envs.swe_bench.prepare import offline_instances
from tangram_env.sandbox import SandboxSpec
from tangram_env.server.sandbox.local import LocalProvider

PATHS = ("trusted", "legacy")


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
