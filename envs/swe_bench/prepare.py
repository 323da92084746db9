"""``tangram-env prepare swe-bench``: build the offline SWE-bench task set and cache it.

For each pinned package (:mod:`.packages`): fetch its source distribution from PyPI, make a virtual
environment with pytest, run its test suite once recording which tests call which functions, then
inject bugs (:mod:`.mutate`) into covered functions. Each mutant is a one-commit git repository
holding the buggy code; the gold patch is the injection reversed. It becomes an instance when, graded
with the env's own grading code, the empty patch leaves some tests that call the mutated function
failing (FAIL_TO_PASS; the tests of those files that pass are PASS_TO_PASS) and the gold patch resolves
it. Finally each instance becomes a
sandbox image (its repository as the workspace, the package's environment read-only).

Everything lives under ``$TANGRAM_CACHE_DIR/swe-bench`` (default ``~/.cache/tangram/swe-bench``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tangram_env.envs.swe_bench.grading import PASSING, grade, run_tests
from tangram_env.envs.swe_bench.hostbox import HostBox
from tangram_env.envs.swe_bench.instance import SweBenchInstance, dump_jsonl, load_jsonl
from tangram_env.envs.swe_bench.mutate import Mutation, find_mutations, iter_covered
from tangram_env.envs.swe_bench.packages import Package, get_packages
from tangram_env.envs.swe_bench.statement import write_statement
from tangram_env.errors import TangramError

#: Bumped whenever instances would come out differently; a cache of another version is rebuilt.
GENERATOR_VERSION = 3
MAX_FAIL_TO_PASS = 40
#: Candidates screened per instance wanted, at most (a package whose mutants rarely make instances
#: stops early instead of screening hundreds).
SCREEN_FACTOR = 4
_GIT_ID = {
    "GIT_AUTHOR_NAME": "tangram",
    "GIT_AUTHOR_EMAIL": "tangram@localhost",
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+00:00",
    "GIT_COMMITTER_NAME": "tangram",
    "GIT_COMMITTER_EMAIL": "tangram@localhost",
    "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+00:00",
}
_EXCLUDES = "__pycache__/\n*.pyc\n.pytest_cache/\n*.egg-info/\n.tangram/\n"


class PrepareError(TangramError, RuntimeError):
    """The offline set could not be built (the message says which step and why)."""


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


# --- progress -------------------------------------------------------------------------------------
class Progress:
    """Where prepare reports; the default prints nothing. The CLI passes a rich progress bar."""

    def package(self, pkg: Package, target: int) -> None:
        """Work on ``pkg`` begins; it aims for ``target`` instances."""

    def stage(self, pkg: Package, text: str) -> None:
        """What is happening to ``pkg`` now."""

    def kept(self, pkg: Package, count: int, screened: int, total: int) -> None:
        """``count`` instances kept after screening ``screened`` of ``total`` candidates."""

    def done(self, pkg: Package, count: int) -> None:
        """``pkg`` is finished with ``count`` instances."""


class RichProgress(Progress):
    """A rich progress bar, one line per package."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar

        self.bar = Bar(
            TextColumn("{task.fields[name]:<12}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
        )
        self.tasks: dict[str, Any] = {}
        self.lock = threading.Lock()

    def __enter__(self) -> RichProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def package(self, pkg: Package, target: int) -> None:
        """Add the package's line."""
        with self.lock:
            self.tasks[pkg.name] = self.bar.add_task("starting", total=target, name=pkg.name)

    def stage(self, pkg: Package, text: str) -> None:
        """Show what the package is at."""
        with self.lock:
            self.bar.update(self.tasks[pkg.name], description=text)

    def kept(self, pkg: Package, count: int, screened: int, total: int) -> None:
        """Move the package's bar."""
        with self.lock:
            self.bar.update(
                self.tasks[pkg.name],
                completed=count,
                description=f"screened {screened}/{total} candidate bugs",
            )

    def done(self, pkg: Package, count: int) -> None:
        """Close the package's bar at its count."""
        with self.lock:
            task = self.tasks[pkg.name]
            self.bar.update(
                task, completed=count, total=max(count, 1), description=f"{count} instances validated"
            )


# --- steps ----------------------------------------------------------------------------------------
def _run(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None, what: str) -> str:
    done = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, check=False, env={**os.environ, **(env or {})}
    )
    if done.returncode != 0:
        raise PrepareError(
            f"{what} failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()[-2000:]}"
        )
    return done.stdout


