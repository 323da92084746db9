"""Grading: apply a patch, restore and patch the tests, run FAIL_TO_PASS and PASS_TO_PASS, report.

Everything runs through a sandbox's ``exec`` (any :class:`tangram_env.sandbox.Sandbox`; prepare uses
a host directory with the same method), so the same code grades in a local sandbox, an e2b one or an
official SWE-bench Docker container. The report is SWE-bench's own::

    {instance_id: {"patch_is_None", "patch_exists", "patch_successfully_applied", "resolved",
                   "tests_status": {"FAIL_TO_PASS": {"success": [...], "failure": [...]},
                                    "PASS_TO_PASS": {...}, "FAIL_TO_FAIL": {...}, "PASS_TO_FAIL": {...}}}}

with the rules of :mod:`.verdict`. What is graded, and what the grader trusts:

- only the patch's changes to the source: :mod:`.patch_filter` drops the sections that touch test
  machinery, and whatever such file is still found changed after the patch applies is put back;
  the instance's test files are restored and its test patch applied, as SWE-bench does;
- the run's report counts only if the tests planted with it (:mod:`.canaries`) come back as they
  must, in every shard; otherwise ``tampering`` says why and nothing resolves;
- deciding happens here, in the grading tool's process, never in the sandbox where the agent's code
  runs; what comes back from the sandbox is parsed strictly (:func:`.verdict.parse_run`).

A grading that could not be done (a sandbox that dies, a runner that fails before the tests run, an
instance this grader cannot run) raises instead of returning a verdict: it is not the patch's
failure. What the code under test can do to the run (kill a test process or the runner itself, hit a
limit) is: 0.0, with the reason; so is a patch that leaves the grader no room on disk to set the tests
up (:func:`_no_room`).
"""

from __future__ import annotations

import json
import secrets
import shlex
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol

from tangram_env.envs.swe_bench.canaries import (
    Canaries,
    check_canaries,
    make_canaries,
    make_unittest_canaries,
)
from tangram_env.envs.swe_bench.instance import SweBenchInstance
from tangram_env.envs.swe_bench.patch_filter import filter_patch, protected_reason
from tangram_env.envs.swe_bench.runners import Runner, UnsupportedInstance, run_by_log, runner_for
from tangram_env.envs.swe_bench.testrun import split_shards
from tangram_env.envs.swe_bench.verdict import ReportError, RunReport, parse_run, swe_report
from tangram_env.errors import TangramRuntimeError
from tangram_env.sandbox import ExecResult

__all__ = [
    "PASSING",
    "GradingUnavailable",
    "ReportError",
    "apply_patch",
    "grade",
    "install_harness",
    "restore_test_files",
    "run_shards",
    "run_tests",
    "swe_report",
]

#: Where grading keeps its files inside a sandbox (its private tmp; never in the repository).
WORK_DIR = "/tmp/tangram-swe"
#: Statuses prepare counts as passing when it picks an instance's tests (SWE-bench's own).
PASSING = ("PASSED", "XFAIL")
_LOG_TAIL = 4000


