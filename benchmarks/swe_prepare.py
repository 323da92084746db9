"""Preparing the offline SWE-bench set from SWE-bench's own repositories, and grading it.

``python -m benchmarks.swe_prepare [--repos django,sympy,flask,requests,pytest] [--limit 2]
[--cores 1,2,4] [--cache-dir DIR] [--docker] [--json]``

For each repository, from an empty cache of its own (the source release is downloaded once into
``--sdists``, default ``~/.cache/tangram/swe-bench/sdists``, and copied from there): the time to
prepare ``--limit`` instances (environment, baseline run, bug injection, double validation, sandbox
images) and the disk the cache then holds; then the time to grade each instance's gold patch in a
fresh local sandbox with the grader granted 1, 2 and 4 cores (what ``swe_bench.grade`` does when the
scheduler grants it that many). With ``--docker``, also the time to build the instances' Docker images
from scratch (environment and instance layers, no cached layer reused, each validated in a container),
the size of an instance image, and the time to grade each gold patch in a container on one core.
Prints a table and, last, one JSON object: ``per_repo`` (``prepare_s``, ``disk_mb``, ``instances``,
``grade_s`` by cores, ``resolved``; with ``--docker`` ``docker_build_s``, ``docker_image_mb``,
``docker_grade_s``, ``docker_resolved``), ``cpus`` and ``load``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from tangram_env.envs.swe_bench.grading import grade
from tangram_env.envs.swe_bench.packages import SWE_BENCH_PACKAGES, packages_of_repos
from tangram_env.envs.swe_bench.prepare import cache_root, prepare
from tangram_env.envs.swe_bench.runners import runner_for


def disk_mb(path: Path) -> float:
    """What the files under ``path`` take on disk, in MiB."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total / 2**20


def grade_times(instances: list[Any], image_root: Path, cores: list[int]) -> tuple[dict[str, float], bool]:
    """Mean wall time of grading each instance's gold patch at each core count; whether all resolved."""
    from tangram_env.sandbox import SandboxSpec
    from tangram_env.server.sandbox.local import LocalProvider

    provider = LocalProvider(image_dir=str(image_root))
    cpus = os.cpu_count() or 1
    times: dict[str, float] = {}
    resolved = True
    try:
        for k in cores:
            spent = []
            for inst in instances:
                box = provider.create(SandboxSpec(image=inst.sandbox_image, mem_mb=4096))
                try:
                    started = time.monotonic()
                    out = grade(
                        box, inst, inst.patch, shards=k, cores=tuple(range(min(k, cpus))), timeout_s=900
                    )
                    spent.append(time.monotonic() - started)
                    resolved = resolved and bool(out["resolved"])
                finally:
                    box.close()
            times[str(k)] = round(sum(spent) / len(spent), 2)
    finally:
        provider.close()
    return times, resolved