def fetch_source(pkg: Package, cache: Path) -> Path:
    """The extracted source distribution of ``pkg`` (downloaded with pip into the cache once)."""
    dest = cache / "src" / f"{pkg.slug}-{pkg.version}"
    if (dest / ".complete").exists():
        return dest
    sdists = cache / "sdists"
    sdists.mkdir(parents=True, exist_ok=True)
    names = {pkg.name.lower(), pkg.slug.lower()}
    found = [
        p
        for p in sdists.glob("*.tar.gz")
        if p.name.lower().removesuffix(".tar.gz").rsplit("-", 1)[0] in names
        and p.name.removesuffix(".tar.gz").rsplit("-", 1)[-1] == pkg.version
    ]
    if not found:
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--disable-pip-version-check",
                "--no-deps",
                "--no-binary",
                ":all:",
                pkg.requirement,
                "-d",
                str(sdists),
            ],
            what=f"downloading {pkg.requirement}",
        )
        return fetch_source(pkg, cache) if _has_sdist(sdists, names, pkg.version) else _no_sdist(pkg)
    shutil.rmtree(dest, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=sdists, prefix=".extract-"))
    try:
        with tarfile.open(found[0]) as tar:
            tar.extractall(tmp, filter="data")
        (top,) = [p for p in tmp.iterdir() if p.is_dir()]
        dest.parent.mkdir(parents=True, exist_ok=True)
        top.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for rel in (*pkg.sources, *pkg.tests):
        if not (dest / rel).exists():
            raise PrepareError(f"{pkg.requirement}: the source distribution has no {rel}")
    (dest / ".complete").write_text(pkg.requirement)
    return dest


def _has_sdist(sdists: Path, names: set[str], version: str) -> bool:
    return any(
        p.name.lower().removesuffix(".tar.gz").rsplit("-", 1)[0] in names
        and p.name.endswith(f"-{version}.tar.gz")
        for p in sdists.glob("*.tar.gz")
    )


def _no_sdist(pkg: Package) -> Path:
    raise PrepareError(f"pip downloaded no source distribution of {pkg.requirement}")


def make_venv(pkg: Package, cache: Path) -> Path:
    """A virtual environment with ``pkg``'s test requirements (pytest), made once per package."""
    dest = cache / "venvs" / f"{pkg.slug}-{pkg.version}"
    if (dest / ".complete").exists():
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    base_python = os.path.join(sys.base_prefix, "bin", "python3")
    _run([base_python, "-m", "venv", "--without-pip", str(dest)], what=f"creating a venv for {pkg.name}")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(dest / "bin" / "python"),
            "install",
            "--disable-pip-version-check",
            "--no-input",
            "--progress-bar",
            "off",
            *pkg.requirements,
        ],
        what=f"installing {' '.join(pkg.requirements)}",
    )
    (dest / ".complete").write_text(" ".join(pkg.requirements))
    return dest


def _host_box(workspace: Path, scratch: Path, venv: Path) -> HostBox:
    path = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    return HostBox(str(workspace), str(scratch), env={"PATH": path, "VIRTUAL_ENV": str(venv)})


@dataclass
class Baseline:
    """The package's suite on pristine code: who passed, who called what, how long it took."""

    passed: set[str]
    covered: dict[tuple[str, int], set[str]]
    wall_s: float


def run_baseline(pkg: Package, src: Path, venv: Path, scratch: Path) -> Baseline:
    """Run the package's tests once on pristine code, recording each test's calls into its sources."""
    work = scratch / "baseline"
    shutil.copytree(src, work)
    box = _host_box(work, scratch / "baseline-tmp", venv)
    args = [*pkg.pytest_args, *(f"--deselect={d}" for d in pkg.deselect)]
    report = run_tests(
        box,
        list(pkg.tests),
        env={"PYTHONPATH": pkg.pythonpath},
        pytest_args=args,
        timeout_s=600,
        trace_root=str(work),
    )
    if report.get("error") or not report["tests"]:
        raise PrepareError(
            f"{pkg.requirement}: the baseline test run failed: {report.get('error', 'no tests ran')}"
        )
    passed = {t for t, r in report["tests"].items() if r["status"] == "PASSED"}
    sources = set(pkg.sources)
    covered: dict[tuple[str, int], set[str]] = {}
    for test, rec in report["tests"].items():
        if test in passed:
            for path, line, _name in rec.get("calls", []):
                if path in sources:
                    covered.setdefault((path, line), set()).add(test)
    shutil.rmtree(work, ignore_errors=True)
    return Baseline(passed, covered, float(report.get("wall_s", 0.0)))