class Box(Protocol):
    """What grading needs of a sandbox: ``exec`` and its workspace."""

    workspace: str

    def exec(
        self,
        cmd: str | list[str],
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        cores: tuple[int, ...] = (),
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run ``cmd`` in the sandbox."""
        ...


def scratch_dir(box: Box) -> str:
    """The directory grading writes its files to in ``box`` (a sandbox's private tmp by default)."""
    return str(getattr(box, "scratch", WORK_DIR))


def put_file(box: Box, path: str, data: bytes | str) -> None:
    """Write ``data`` at absolute ``path`` inside ``box`` (through ``exec``, which every provider has)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    parent = path.rsplit("/", 1)[0] or "/"
    res = box.exec(
        ["sh", "-c", f"mkdir -p {shlex.quote(parent)} && cat > {shlex.quote(path)}"], stdin=raw, timeout_s=60
    )
    if not res.ok:
        raise OSError(f"could not write {path} in the sandbox: {res.stderr.strip() or res.exit_code}")


def install_harness(box: Box) -> None:
    """Copy the test runner and its pytest plugin into ``box``'s grading directory."""
    pkg = resources.files("tangram_env.envs.swe_bench")
    work = scratch_dir(box)
    put_file(box, f"{work}/testrun.py", (pkg / "testrun.py").read_text(encoding="utf-8"))
    put_file(
        box, f"{work}/plugin/tangram_swe_report.py", (pkg / "pytest_report.py").read_text(encoding="utf-8")
    )


class GradingUnavailable(TangramRuntimeError):
    """Grading could not be done for a reason outside the patch: the sandbox died, the test runner failed
    before the tests ran, or the instance itself cannot be graded here. The grading action fails with
    it, so the step has no reward (:class:`~tangram_env.errors.RewardUnavailable`) instead of a 0.0.
    """


@dataclass
class TestRun:
    """A run's report as read back (None when the run produced none) and why not, if it did not."""

    __test__ = False  # not a pytest class

    report: RunReport | None
    error: str | None = None
    limits_hit: tuple[str, ...] = ()


def run_shards(
    box: Box,
    tests: list[str],
    *,
    python: str = "python",
    root: str | None = None,
    env: dict[str, str] | None = None,
    pytest_args: list[str] | tuple[str, ...] = (),
    shards: int = 1,
    cores: tuple[int, ...] = (),
    timeout_s: float = 600.0,
    trace_root: str | None = None,
    plant: dict[str, str] | None = None,
    insert: dict[str, str] | None = None,
    every_shard: list[str] | tuple[str, ...] = (),
    install: bool = True,
    legacy_runner: bool = False,
) -> TestRun:
    """Run pytest node ids (or paths) ``tests`` with ``python`` in ``root`` (default the workspace) of
    ``box``, in ``shards`` parallel processes, each also running ``every_shard``; ``plant`` files are
    written for the run, ``insert`` functions inserted into test files for it (``legacy_runner``:
    start pytest as before, with the repository importable first). The report is parsed strictly
    (:class:`ReportError` if it is not one the runner writes); a run the patch's code stopped (a
    limit: time, memory, processes, output; or the runner killed once the tests ran, see
    :func:`_runner_death`) has no report and an ``error``; a runner that failed before the tests
    ran, or a sandbox that died, is :class:`GradingUnavailable`.
    """
    if install:
        install_harness(box)
    work = scratch_dir(box)
    spec = {
        "tests": list(tests),
        "shards": shards,
        "pytest_args": list(pytest_args),
        "env": dict(env or {}),
        "timeout_s": timeout_s,
        "plugin_dir": f"{work}/plugin",
        "trace_root": trace_root,
        "plant": dict(plant or {}),
        "insert": dict(insert or {}),
        "every_shard": list(every_shard),
        "legacy_runner": legacy_runner,
    }
    put_file(box, f"{work}/spec.json", json.dumps(spec))
    # -I -S: the runner, which writes the report, imports nothing but the standard library; no
    # ``.pth`` file or ``sitecustomize`` (an editable install puts the repository on every
    # interpreter's path) runs in it. The pytest processes it starts run the repository's code anyway.
    # No shell around it: the runner is the only process of ours the tests could signal, and it
    # catches what can be caught.
    argv = [python, "-I", "-S", f"{work}/testrun.py", f"{work}/spec.json", "-"]
    res = box.exec(argv, cwd=root or box.workspace, cores=cores, timeout_s=timeout_s + 30)
    if res.killed_by is not None:
        return TestRun(None, f"the test run was stopped: {res.killed_by} limit", tuple(res.limits_hit))
    if not res.ok:
        return TestRun(None, _runner_death(box, res), tuple(res.limits_hit))
    if res.stdout_truncated:
        raise ReportError("the report is larger than the sandbox's output cap")
    expected_shards = max(1, len(split_shards(list(tests), shards)))
    return TestRun(parse_run(res.stdout, expected_shards), None, tuple(res.limits_hit))


def _runner_death(box: Box, res: ExecResult) -> str:
    """Why the runner ended without a report, when that is the tests' doing; else
    :class:`GradingUnavailable`.

    The runner catches every signal that can be caught, and the sandbox reports its own limits
    (``killed_by``) and raises when it dies. A runner that died once the tests had started (it says
    so on stderr first, before any code under test runs), in a sandbox that is still there, was ended
    by that code (a SIGKILL from the same user, say): the patch's failure. An outside SIGKILL of the
    runner alone cannot be told from that and is counted the same way; a runner that had not started
    the tests never ran the patch's code.
    """
    from tangram_env.envs.swe_bench.testrun import STARTED

    log = (res.stderr or res.stdout)[-_LOG_TAIL:]
    if STARTED not in res.stderr:
        raise GradingUnavailable(
            f"the test runner failed (exit code {res.exit_code}) before the tests ran: {log}"
        )
    # A sandbox that died raises here (SandboxBroken). One that is there but fails even this was
    # brought to it by the only code that ran in it since it was made fresh: the patch's.
    probe = box.exec(["true"], timeout_s=60)
    after = "" if probe.ok else "; the sandbox then failed to run `true`"
    return f"the tests killed their test runner (exit code {res.exit_code}){after}"


def run_tests(box: Box, tests: list[str], **kwargs: Any) -> dict[str, Any]:
    """:func:`run_shards` for trusted code (prepare runs pristine packages): the shards' tests merged,
    ``{"tests": {nodeid: {"status", "message"[, "calls"]}}, "shards": [{"returncode", "timed_out",
    "tail"}], "wall_s"}``, plus ``error`` when the run itself failed.
    """
    try:
        run = run_shards(box, tests, **kwargs)
    except (ReportError, GradingUnavailable) as exc:
        return {"tests": {}, "shards": [], "wall_s": 0.0, "error": str(exc)}
    if run.report is None:
        return {"tests": {}, "shards": [], "wall_s": 0.0, "error": run.error}
    merged: dict[str, Any] = {}
    for shard in run.report.shards:
        merged.update({t: r.model_dump(exclude_none=True) for t, r in shard.tests.items()})
    shards = [s.model_dump(exclude={"tests"}) for s in run.report.shards]
    return {"tests": merged, "shards": shards, "wall_s": run.report.wall_s}


def _attempts(path: str) -> list[str]:
    return [
        f"git apply --verbose {path}",
        f"git apply --verbose --reject {path}",
        f"patch --batch --fuzz=5 -p1 -i {path}",
    ]


#: The exit status of an apply call whose patch applied but whose listing of changes failed.
_LISTING_FAILED = 97

#: Room the grader needs after the patch is applied, in every filesystem it writes to (the repository
#: and its own scratch folder; in the local sandbox they share one tmpfs, whose inodes are
#: ``disk_mb`` / 4 KiB). Before the tests start it restores the test files, writes and applies the
#: test patch, writes the run's spec, the runner's temporary folder with each shard's report and log,
#: and the planted tests, and git rewrites its index: a few dozen inodes and a few MiB for the largest
#: SWE-bench repositories (the index alone is ~1 MiB). The margin leaves the tests' own temporary files
#: some room too. A patch that leaves less grades 0.0; a sandbox with less before it is misconfigured.
MIN_FREE_INODES = 1024
MIN_FREE_BYTES = 16 << 20
#: Ends each measurement of free room in an apply call's output.
_ROOM_END = "tangram-room-end"


@dataclass(frozen=True)
class Room:
    """Free inodes and bytes of the fullest filesystem the grader writes to (None: not limited)."""

    inodes: int | None
    bytes: int | None

    def short(self) -> bool:
        """Whether it is below what the grader needs (:data:`MIN_FREE_INODES`, :data:`MIN_FREE_BYTES`)."""
        return (self.inodes is not None and self.inodes < MIN_FREE_INODES) or (
            self.bytes is not None and self.bytes < MIN_FREE_BYTES
        )

    def __str__(self) -> str:
        inodes = "unlimited" if self.inodes is None else str(self.inodes)
        size = "unlimited" if self.bytes is None else str(self.bytes)
        return f"{inodes} inodes / {size} bytes free"


def _room_cmd(box: Box) -> str:
    """A shell command that prints the room of the repository (the working directory), the grader's
    scratch folder and the runner's temporary folder, then :data:`_ROOM_END`. ``stat`` reads the
    filesystem itself: nothing the patch writes is asked.
    """
    return (
        f"stat -f -c '%c %d %b %a %S' -- . {shlex.quote(scratch_dir(box))} \"${{TMPDIR:-/tmp}}\" "
        f"2>/dev/null; echo {_ROOM_END}"
    )


def _parse_room(text: str) -> Room | None:
    """The tightest room among ``stat -f`` lines (total and free inodes, total and available blocks,
    block size); None when no line could be read. A filesystem that counts no inodes (btrfs) or no
    blocks has no such limit.
    """
    inodes: list[int] = []
    sizes: list[int] = []
    seen = False
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 5 or not all(f.isdigit() for f in fields):
            continue
        files, ffree, blocks, bavail, bsize = map(int, fields)
        seen = True
        if files:
            inodes.append(ffree)
        if blocks:
            sizes.append(bavail * bsize)
    if not seen:
        return None
    return Room(min(inodes) if inodes else None, min(sizes) if sizes else None)


@dataclass
class _Applied:
    """What an apply call came back with: ``room_before`` the patch (measured in the first attempt,
    before anything of it was written) and ``room_after`` it, when asked for.
    """

    ok: bool
    log: str
    listed: str | None
    listing_error: str | None = None
    room_before: Room | None = None
    room_after: Room | None = None


def _apply(box: Box, root: str, patch: str, name: str, listing: str = "", room: bool = False) -> _Applied:
    """:func:`apply_patch`, also measuring the free room before and after the patch when ``room``;
    a listing that fails is returned in ``listing_error``.
    """
    path = f"{scratch_dir(box)}/{name}.patch"
    put_file(box, path, patch if patch.endswith("\n") else patch + "\n")
    measure = f"{_room_cmd(box)}; " if room else ""
    log = []
    before: Room | None = None
    for i, cmd in enumerate(_attempts(path)):
        full = cmd
        if listing or room:
            # The measurements come first on stdout (git's own output goes to stderr), so an output
            # cap that cuts the listing short leaves them whole.
            then = f"{listing.format(patch=path)} || exit {_LISTING_FAILED}" if listing else "true"
            full = f"{measure}{_past_mtime_of(path)}; if {cmd} >&2; then {measure}{then}; else exit 1; fi"
        res = box.exec(["sh", "-c", full], cwd=root, timeout_s=60)
        out = res.stdout
        log.append(f"$ {cmd}\n{res.stdout if not (listing or room) else ''}{res.stderr}")
        after: Room | None = None
        if room:
            first, _, out = out.partition(_ROOM_END + "\n")
            if i == 0:
                before = _parse_room(first)
            if res.ok or res.exit_code == _LISTING_FAILED:
                second, _, out = out.partition(_ROOM_END + "\n")
                after = _parse_room(second)
        if listing and res.exit_code == _LISTING_FAILED:
            return _Applied(
                True,
                "\n".join(log)[-_LOG_TAIL:],
                None,
                f"could not list what the patch changed: {res.stderr[-_LOG_TAIL:]}",
                before,
                after,
            )
        if res.ok:
            listed = None if res.stdout_truncated else (out if listing else "")
            return _Applied(True, "\n".join(log)[-_LOG_TAIL:], listed, None, before, after)
    return _Applied(False, "\n".join(log)[-_LOG_TAIL:], "", None, before)


def apply_patch(
    box: Box, root: str, patch: str, name: str, listing: str = ""
) -> tuple[bool, str, str | None]:
    """Apply ``patch`` in ``root`` the way SWE-bench's harness does (``git apply``, then with
    ``--reject``, then ``patch --fuzz=5``); whether it applied, the tool's output and, after the
    attempt that worked, the output of the shell command ``listing`` (``{patch}`` names the patch
    file) run in the same call: None if it was cut at the sandbox's output cap. A listing that fails
    is :class:`GradingUnavailable`.
    """
    done = _apply(box, root, patch, name, listing)
    if done.listing_error:
        raise GradingUnavailable(done.listing_error)
    return done.ok, done.log, done.listed


def _no_room(done: _Applied, patch_bytes: int) -> str | None:
    """Why the applied patch leaves the grader too little room (its 0.0), or None if it does not;
    :class:`GradingUnavailable` when the sandbox was already that full before the patch.
    """
    after = done.room_after
    if after is None or not after.short():
        return None
    before = done.room_before
    if before is not None:
        # The patch file is the grader's own write, made before the first measurement: a large patch
        # must not make a healthy sandbox look misconfigured.
        before = Room(
            None if before.inodes is None else before.inodes + 1,
            None if before.bytes is None else before.bytes + patch_bytes + 4096,
        )
    if before is None or before.short():
        raise GradingUnavailable(
            f"the grading sandbox is too full to grade in: {before or 'unknown room'} before the patch "
            f"was applied, and the grader needs {MIN_FREE_INODES} inodes and {MIN_FREE_BYTES} bytes; "
            "give the sandbox more disk (SandboxSpec.disk_mb; the local sandbox has disk_mb / 4 KiB "
            "inodes, and keeps its files 64 MiB below mem_mb) or a smaller image"
        )
    return (
        f"the patch leaves the sandbox no room to run the tests ({after}; the grader needs "
        f"{MIN_FREE_INODES} inodes and {MIN_FREE_BYTES} bytes)"
    )


def _past_mtime_of(path: str) -> str:
    """A shell command that returns once a file written now would be newer than ``path``.

    File times come from a coarse clock (one tick is a few ms): a file the patch writes within the
    tick the patch file was written in has the same time, and ``find -newer`` would not list it.
    """
    tick = shlex.quote(path + ".tick")
    newer = f'[ -n "$(find {tick} -newer {shlex.quote(path)})" ]'
    return f"touch {tick}; until {newer}; do touch {tick}; done; rm -f {tick}"


def _changes_listing(base: str) -> str:
    """What the patch changed, read by git (tracked files, deletions included) and by ``find`` (any
    file written after the patch file, ignored ones and symbolic links included), NUL-separated.
    """
    return (
        f"git -c core.quotepath=off diff --name-only --no-renames -z {shlex.quote(base)}"
        " && printf '\\0/\\0' && find . -path ./.git -prune -o -newer {patch} -printf '%y%P\\0'"
    )


def _changed_paths(listing: str) -> dict[str, str]:
    """Path -> type (``f`` file, ``l`` link, ``d`` directory, ``-`` tracked) from the listing."""
    tracked, _, found = listing.partition("\0/\0")
    out = {p: "-" for p in tracked.split("\0") if p}
    for entry in found.split("\0"):
        if len(entry) > 1:
            out[entry[1:]] = entry[0] if entry[1:] not in out or entry[0] == "l" else out[entry[1:]]
    return out


def restore_paths(box: Box, root: str, base: str, paths: list[str]) -> ExecResult | None:
    """Put ``paths`` back as they are at ``base`` (a path absent there is removed)."""
    if not paths:
        return None
    quoted = shlex.quote(base)
    script = "; ".join(
        f"if git cat-file -e {quoted}:{shlex.quote(p)} 2>/dev/null; "
        f"then rm -rf -- {shlex.quote(p)}; git checkout -q {quoted} -- {shlex.quote(p)}; "
        f"else rm -rf -- {shlex.quote(p)}; fi"
        for p in paths
    )
    return box.exec(["sh", "-c", script], cwd=root, timeout_s=60)


def restore_test_files(box: Box, root: str, instance: SweBenchInstance) -> ExecResult | None:
    """Put the instance's test files back as they are at ``base_commit`` (a file absent there is
    removed), so a patch that edits the tests cannot change what grades it.
    """
    return restore_paths(box, root, instance.base_commit, instance.test_files())


def _put_back_test_machinery(
    box: Box, root: str, instance: SweBenchInstance, changed: dict[str, str], dropped: list[dict[str, str]]
) -> None:
    """Restore the instance's test files, and any protected file the patch still changed (adding
    those to ``dropped``): what the splitter missed, git and ``find`` saw.
    """
    test_files = set(instance.test_files())
    missed = sorted(
        p
        for p, kind in changed.items()
        if kind == "l" or (kind != "d" and protected_reason(p, test_files) is not None)
    )
    already = {d["path"] for d in dropped}
    for p in missed:
        why = "a symbolic link" if changed[p] == "l" else protected_reason(p, test_files)
        if p not in already:
            dropped.append({"path": p, "reason": f"{why} (found changed after applying the patch)"})
    restored = restore_paths(box, root, instance.base_commit, sorted(set(missed) | test_files))
    if restored is not None and not restored.ok:
        raise GradingUnavailable(f"restoring the test files failed: {restored.stderr[-_LOG_TAIL:]}")


def _seal(box: Box, root: str) -> None:
    """Take away, before the tests run, what would tell the real tests from the planted ones: git
    (``git show HEAD:`` lists the tests the base commit has, and the tests inserted among them are not
    there) and the grader's copies of the patches (the test patch names the tests it adds). Code
    under test runs as the grader's commands do, so what they leave it can read; the sandbox is reset
    or destroyed after grading, which brings both back.
    """
    work = shlex.quote(scratch_dir(box))
    script = (
        f"rm -f -- {work}/model.patch {work}/test.patch"
        " && if top=$(git rev-parse --show-toplevel 2>/dev/null); then"
        ' rm -rf -- "$(git rev-parse --absolute-git-dir)" "$top/.git"; fi'
    )
    res = box.exec(["sh", "-c", script], cwd=root, timeout_s=120)
    if not res.ok:
        raise GradingUnavailable(f"could not remove git before the tests ran: {res.stderr[-_LOG_TAIL:]}")


def _canary_dir(instance: SweBenchInstance) -> str:
    first = instance.FAIL_TO_PASS[0].split("::", 1)[0]
    return first.rsplit("/", 1)[0] if "/" in first else ""


def _planted_for(runner: Runner, instance: SweBenchInstance) -> Canaries | None:
    """The planted tests ``runner`` runs for ``instance``: pytest functions beside its first
    FAIL_TO_PASS test, or a ``unittest`` case in the Django app of its first test label.
    """
    if runner.planted == "pytest":
        # Run by the runner of our own (not read from a log): some tests go among the first
        # FAIL_TO_PASS test's own, too.
        first_file = instance.FAIL_TO_PASS[0].split("::", 1)[0] if runner.native else ""
        return make_canaries(_canary_dir(instance), first_file if first_file.endswith(".py") else "")
    if runner.planted == "unittest":
        labels = runner.directives(instance)
        app = labels[0].split(".", 1)[0] if labels else ""
        return make_unittest_canaries(f"tests/{app}", app) if app.isidentifier() else None
    return None


def _among(inserted: list[str], instance: SweBenchInstance) -> list[str]:
    """The instance's tests with the planted tests inserted in a file placed at random among them:
    where a test stands in the list the runner is given says nothing of what it is.
    """
    tests = [*instance.FAIL_TO_PASS, *instance.PASS_TO_PASS]
    rng = secrets.SystemRandom()
    for test in inserted:
        tests.insert(rng.randrange(len(tests) + 1), test)
    return tests


def _judge_run(
    run: TestRun, canaries: Canaries | None
) -> tuple[dict[str, str], dict[str, str], str | None, str | None]:
    """(statuses, messages, tampering, why the run ended early) of a run read back from the sandbox."""
    if run.report is None:
        return {}, {}, None, run.error
    statuses: dict[str, str] = {}
    messages: dict[str, str] = {}
    problems: list[str] = []
    early = None
    planted = canaries.ids if canaries else set()
    for i, shard in enumerate(run.report.shards):
        own: dict[str, str] = {t: r.status for t, r in shard.tests.items()}
        # A test process killed while its runner lived on and reported (SIGKILL included: the code
        # under test can send it to itself) is the tests' failure, like any other crash.
        if shard.timed_out:
            early = "the tests timed out"
        elif shard.returncode is not None and shard.returncode < 0:
            early = f"a test process died of signal {-shard.returncode}"
        if canaries is not None:
            wrong = check_canaries(canaries, own)
            if shard.timed_out and not own.keys() - planted:
                # Cut short before any real test reported: the run resolves nothing either way. Once
                # one has, the planted tests (each shard runs them first) must have reported too.
                wrong = [w for w in wrong if not w.endswith("did not report")]
            if shard.returncode == 0:
                wrong.append("the tests exited 0 although planted tests failed")
            problems += [f"shard {i}: {w} (exit code {shard.returncode})" for w in wrong]
        for test, record in shard.tests.items():
            if test in planted:
                continue
            if test in statuses:
                problems.append(f"test {test[:200]!r} reported by two shards")
            statuses[test] = record.status
            if record.message:
                messages[test] = record.message
    tampering = "; ".join(sorted(set(problems))) if problems else None
    return statuses, messages, tampering, early


def _reason(
    instance: SweBenchInstance, result: dict[str, Any], kept: str | None, applied: bool, no_room: str | None
) -> str | None:
    """Why the patch did not resolve the instance (None if it did), in one sentence."""
    if result["resolved"]:
        return None
    if no_room:
        return no_room
    if result.get("tampering"):
        return f"tampering: {result['tampering']}"
    dropped = result.get("dropped_edits") or []
    if not (kept and kept.strip()):
        if dropped:
            return f"the patch changes only files that are not graded ({len(dropped)} dropped)"
        return "no patch"
    if not applied:
        return "the patch does not apply"
    status = result["report"][instance.instance_id]["tests_status"]
    f2p, p2p = status["FAIL_TO_PASS"]["failure"], status["PASS_TO_PASS"]["failure"]
    parts = [f"{len(f2p)}/{len(instance.FAIL_TO_PASS)} FAIL_TO_PASS tests did not pass"] if f2p else []
    if p2p:
        parts.append(f"{len(p2p)}/{len(instance.PASS_TO_PASS)} PASS_TO_PASS tests broke")
    if result.get("run_error"):
        parts.append(result["run_error"])
    return "failed tests: " + ", ".join(parts) if parts else "failed tests"


def grade(
    box: Box,
    instance: SweBenchInstance,
    patch: str | None,
    *,
    shards: int = 1,
    cores: tuple[int, ...] = (),
    timeout_s: float = 600.0,
    legacy: bool = False,
) -> dict[str, Any]:
    """Grade ``patch`` (the agent's diff; None: no patch) on ``instance`` in ``box``, a sandbox fresh
    from the instance's image. Returns ``report`` (SWE-bench's format), ``resolved``, the per-test
    ``statuses``, failure ``messages``, ``dropped_edits`` (``{"path", "reason"}`` of each change not
    graded), ``tampering`` (None, or why the run's report is void), ``reason`` (why it did not
    resolve), the ``log`` of the patch and test commands and timings.

    Raises :class:`GradingUnavailable` when the grading itself could not be done. ``legacy`` grades
    the way this module did before it refused test-machinery edits and planted tests (no filter, no
    planted tests, the old runner and rules): kept only so that ``benchmarks.grading`` can measure
    what the checks cost and the tests can show what they stop; never grade for training with it.
    """
    started = time.monotonic()
    root = instance.workdir or box.workspace
    try:
        runner = runner_for(instance)  # each repository's own runner (django, sympy, pytest, ...)
    except UnsupportedInstance as exc:
        raise GradingUnavailable(str(exc)) from exc
    install_harness(box)
    log: list[str] = []
    dropped: list[dict[str, str]] = []
    kept = patch
    if patch is not None and not legacy:
        filtered = filter_patch(patch, set(instance.test_files()))
        kept, dropped = filtered.patch, list(filtered.dropped)
    applied = True
    changed: dict[str, str] = {}
    void: str | None = None
    no_room: str | None = None
    if kept is not None and kept.strip():
        listing = "" if legacy else _changes_listing(instance.base_commit)
        done = _apply(box, root, kept, "model", listing, room=not legacy)
        applied, listed = done.ok, done.listed
        log.append(done.log)
        if applied:
            # What the patch wrote is its own: if it leaves no room for the grader's next writes, that
            # is its failure, measured here before any of them can fail.
            no_room = _no_room(done, len(kept.encode("utf-8")))
        if done.listing_error and no_room is None:
            raise GradingUnavailable(done.listing_error)
        if listed is not None:
            changed = _changed_paths(listed)
        elif no_room is None:
            void = "the patch changes more files than the grader can list"
    result: dict[str, Any] = {
        "instance_id": instance.instance_id,
        "statuses": {},
        "messages": {},
        "dropped_edits": dropped,
        "tampering": void,
    }
    applied_tests = True
    if applied and not no_room:
        _put_back_test_machinery(box, root, instance, changed, dropped)
        if instance.test_patch.strip():
            ok, out, _ = apply_patch(box, root, instance.test_patch, "test")
            log.append(out)
            if not ok and not (kept and kept.strip()):
                raise GradingUnavailable(f"the instance's test_patch does not apply:\n{out}")
            if not ok:
                # A prepared instance's test_patch applies to its base commit: the agent's patch is
                # what stops it (a file where its tests need a folder, say), and no test can run.
                applied_tests = False
    if no_room:
        result["run_error"] = no_room  # the grader has no room to set the tests up: none runs
    elif applied and not applied_tests:
        result["run_error"] = "the instance's test_patch does not apply over the patch, so no test ran"
    elif applied:
        # A runner that cannot run planted tests (sympy's, R2E-Gym's) relies on the restored runner
        # files and on a test reported twice with different statuses counting as failed.
        canaries = None if legacy else _planted_for(runner, instance)
        if not legacy:
            _seal(box, root)
        try:
            if not runner.native:
                run = TestRun(
                    *run_by_log(
                        box, instance, runner, root=root, cores=cores, timeout_s=timeout_s, plant=canaries
                    )
                )
            else:
                run = run_shards(
                    box,
                    _among(list(canaries.inserted_expected) if canaries else [], instance),
                    python=instance.python,
                    root=root,
                    env=instance.test_env,
                    pytest_args=instance.pytest_args,
                    shards=shards,
                    cores=cores,
                    timeout_s=timeout_s,
                    plant={canaries.path: canaries.source} if canaries else None,
                    insert=canaries.inserted if canaries else None,
                    every_shard=list(canaries.expected) if canaries else (),
                    install=False,
                    legacy_runner=legacy,
                )
        except ReportError as exc:
            run = TestRun(None)
            result["tampering"] = f"the report read back is not the runner's: {exc}"
        statuses, messages, tampering, early = _judge_run(run, canaries)
        result.update(statuses=statuses, messages=messages)
        result["tampering"] = result["tampering"] or tampering
        if early:
            result["run_error"] = early
        if run.report is not None:
            result["shards"] = len(run.report.shards)
            result["test_wall_s"] = run.report.wall_s
            result["timed_out"] = any(s.timed_out for s in run.report.shards)
            log.extend(s.tail for s in run.report.shards)
    trusted = {} if result["tampering"] else result["statuses"]
    report = swe_report(instance, kept if patch is not None else None, applied, trusted, legacy=legacy)
    report[instance.instance_id]["patch_exists"] = bool(patch and patch.strip())
    result.update(report=report, resolved=report[instance.instance_id]["resolved"])
    result.update(
        reason=_reason(instance, result, kept, applied, no_room),
        log="\n".join(log)[-_LOG_TAIL * 2 :],
        wall_s=time.monotonic() - started,
    )
    return result