def docker_figures(instances: list[Any], cache: Path) -> dict[str, Any]:
    """Build the instances' Docker images from scratch, then grade each gold patch in a container."""
    import docker

    from tangram_env.docker_build import docker_image_for
    from tangram_env.envs.swe_bench.docker_images import build_docker_images
    from tangram_env.envs.swe_bench.packages import ALL_PACKAGES
    from tangram_env.sandbox import SandboxSpec
    from tangram_env.server.sandbox.docker import DockerProvider

    by_release = {(p.repo, p.version): p for p in ALL_PACKAGES}
    started = time.monotonic()
    build_docker_images(instances, cache, by_release, force=True)
    build_s = time.monotonic() - started
    size = docker.from_env().images.get(docker_image_for(instances[0].sandbox_image)).attrs["Size"]
    provider = DockerProvider(sweep=False)
    spent, resolved = [], True
    try:
        for inst in instances:
            box = provider.create(SandboxSpec(image=inst.sandbox_image, mem_mb=4096))
            try:
                started = time.monotonic()
                out = grade(box, inst, inst.patch, shards=1, cores=(0,), timeout_s=900)
                spent.append(time.monotonic() - started)
                resolved = resolved and bool(out["resolved"])
            finally:
                box.close()
    finally:
        provider.close()
    return {
        "docker_build_s": round(build_s, 1),
        "docker_image_mb": round(size / 2**20, 1),
        "docker_grade_s": round(sum(spent) / len(spent), 2),
        "docker_resolved": resolved,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; the JSON summary."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.swe_prepare", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--repos", default=",".join(p.repo for p in SWE_BENCH_PACKAGES))
    parser.add_argument("--limit", type=int, default=2, help="instances per repository")
    parser.add_argument("--cores", default="1,2,4", help="core counts to grade at")
    parser.add_argument("--jobs", type=int, default=2, help="mutants validated at once while preparing")
    parser.add_argument(
        "--cache-dir", default=None, help="where the per-repository caches go (default: a temp dir)"
    )
    parser.add_argument("--sdists", default=str(cache_root() / "sdists"), help="downloaded source releases")
    parser.add_argument(
        "--docker", action="store_true", help="also build and grade the Docker images (needs an engine)"
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON")
    args = parser.parse_args(argv)
    cores = [int(c) for c in args.cores.split(",") if c.strip()]
    base = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="tangram-swe-prepare-"))
    sdists = Path(args.sdists)
    per_repo: dict[str, Any] = {}
    for pkg in packages_of_repos([r.strip() for r in args.repos.split(",") if r.strip()]):
        cache = base / pkg.slug
        shutil.rmtree(cache, ignore_errors=True)
        (cache / "sdists").mkdir(parents=True)
        for sdist in sdists.glob("*.tar.gz") if sdists.is_dir() else []:
            if sdist.name.lower().startswith(pkg.slug.lower() + "-" + pkg.version):
                shutil.copy(sdist, cache / "sdists")
        images = cache / "images"
        started = time.monotonic()
        report = prepare([pkg.name], limit=args.limit, jobs=args.jobs, cache_dir=cache, image_root=images)
        prepare_s = time.monotonic() - started
        for sdist in (cache / "sdists").glob("*.tar.gz"):  # keep the download for the next run
            sdists.mkdir(parents=True, exist_ok=True)
            if not (sdists / sdist.name).exists():
                shutil.copy(sdist, sdists)
        times, resolved = grade_times(report.instances, images, cores)
        per_repo[pkg.repo] = {
            "package": pkg.requirement,
            "runner": runner_for(report.instances[0]).name,
            "instances": len(report.instances),
            "prepare_s": round(prepare_s, 1),
            "disk_mb": round(disk_mb(cache), 1),
            "grade_s": times,
            "resolved": resolved,
        }
        if args.docker:
            per_repo[pkg.repo].update(docker_figures(report.instances, cache))
        if not args.json:
            row = per_repo[pkg.repo]
            grades = "  ".join(f"{k} core{'s' if k != '1' else ''}: {v:.1f} s" for k, v in times.items())
            print(
                f"{pkg.repo:<20} {row['runner']:<15} {row['instances']} inst  "
                f"prepare {row['prepare_s']:>6.1f} s  disk {row['disk_mb']:>6.0f} MiB  "
                f"grade (gold) {grades}  resolved: {resolved}",
                flush=True,
            )
            if args.docker:
                print(
                    f"{'':<20} docker: build {row['docker_build_s']:>6.1f} s  image "
                    f"{row['docker_image_mb']:>6.0f} MiB  grade (gold, 1 core) "
                    f"{row['docker_grade_s']:.1f} s  resolved: {row['docker_resolved']}",
                    flush=True,
                )
    if not args.cache_dir:
        shutil.rmtree(base, ignore_errors=True)
    summary = {
        "per_repo": per_repo,
        "prepare_s_total": round(sum(r["prepare_s"] for r in per_repo.values()), 1),
        "disk_mb_total": round(sum(r["disk_mb"] for r in per_repo.values()), 1),
        "cpus": os.cpu_count(),
        "load": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