def order_candidates(
    pkg: Package, src: Path, covered: dict[tuple[str, int], set[str]]
) -> list[tuple[Mutation, set[str]]]:
    """Covered mutations in a reproducible order that spreads operators and functions: operators take
    turns, and every function's first mutant comes before any function's second.
    """
    rng = random.Random(f"{pkg.name}=={pkg.version}/{GENERATOR_VERSION}")
    found: list[tuple[Mutation, set[str]]] = []
    for rel in pkg.sources:
        found.extend(iter_covered(find_mutations(rel, (src / rel).read_bytes()), covered))
    by_op: dict[str, list[tuple[Mutation, set[str]]]] = {}
    for item in found:
        by_op.setdefault(item[0].operator, []).append(item)
    for items in by_op.values():
        rng.shuffle(items)
    interleaved = []
    queues = [by_op[k] for k in sorted(by_op)]
    while any(queues):
        for q in queues:
            if q:
                interleaved.append(q.pop())
    seen: set[tuple[str, str]] = set()
    first: list[tuple[Mutation, set[str]]] = []
    rest: list[tuple[Mutation, set[str]]] = []
    for item in interleaved:
        key = (item[0].path, item[0].function)
        (rest if key in seen else first).append(item)
        seen.add(key)
    return first + rest


def instance_id(pkg: Package, mutation: Mutation) -> str:
    """``owner__name-NNNNN``, a number from the mutation's key (stable across subsets and runs)."""
    owner, name = pkg.repo.split("/")
    return f"{owner}__{name}-{zlib.crc32(f'{pkg.requirement}:{mutation.key}'.encode()) % 100000:05d}"


def make_repo(src: Path, dest: Path, mutation: Mutation) -> tuple[str, str]:
    """A one-commit git repository at ``dest`` holding ``src`` with ``mutation`` applied; returns the
    commit and the gold patch (the injection reversed).
    """
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".complete", "__pycache__", ".pytest_cache"))
    target = dest / mutation.path
    original = target.read_bytes()
    target.write_bytes(mutation.apply(original))
    env = dict(_GIT_ID)
    _run(["git", "init", "-q", "-b", "main"], cwd=dest, what="git init")
    (dest / ".git" / "info").mkdir(exist_ok=True)
    (dest / ".git" / "info" / "exclude").write_text(_EXCLUDES)
    # -f: sdists often ship files their .gitignore names (a generated version.py), and the tree must be whole
    _run(["git", "add", "-A", "-f"], cwd=dest, env=env, what="git add")
    _run(
        ["git", "-c", "commit.gpgsign=false", "commit", "-q", "-m", "Import the source release"],
        cwd=dest,
        env=env,
        what="git commit",
    )
    commit = _run(["git", "rev-parse", "HEAD"], cwd=dest, what="git rev-parse").strip()
    target.write_bytes(original)
    gold = _run(["git", "diff", "--no-color", "--no-ext-diff"], cwd=dest, what="git diff")
    _run(["git", "checkout", "-q", "--", mutation.path], cwd=dest, what="git checkout")
    return commit, gold


@dataclass
class _Job:
    pkg: Package
    src: Path
    venv: Path
    scratch: Path
    baseline: Baseline
    repos: Path
    timeout_s: float


