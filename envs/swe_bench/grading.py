"""Grading: apply a patch, restore and patch the tests, run FAIL_TO_PASS and PASS_TO_PASS, report.

Everything runs through a sandbox's ``exec`` (any :class:`tangram_env.sandbox.Sandbox`; prepare uses
a host directory with the same method), so the same code grades in a local sandbox, an e2b one or an
official SWE-bench Docker container. The report is SWE-bench's own::

    {instance_id: {"patch_is_None", "patch_exists", "patch_successfully_applied", "resolved",
                   "tests_status": {"FAIL_TO_PASS": {"success": [...], "failure": [...]},
                                    "PASS_TO_PASS": {...}, "FAIL_TO_FAIL": {...}, "PASS_TO_FAIL": {...}}}}

with SWE-bench's rules: a test passes when it ``PASSED`` or ``XFAIL``ed, fails when it ``FAILED``,
``ERROR``ed or never reported, and is neither when skipped; an instance is resolved when every
FAIL_TO_PASS and every PASS_TO_PASS test that counts passes.
"""

from __future__ import annotations

import json
import shlex
import time
from importlib import resources
from typing import Any, Protocol

from tangram_env.envs.swe_bench.instance import SweBenchInstance
from tangram_env.envs.swe_bench.runners import as_run_tests, runner_for  # i19: per-repository runners
from tangram_env.sandbox import ExecResult

#: Where grading keeps its files inside a sandbox (its private tmp; never in the repository).
WORK_DIR = "/tmp/tangram-swe"
PASSING = ("PASSED", "XFAIL")
FAILING = ("FAILED", "ERROR")
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


