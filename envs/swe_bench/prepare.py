"""``tangram-env prepare swe-bench``: build the offline SWE-bench task set and cache it.

For each pinned package (:mod:`.packages`) :mod:`.generate` makes validated instances from its PyPI
source release; then each instance becomes a sandbox image (its repository as the workspace, the
package's environment read-only), with ``--docker`` a Docker image laid out as SWE-bench's as well
(:mod:`.docker_images`), and ``instances.jsonl`` lists the whole cached set.

Everything lives under ``$TANGRAM_CACHE_DIR/swe-bench`` (default ``~/.cache/tangram/swe-bench``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tangram_env.envs.swe_bench.generate import (
    GENERATOR_VERSION,
    PrepareError,
    package_probe,
    prepare_package,
)
from tangram_env.envs.swe_bench.instance import SweBenchInstance, dump_jsonl, load_jsonl
from tangram_env.envs.swe_bench.packages import (
    ALL_PACKAGES,
    SWE_BENCH_PACKAGES,
    get_packages,
    packages_of_repos,
)
from tangram_env.envs.swe_bench.progress import Progress, RichProgress
from tangram_env.envs.swe_bench.runners import runner_for

__all__ = [
    "GENERATOR_VERSION",
    "PrepareError",
    "PrepareReport",
    "build_images",
    "cache_root",
    "gitconfig_file",
    "instances_file",
    "offline_instances",
    "prepare",
    "prepare_main",
]


def cache_root(path: str | os.PathLike[str] | None = None) -> Path:
    """Where the offline set lives: ``path``, else ``$TANGRAM_CACHE_DIR/swe-bench``, else
    ``~/.cache/tangram/swe-bench``.
    """
    if path is not None:
        return Path(path).expanduser()
    base = os.environ.get("TANGRAM_CACHE_DIR")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "tangram") / "swe-bench"


def instances_file(cache: str | os.PathLike[str] | None = None) -> Path:
    """The JSONL file of every prepared instance."""
    return cache_root(cache) / "instances.jsonl"


# --- images ---------------------------------------------------------------------------------------
def gitconfig_file(cache: Path) -> Path:
    """A git configuration every sandbox of the set uses: the repository belongs to another user
    there, which git refuses unless told the directory is safe.
    """
    path = cache / "gitconfig"
    text = (
        "[safe]\n\tdirectory = *\n[user]\n\tname = agent\n\temail = agent@localhost\n[core]\n\tpager = cat\n"
    )
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path


def build_images(
    instances: list[SweBenchInstance],
    cache: Path,
    progress: Progress | None = None,
    image_root: str | os.PathLike[str] | None = None,
    force: bool = False,
) -> int:
    """Make (or keep) each instance's sandbox image: its repository as the workspace and its package's
    environment read-only. Returns how many were built.
    """
    from tangram_env.images import build_image, get_image

    gitconfig = gitconfig_file(cache)
    built = 0
    for inst in instances:
        pkg_dir = _package_dir(cache, inst)
        repo = pkg_dir / "repos" / inst.instance_id
        venv = cache / "venvs" / pkg_dir.name
        if not repo.is_dir() or not venv.is_dir():
            raise PrepareError(
                f"{inst.instance_id}: its repository or environment is missing from {cache}; "
                "run `tangram-env prepare swe-bench --force`"
            )
        if not force:
            try:
                image = get_image(inst.sandbox_image, image_root)
                if (
                    image.workspace
                    and Path(image.workspace, ".git").is_dir()
                    and _same_commit(image.workspace, inst)
                    and image.python == str(venv)  # not an image another cache built under this name
                    and not image.missing_paths()  # nor one whose environment was removed since
                ):
                    continue
            except KeyError:
                pass
        build_image(
            inst.sandbox_image,
            from_dir=repo,
            python_env=venv,
            root=image_root,
            env={"GIT_CONFIG_GLOBAL": str(gitconfig), "PYTHONDONTWRITEBYTECODE": "1"},
            read_only=[str(gitconfig)],
        )
        built += 1
    return built


def _same_commit(workspace: str, inst: SweBenchInstance) -> bool:
    """Whether the image's ``main`` is the instance's base commit (a loose ref, or packed: a large
    repository's prepare runs ``git gc``, which packs it; a miss rebuilt the image on every make).
    """
    git = Path(workspace, ".git")
    head = git / "refs" / "heads" / "main"
    if head.is_file():
        return head.read_text().strip() == inst.base_commit
    packed = git / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            commit, _, ref = line.partition(" ")
            if ref == "refs/heads/main":
                return commit == inst.base_commit
    return False


def _package_dir(cache: Path, inst: SweBenchInstance) -> Path:
    for pkg in ALL_PACKAGES:
        if pkg.repo == inst.repo and pkg.version == inst.version:
            return cache / "packages" / f"{pkg.slug}-{pkg.version}"
    raise PrepareError(f"{inst.instance_id}: not an instance of the offline set")


# --- the whole set --------------------------------------------------------------------------------
@dataclass
class PrepareReport:
    """What a prepare run produced."""

    instances: list[SweBenchInstance]
    per_package: dict[str, int]
    images_built: int
    docker_images_built: int
    wall_s: float
    path: Path


def prepare(
    packages: list[str] | None = None,
    *,
    limit: int | None = None,
    jobs: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
    images: bool = True,
    image_root: str | os.PathLike[str] | None = None,
    docker: bool = False,
    progress: Progress | None = None,
) -> PrepareReport:
    """Build the offline set (every package, or those named), at most ``limit`` instances in all
    (spread evenly over the packages), validating ``jobs`` mutants at a time; cached, so a second
    run only reads. ``docker``: build their Docker images too. Writes ``instances.jsonl`` with every
    instance prepared so far.
    """
    started = time.monotonic()
    cache = cache_root(cache_dir)
    chosen = get_packages(packages)
    if limit is not None and limit < 1:
        raise ValueError("limit must be at least 1")
    if jobs is not None and jobs < 1:  # 0 used to mean the default, silently
        raise ValueError("jobs must be at least 1")
    if jobs is None:
        jobs = max(1, min(4, (os.cpu_count() or 2)))
    report = progress or Progress()
    if force:
        for pkg in chosen:
            shutil.rmtree(cache / "packages" / f"{pkg.slug}-{pkg.version}", ignore_errors=True)
    per_target = {p.name: p.max_instances for p in chosen}
    if limit is not None:
        share = math.ceil(limit / len(chosen))
        per_target = {p.name: min(p.max_instances, share) for p in chosen}
    made: list[SweBenchInstance] = []
    counts: dict[str, int] = {}
    with _cache_lock(cache):
        for pkg in chosen:
            report.package(pkg, per_target[pkg.name])
            insts = prepare_package(pkg, per_target[pkg.name], cache, jobs, report)
            made.extend(insts)
            counts[pkg.name] = len(insts)
        if limit is not None:
            made = made[:limit]
        if not made:
            raise PrepareError("no instance could be validated")
        built = build_images(made, cache, report, image_root=image_root, force=force) if images else 0
        docker_built = 0
        if docker:
            from tangram_env.envs.swe_bench.docker_images import build_docker_images

            by_release = {(p.repo, p.version): p for p in ALL_PACKAGES}
            docker_built = build_docker_images(made, cache, by_release, report, force=force)
        _write_index(cache)
    return PrepareReport(made, counts, built, docker_built, time.monotonic() - started, instances_file(cache))


@contextlib.contextmanager
def _cache_lock(cache: Path) -> Iterator[None]:
    """One prepare at a time per cache (a second one waits, then finds the work done)."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_index(cache: Path) -> None:
    """``instances.jsonl``: every package's instances, so users load the whole cached set."""
    everything: list[SweBenchInstance] = []
    for path in sorted((cache / "packages").glob("*/instances.jsonl")):
        everything.extend(load_jsonl(path))
    if everything:
        tmp = cache / ".instances.jsonl.tmp"
        dump_jsonl(everything, tmp)
        os.replace(tmp, instances_file(cache))


def offline_instances(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    auto_prepare: bool = True,
    image_root: str | os.PathLike[str] | None = None,
) -> list[SweBenchInstance]:
    """The cached offline set; prepared first (with a progress bar) if it is missing and
    ``auto_prepare``, else :class:`PrepareError` saying how to make it.
    """
    path = instances_file(cache_dir)
    if not path.exists():
        if not auto_prepare:
            raise PrepareError(
                f"the offline SWE-bench set is not prepared ({path} is missing): "
                "run `tangram-env prepare swe-bench`"
            )
        print("tangram: preparing the offline SWE-bench set (first use; cached afterwards)", file=sys.stderr)
        with RichProgress() as bar:
            prepare(cache_dir=cache_dir, image_root=image_root, progress=bar)
        return load_jsonl(path)
    instances = load_jsonl(path)
    # Every package prepare knows, not only the default set: ``--repos django,sympy`` prepares these.
    packages = {(pkg.repo, pkg.version) for pkg in ALL_PACKAGES}
    known = [inst for inst in instances if (inst.repo, inst.version) in packages]
    if len(known) < len(instances):  # a cache shared with another version of Tangram: use what is ours
        print(
            f"tangram: {len(instances) - len(known)} instance(s) in {path} come from packages this version "
            "does not know; they are left out",
            file=sys.stderr,
        )
        instances = known
    try:  # images removed since (or a new image root): rebuilt from the cached repositories
        build_images(instances, cache_root(cache_dir), image_root=image_root)
    except ImportError:  # a client without the server package: the orchestrator's host has the images
        pass
    return instances


def prepare_main(argv: list[str]) -> int:
    """``tangram-env prepare swe-bench [--packages A,B] [--repos R,S] [--limit N] [--jobs J]
    [--cache-dir DIR] [--force] [--no-images] [--docker] [--json]``.
    """
    parser = argparse.ArgumentParser(
        prog="tangram-env prepare swe-bench", description="Build and cache the offline SWE-bench task set."
    )
    parser.add_argument(
        "--packages", default=None, help="comma-separated package names (default: the small fast set)"
    )
    parser.add_argument(
        "--repos",
        default=None,
        help="comma-separated repositories (django/django or django; 'swe-bench': all of SWE-bench's)",
    )
    parser.add_argument("--limit", type=int, default=None, help="at most this many instances in all")
    parser.add_argument(
        "--jobs", type=int, default=None, help="mutants validated at once (default: cores, max 4)"
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="default: $TANGRAM_CACHE_DIR/swe-bench or ~/.cache/tangram/swe-bench",
    )
    parser.add_argument(
        "--image-dir", default=None, help="where sandbox images go (default: $TANGRAM_IMAGE_DIR)"
    )
    parser.add_argument("--force", action="store_true", help="rebuild the chosen packages from scratch")
    parser.add_argument("--no-images", action="store_true", help="skip building the sandbox images")
    parser.add_argument(
        "--docker",
        action="store_true",
        help="also build each instance's Docker image (SWE-bench's layout: /testbed; needs a Docker engine "
        "and tangram/default)",
    )
    parser.add_argument("--list", action="store_true", help="list the pinned packages and exit")
    parser.add_argument("--json", action="store_true", help="print a JSON summary last")
    args = parser.parse_args(argv)
    if args.list:
        for pkg in ALL_PACKAGES:
            runner = runner_for(package_probe(pkg, pkg.slug)).name  # its repository's, where it has one
            print(f"{pkg.requirement:<22} {pkg.repo:<30} {runner:<14} up to {pkg.max_instances} instances")
        return 0
    names = [n.strip() for n in (args.packages or "").split(",") if n.strip()]
    repos = [r.strip() for r in (args.repos or "").split(",") if r.strip()]
    # Given but naming nothing (``--repos ''``): an error, not the default set.
    for flag, given, listed in (("--packages", args.packages, names), ("--repos", args.repos, repos)):
        if given is not None and not listed:
            print(f"error: {flag} names no package or repository", file=sys.stderr)
            return 1
    try:
        if "swe-bench" in repos:
            repos = [r for r in repos if r != "swe-bench"] + [p.repo for p in SWE_BENCH_PACKAGES]
        names += [p.name for p in packages_of_repos(repos) if p.name not in names]
    except KeyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        with RichProgress() as bar:
            result = prepare(
                names or None,
                limit=args.limit,
                jobs=args.jobs,
                cache_dir=args.cache_dir,
                force=args.force,
                images=not args.no_images,
                image_root=args.image_dir,
                docker=args.docker,
                progress=bar,
            )
    except (PrepareError, KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"validated {len(result.instances)} instances from {len(result.per_package)} packages "
        f"({', '.join(f'{k}: {v}' for k, v in result.per_package.items())}) in {result.wall_s:.0f} s; "
        f"{result.images_built} images built"
        + (f", {result.docker_images_built} Docker images built" if args.docker else "")
        + f"; set at {result.path}"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "validated": len(result.instances),
                    "per_package": result.per_package,
                    "images_built": result.images_built,
                    "docker_images_built": result.docker_images_built,
                    "wall_s": round(result.wall_s, 1),
                    "path": str(result.path),
                }
            )
        )
    return 0