def screen(job: _Job, mutation: Mutation, covering: set[str]) -> SweBenchInstance | None:
    """Try one mutant: the instance it makes, validated, or None if it makes none.

    The mutant's repository is graded twice with the env's own grading. With no patch, over every
    test of the files whose tests call the mutated function: the covering tests that fail are
    FAIL_TO_PASS, the tests that pass are PASS_TO_PASS (so the empty patch leaves the first failing and
    the second passing by construction). Then with the gold patch, which must resolve it.
    """
    pkg = job.pkg
    files = {t.split("::", 1)[0] for t in covering}
    suite = sorted(t for t in job.baseline.passed if t.split("::", 1)[0] in files)
    covered = sorted(covering & job.baseline.passed)
    if not covered:
        return None
    iid = instance_id(pkg, mutation)
    staging = Path(tempfile.mkdtemp(dir=job.scratch, prefix=f"{iid}-"))
    try:
        repo = staging / "repo"
        commit, gold = make_repo(job.src, repo, mutation)
        draft = SweBenchInstance(
            instance_id=iid,
            repo=pkg.repo,
            base_commit=commit,
            problem_statement="(to be written)",
            patch=gold,
            FAIL_TO_PASS=covered,
            PASS_TO_PASS=[t for t in suite if t not in covering],
            version=pkg.version,
            environment_setup_commit=commit,
            image=image_name(iid),
            test_env={"PYTHONPATH": pkg.pythonpath},
            pytest_args=list(pkg.pytest_args),
        )
        empty = grade(_host_box(repo, staging / "empty-tmp", job.venv), draft, None, timeout_s=job.timeout_s)
        # Whatever the run left in the tree (tests that write files) must not reach the image.
        _run(["git", "clean", "-fdqx"], cwd=repo, what="git clean")
        _run(["git", "checkout", "-q", "--", "."], cwd=repo, what="git checkout")
        if empty.get("error") or empty.get("timed_out"):
            return None  # a mutant that hangs the suite makes a poor task
        statuses = empty["statuses"]
        f2p = [t for t in covered if statuses.get(t) not in PASSING]
        if not f2p or len(f2p) > MAX_FAIL_TO_PASS:
            return None
        # A failing test that never calls the mutated code is flaky, not evidence: it goes nowhere.
        draft.FAIL_TO_PASS = f2p
        draft.PASS_TO_PASS = [t for t in suite if statuses.get(t) in PASSING]
        gold_run = grade(_clone_box(job, repo, staging / "gold"), draft, gold, timeout_s=job.timeout_s)
        if not gold_run["resolved"]:
            return None
        seed = zlib.crc32(iid.encode())
        draft.problem_statement = write_statement(pkg.name, pkg.version, f2p, empty["messages"], seed=seed)
        final = job.repos / iid
        shutil.rmtree(final, ignore_errors=True)
        final.parent.mkdir(parents=True, exist_ok=True)
        repo.rename(final)
        return SweBenchInstance.model_validate(draft.model_dump())
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _clone_box(job: _Job, repo: Path, dest: Path) -> HostBox:
    _run(["git", "clone", "-q", "--no-hardlinks", str(repo), str(dest)], what="git clone")
    (dest / ".git" / "info" / "exclude").write_text(_EXCLUDES)
    return _host_box(dest, dest.parent / f"{dest.name}-tmp", job.venv)


def image_name(iid: str) -> str:
    """The sandbox image of instance ``iid``."""
    return f"swe-bench.{iid}"[:64]


def _in_order(
    pool: ThreadPoolExecutor, fn: Callable[..., Any], items: list[Any], window: int
) -> Iterator[Any]:
    """``fn(*item)`` for each item, at most ``window`` running ahead, results in item order (closing
    the iterator cancels what has not started).
    """
    pending: list[Future[Any]] = []
    it = iter(items)
    try:
        for item in it:
            pending.append(pool.submit(fn, *item))
            if len(pending) >= window:
                break
        while pending:
            result = pending.pop(0).result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(pool.submit(fn, *nxt))
            yield result
    finally:
        for f in pending:
            f.cancel()


def _config_key(pkg: Package) -> str:
    """A digest of how ``pkg`` is prepared: a package whose settings changed is prepared again."""
    return f"{zlib.crc32(repr(pkg).encode()):08x}"