def run_tests(
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
    install: bool = True,
) -> dict[str, Any]:
    """Run pytest node ids (or paths) ``tests`` with ``python`` in ``root`` (default the workspace) of
    ``box``, in ``shards`` parallel processes; the merged report: ``{"tests": {nodeid: {"status",
    "message"}}, "shards": [{"returncode", "timed_out", "tail"}], "wall_s"}``, plus ``error`` when the
    run itself failed.
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
    }
    put_file(box, f"{work}/spec.json", json.dumps(spec))
    out = f"{work}/report.json"
    cmd = f"rm -f {out} && {shlex.quote(python)} {work}/testrun.py {work}/spec.json {out} && cat {out}"
    res = box.exec(["sh", "-c", cmd], cwd=root or box.workspace, cores=cores, timeout_s=timeout_s + 30)
    if not res.ok or res.stdout_truncated:
        why = res.killed_by or f"exit code {res.exit_code}"
        return {
            "tests": {},
            "shards": [],
            "wall_s": res.wall_s,
            "error": f"the test run failed ({why}): {(res.stderr or res.stdout)[-_LOG_TAIL:]}",
        }
    try:
        report: dict[str, Any] = json.loads(res.stdout)
    except ValueError:
        return {
            "tests": {},
            "shards": [],
            "wall_s": res.wall_s,
            "error": "the test run wrote no readable report",
        }
    return report


def _split(tests: list[str], statuses: dict[str, str]) -> dict[str, list[str]]:
    success = [t for t in tests if statuses.get(t) in PASSING]
    failure = [t for t in tests if t not in statuses or statuses[t] in FAILING]
    return {"success": success, "failure": failure}


def _all_pass(split: dict[str, list[str]]) -> bool:
    return not split["failure"]  # with no counted tests SWE-bench's ratio is 1 as well


def swe_report(
    instance: SweBenchInstance, patch: str | None, applied: bool, statuses: dict[str, str]
) -> dict[str, Any]:
    """SWE-bench's evaluation report of one instance from per-test statuses.

    ``applied`` is whether the patch applied (or, with no patch, whether the tests could run at all).
    As in SWE-bench, an empty patch resolves nothing; its tests' statuses are still reported.
    """
    exists = bool(patch and patch.strip())
    f2p = _split(instance.FAIL_TO_PASS, statuses) if applied else {"success": [], "failure": []}
    p2p = _split(instance.PASS_TO_PASS, statuses) if applied else {"success": [], "failure": []}
    resolved = exists and applied and _all_pass(f2p) and _all_pass(p2p)
    return {
        instance.instance_id: {
            "patch_is_None": patch is None,
            "patch_exists": exists,
            "patch_successfully_applied": exists and applied,
            "resolved": resolved,
            "tests_status": {
                "FAIL_TO_PASS": f2p,
                "PASS_TO_PASS": p2p,
                "FAIL_TO_FAIL": {"success": [], "failure": []},
                "PASS_TO_FAIL": {"success": [], "failure": []},
            },
        }
    }


def apply_patch(box: Box, root: str, patch: str, name: str) -> tuple[bool, str]:
    """Apply ``patch`` in ``root`` the way SWE-bench's harness does (``git apply``, then with
    ``--reject``, then ``patch --fuzz=5``); whether it applied, and the tool's output.
    """
    path = f"{scratch_dir(box)}/{name}.patch"
    put_file(box, path, patch if patch.endswith("\n") else patch + "\n")
    attempts = [
        f"git apply --verbose {path}",
        f"git apply --verbose --reject {path}",
        f"patch --batch --fuzz=5 -p1 -i {path}",
    ]
    log = []
    for cmd in attempts:
        res = box.exec(["sh", "-c", cmd], cwd=root, timeout_s=60)
        log.append(f"$ {cmd}\n{res.stdout}{res.stderr}")
        if res.ok:
            return True, "\n".join(log)[-_LOG_TAIL:]
    return False, "\n".join(log)[-_LOG_TAIL:]


def restore_test_files(box: Box, root: str, instance: SweBenchInstance) -> ExecResult | None:
    """Put the instance's test files back as they are at ``base_commit`` (a file absent there is
    removed), so a patch that edits the tests cannot change what grades it.
    """
    files = instance.test_files()
    if not files:
        return None
    base = shlex.quote(instance.base_commit)
    script = "; ".join(
        f"if git cat-file -e {base}:{shlex.quote(f)} 2>/dev/null; "
        f"then git checkout -q {base} -- {shlex.quote(f)}; else rm -f {shlex.quote(f)}; fi"
        for f in files
    )
    return box.exec(["sh", "-c", script], cwd=root, timeout_s=60)


def grade(
    box: Box,
    instance: SweBenchInstance,
    patch: str | None,
    *,
    shards: int = 1,
    cores: tuple[int, ...] = (),
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Grade ``patch`` (the agent's diff; None: no patch) on ``instance`` in ``box``, a sandbox fresh
    from the instance's image. Returns ``report`` (SWE-bench's format), ``resolved``, the per-test
    ``statuses``, failure ``messages``, the ``log`` of the patch and test commands and timings.
    """
    started = time.monotonic()
    root = instance.workdir or box.workspace
    install_harness(box)
    log: list[str] = []
    applied = True
    if patch is not None and patch.strip():
        applied, out = apply_patch(box, root, patch, "model")
        log.append(out)
    result: dict[str, Any] = {"instance_id": instance.instance_id, "statuses": {}, "messages": {}}
    runner = runner_for(instance)  # i19: every repository graded by its own runner
    if applied and "error" not in result:
        restored = restore_test_files(box, root, instance)
        if restored is not None and not restored.ok:
            log.append(f"restoring the test files failed: {restored.stderr[-_LOG_TAIL:]}")
        if instance.test_patch.strip():
            ok, out = apply_patch(box, root, instance.test_patch, "test")
            log.append(out)
            if not ok:
                result["error"] = "the instance's test_patch does not apply"
        if "error" not in result:
            tests = [*instance.FAIL_TO_PASS, *instance.PASS_TO_PASS]
            run = (run_tests if runner.native else as_run_tests(instance, runner))(  # i19
                box,
                tests,
                python=instance.python,
                root=root,
                env=instance.test_env,
                pytest_args=instance.pytest_args,
                shards=shards,
                cores=cores,
                timeout_s=timeout_s,
                install=False,
            )
            statuses = {t: r["status"] for t, r in run["tests"].items()}
            result["statuses"] = statuses
            result["messages"] = {t: r["message"] for t, r in run["tests"].items() if r.get("message")}
            result["shards"] = len(run.get("shards", []))
            result["test_wall_s"] = run.get("wall_s", 0.0)
            result["timed_out"] = any(s.get("timed_out") for s in run.get("shards", []))
            if run.get("error"):
                result["error"] = run["error"]
            log.extend(s.get("tail", "") for s in run.get("shards", []))
    report = swe_report(instance, patch, applied, result["statuses"])
    result.update(
        report=report,
        resolved=report[instance.instance_id]["resolved"],
        log="\n".join(log)[-_LOG_TAIL * 2 :],
        wall_s=time.monotonic() - started,
    )
    return result
