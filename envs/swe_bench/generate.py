"""Making the instances of one package: fetch its source release, make its environment, run its
suite once recording which tests call which functions, inject bugs into covered functions, and keep
the mutants that grading validates.

A mutant is a one-commit git repository holding the buggy code; the gold patch is the injection
reversed. It becomes an instance when, graded with the env's own grading code, the empty patch leaves
some tests that call the mutated function failing (FAIL_TO_PASS; the tests of those files that pass
are PASS_TO_PASS) and the gold patch resolves it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from tangram_env.envs.swe_bench.grading import PASSING, grade, run_tests
from tangram_env.envs.swe_bench.hostbox import HostBox
from tangram_env.envs.swe_bench.instance import SweBenchInstance, dump_jsonl, load_jsonl
from tangram_env.envs.swe_bench.mutate import Mutation, find_mutations, iter_covered
from tangram_env.envs.swe_bench.packages import Package
from tangram_env.envs.swe_bench.progress import Progress
from tangram_env.envs.swe_bench.runners import runner_for
from tangram_env.envs.swe_bench.statement import write_statement
from tangram_env.errors import TangramError

#: Bumped whenever instances would come out differently; a cache of another version is rebuilt.
GENERATOR_VERSION = 4
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
    for rel in (*pkg.sources, *pkg.test_paths):
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


def runner_fields(pkg: Package) -> dict[str, Any]:
    """The fields of ``pkg``'s instances that say how their tests run."""
    # A fixed hash seed: set orders, and so some failures and messages, repeat from run to run.
    env = {"PYTHONPATH": pkg.pythonpath, "PYTHONHASHSEED": "0", **dict(pkg.test_env)}
    if pkg.runner == "pytest":
        return {"test_env": env, "pytest_args": list(pkg.pytest_args)}
    return {
        "test_env": env,
        "runner": pkg.runner,
        "test_command": pkg.test_command,
        "test_directives": list(pkg.tests),
        "pytest_args": list(pkg.pytest_args),
    }


def package_probe(pkg: Package, instance_id: str) -> SweBenchInstance:
    """An instance of ``pkg`` carrying only what says how its tests run (for :func:`runner_for`)."""
    return SweBenchInstance.model_construct(
        instance_id=instance_id, repo=pkg.repo, FAIL_TO_PASS=[], PASS_TO_PASS=[], **runner_fields(pkg)
    )


def run_baseline(pkg: Package, src: Path, venv: Path, scratch: Path) -> Baseline:
    """Run the package's tests once on pristine code, recording each test's calls into its sources."""
    if pkg.runner != "pytest":
        return run_logged_baseline(pkg, src, venv, scratch)
    work = scratch / "baseline"
    shutil.copytree(src, work)
    box = _host_box(work, scratch / "baseline-tmp", venv)
    args = [*pkg.pytest_args, *(f"--deselect={d}" for d in pkg.deselect)]
    report = run_tests(
        box,
        list(pkg.tests),
        env=runner_fields(pkg)["test_env"],
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


def run_logged_baseline(pkg: Package, src: Path, venv: Path, scratch: Path) -> Baseline:
    """The baseline of a package whose tests run by their own runner (django, sympy): one traced run
    of the runner; every function it called counts as called by each test that passed (the runner
    does not say which test called what; screening finds out which tests a mutant fails).
    """
    work = scratch / "baseline"
    shutil.copytree(src, work)
    (scratch / "baseline-tmp").mkdir(parents=True, exist_ok=True)
    box = _host_box(work, scratch / "baseline-tmp", venv)
    tracer, calls = scratch / "trace_run.py", scratch / "calls.json"
    tracer.write_text(
        (resources.files("tangram_env.envs.swe_bench") / "trace_run.py").read_text(encoding="utf-8")
    )
    probe = package_probe(pkg, f"{pkg.slug}-baseline")
    runner = runner_for(probe)
    traced = f"python {shlex.quote(str(tracer))} {shlex.quote(str(calls))} {shlex.quote(str(work))}"
    cmd = runner.command_line(probe, python=traced)
    res = box.exec(["sh", "-c", f"{cmd} 2>&1"], env={**runner.env, **probe.test_env}, timeout_s=900)
    statuses = runner.parse(res.stdout + res.stderr)
    # The runner names modules, not tests: deselected tests still run, but no instance counts on them.
    passed = {t for t, s in statuses.items() if s == "PASSED" and not t.startswith(pkg.deselect)}
    if not passed or not calls.exists():
        raise PrepareError(
            f"{pkg.requirement}: the baseline run of its {runner.name} runner passed no test: "
            f"{(res.stdout + res.stderr)[-2000:]}"
        )
    sources = set(pkg.sources)
    covered = {
        (path, line): set(passed) for path, line, _name in json.loads(calls.read_text()) if path in sources
    }
    shutil.rmtree(work, ignore_errors=True)
    return Baseline(passed, covered, res.wall_s)


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
            **runner_fields(pkg),
        )
        # Each grading on a clone of its own: grading takes git away before the tests run.
        empty = grade(_clone_box(job, repo, staging / "empty"), draft, None, timeout_s=job.timeout_s)
        statuses = empty["statuses"]
        f2p = [t for t in covered if statuses.get(t) not in PASSING]
        usable = not (empty.get("error") or empty.get("timed_out")) and 0 < len(f2p) <= MAX_FAIL_TO_PASS
        if usable:
            # Once more, the failing tests alone: a bug whose failures come and go (random or
            # order-dependent tests) would grade agents by luck.
            again = grade(
                _clone_box(job, repo, staging / "again"),
                draft.model_copy(update={"FAIL_TO_PASS": f2p, "PASS_TO_PASS": []}),
                None,
                timeout_s=job.timeout_s,
            )
            usable = all(again["statuses"].get(t) not in PASSING for t in f2p)
        if not usable:
            return None  # no failure, too many, a hang, or failures that do not repeat
        # A failing test that never calls the mutated code is flaky, not evidence: it goes nowhere.
        draft.FAIL_TO_PASS = f2p
        draft.PASS_TO_PASS = [t for t in suite if statuses.get(t) in PASSING]
        gold_run = grade(_clone_box(job, repo, staging / "gold"), draft, gold, timeout_s=job.timeout_s)
        if not gold_run["resolved"]:
            return None
        seed = zlib.crc32(iid.encode())
        runner = runner_for(draft)
        command = None if runner.native else runner.command_line(draft, python="python")
        draft.problem_statement = write_statement(
            pkg.name, pkg.version, f2p, empty["messages"], seed=seed, command=command
        )
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
    """A digest of how ``pkg`` is prepared: a package whose settings changed is prepared again.

    Settings left at their defaults are not part of it, so adding a setting keeps existing caches.
    """
    shown = [
        f"{f.name}={getattr(pkg, f.name)!r}"
        for f in dataclasses.fields(pkg)
        if f.name in _FIRST_SETTINGS or getattr(pkg, f.name) != f.default
    ]
    text = "Package(" + ", ".join(shown) + ")"
    return f"{zlib.crc32(text.encode()):08x}"


#: The settings packages had when caches were first keyed (always part of the key).
_FIRST_SETTINGS = (
    "name",
    "version",
    "repo",
    "sources",
    "tests",
    "pythonpath",
    "pytest_args",
    "deselect",
    "requirements",
    "max_instances",
)


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