def prepare_package(
    pkg: Package, target: int, cache: Path, jobs: int, progress: Progress
) -> list[SweBenchInstance]:
    """Build up to ``target`` validated instances of ``pkg`` (or fewer if its mutants run out)."""
    out_dir = cache / "packages" / f"{pkg.slug}-{pkg.version}"
    manifest = out_dir / "manifest.json"
    if manifest.exists():
        meta = json.loads(manifest.read_text())
        same = meta.get("generator") == GENERATOR_VERSION and meta.get("config") == _config_key(pkg)
        if same and (meta["target"] >= target or meta["exhausted"]):
            instances = load_jsonl(out_dir / "instances.jsonl") if meta["count"] else []
            progress.done(pkg, min(len(instances), target))
            return instances[:target]
    for stale in (manifest, out_dir / "instances.jsonl"):  # never left pointing at repositories being rebuilt
        stale.unlink(missing_ok=True)
    progress.stage(pkg, "downloading the source distribution")
    src = fetch_source(pkg, cache)
    progress.stage(pkg, "making its environment")
    venv = make_venv(pkg, cache)
    scratch = Path(tempfile.mkdtemp(prefix=f"tangram-swe-{pkg.slug}-"))
    try:
        progress.stage(pkg, "running its test suite")
        baseline = run_baseline(pkg, src, venv, scratch)
        candidates = order_candidates(pkg, src, baseline.covered)[: target * SCREEN_FACTOR]
        job = _Job(
            pkg,
            src,
            venv,
            scratch,
            baseline,
            out_dir / "repos",
            # A mutant that loops forever is dropped at a few times the suite's own duration.
            timeout_s=max(20.0, baseline.wall_s * 3 + 10),
        )
        shutil.rmtree(job.repos, ignore_errors=True)
        kept: list[SweBenchInstance] = []
        functions: set[tuple[str, str]] = set()
        progress.kept(pkg, 0, 0, len(candidates))
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            results = _in_order(pool, screen, [(job, m, t) for m, t in candidates], window=jobs)
            screened = 0
            for (mutation, _tests), inst in zip(candidates, results, strict=False):
                screened += 1
                key = (mutation.path, mutation.function)
                if inst is not None and key not in functions:
                    kept.append(inst)
                    functions.add(key)
                elif inst is not None:
                    shutil.rmtree(job.repos / inst.instance_id, ignore_errors=True)
                progress.kept(pkg, len(kept), screened, len(candidates))
                if len(kept) >= target:
                    break
            results.close()  # type: ignore[attr-defined]
        ids = {i.instance_id for i in kept}
        for leftover in job.repos.glob("*") if job.repos.exists() else []:
            if leftover.name not in ids:  # validated by a screen still running when the target was met
                shutil.rmtree(leftover, ignore_errors=True)
        exhausted = len(kept) < target
        out_dir.mkdir(parents=True, exist_ok=True)
        kept.sort(key=lambda i: i.instance_id)
        if kept:
            dump_jsonl(kept, out_dir / "instances.jsonl")
        manifest.write_text(
            json.dumps(
                {
                    "generator": GENERATOR_VERSION,
                    "config": _config_key(pkg),
                    "package": pkg.requirement,
                    "target": target,
                    "count": len(kept),
                    "exhausted": exhausted,
                    "screened": screened,
                    "candidates": len(candidates),
                },
                indent=2,
            )
        )
        progress.done(pkg, len(kept))
        return kept
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


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
    from tangram_env.server.sandbox.images import build_image, get_image

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
    head = Path(workspace, ".git", "refs", "heads", "main")
    return head.is_file() and head.read_text().strip() == inst.base_commit


def _package_dir(cache: Path, inst: SweBenchInstance) -> Path:
    for pkg in get_packages():
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
    progress: Progress | None = None,
) -> PrepareReport:
    """Build the offline set (every package, or those named), at most ``limit`` instances in all
    (spread evenly over the packages), validating ``jobs`` mutants at a time; cached, so a second
    run only reads. Writes ``instances.jsonl`` with every instance prepared so far.
    """
    started = time.monotonic()
    cache = cache_root(cache_dir)
    chosen = get_packages(packages)
    if limit is not None and limit < 1:
        raise ValueError("limit must be at least 1")
    jobs = jobs or max(1, min(4, (os.cpu_count() or 2)))
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
        _write_index(cache)
    return PrepareReport(made, counts, built, time.monotonic() - started, instances_file(cache))


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
    try:  # images removed since (or a new image root): rebuilt from the cached repositories
        build_images(instances, cache_root(cache_dir), image_root=image_root)
    except ImportError:  # a client without the server package: the orchestrator's host has the images
        pass
    return instances


def prepare_main(argv: list[str]) -> int:
    """``tangram-env prepare swe-bench [--packages A,B] [--limit N] [--jobs J] [--cache-dir DIR]
    [--force] [--no-images] [--json]``.
    """
    parser = argparse.ArgumentParser(
        prog="tangram-env prepare swe-bench", description="Build and cache the offline SWE-bench task set."
    )
    parser.add_argument("--packages", default="", help="comma-separated package names (default: all)")
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
    parser.add_argument("--list", action="store_true", help="list the pinned packages and exit")
    parser.add_argument("--json", action="store_true", help="print a JSON summary last")
    args = parser.parse_args(argv)
    if args.list:
        for pkg in get_packages():
            print(f"{pkg.requirement:<22} {pkg.repo:<30} up to {pkg.max_instances} instances")
        return 0
    names = [n.strip() for n in args.packages.split(",") if n.strip()]
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
                progress=bar,
            )
    except (PrepareError, KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"validated {len(result.instances)} instances from {len(result.per_package)} packages "
        f"({', '.join(f'{k}: {v}' for k, v in result.per_package.items())}) in {result.wall_s:.0f} s; "
        f"{result.images_built} images built; set at {result.path}"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "validated": len(result.instances),
                    "per_package": result.per_package,
                    "images_built": result.images_built,
                    "wall_s": round(result.wall_s, 1),
                    "path": str(result.path),
                }
            )
        )
    return 0
