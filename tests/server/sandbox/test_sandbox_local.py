"""The local provider's interface: exec, files, limits, cores, reset and close, on real sandboxes."""

from __future__ import annotations

import glob
import os
import time
from pathlib import Path

import pytest

from tangram_env.errors import TangramError
from tangram_env.sandbox import (
    ExecResult,
    Sandbox,
    SandboxBroken,
    SandboxPathError,
    SandboxRequestError,
    SandboxSpec,
    truncation_marker,
)
from tangram_env.server.sandbox import build_image
from tangram_env.server.sandbox.local import LocalProvider, LocalSandbox
from tests.server.sandbox.helpers import SMALL, tmp_mount_points, wait_no_processes


def test_is_a_sandbox(sandbox: LocalSandbox) -> None:
    assert isinstance(sandbox, Sandbox)
    assert sandbox.workspace == "/workspace"


def test_exec_shell_and_argv(sandbox: LocalSandbox) -> None:
    r = sandbox.exec("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr, r.killed_by) == (3, "out\n", "err\n", None)
    assert not r.ok and r.wall_s > 0
    r = sandbox.exec(["printf", "%s|", "a b", "$HOME"])
    assert r.ok and r.stdout == "a b|$HOME|"


def test_exec_env_cwd_stdin(sandbox: LocalSandbox) -> None:
    sandbox.exec("mkdir -p sub/dir")
    r = sandbox.exec("pwd; echo $GREETING; cat", env={"GREETING": "hi"}, cwd="sub/dir", stdin=b"from stdin")
    assert r.stdout == "/workspace/sub/dir\nhi\nfrom stdin", r
    r = sandbox.exec("echo $HOME $USER $TMPDIR; env | grep -c SECRET_OF_THE_SERVER || true")
    assert r.stdout.split() == ["/workspace", "sandbox", "/tmp", "0"]


def test_server_environment_does_not_leak(sandbox: LocalSandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECRET_OF_THE_SERVER", "hunter2")
    r = sandbox.exec("env")
    assert "hunter2" not in r.stdout and "SECRET_OF_THE_SERVER" not in r.stdout


def test_large_stdin(sandbox: LocalSandbox) -> None:
    data = os.urandom(3 << 20)
    r = sandbox.exec("wc -c", stdin=data)
    assert r.ok and r.stdout.strip() == str(len(data))


def test_host_python_is_available(sandbox: LocalSandbox) -> None:
    r = sandbox.exec(["python3", "-c", "import sys; print(sys.version_info[:2])"])
    assert r.ok, r
    import sys

    assert r.stdout.strip() == str(tuple(sys.version_info[:2]))


def test_editable_install_hooks_are_blank_inside(provider: LocalProvider, image_dir: Path) -> None:
    """A Python environment's editable-install hook runs on the host but not in its sandboxes."""
    import subprocess
    import sys

    env = image_dir / "hooked-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    (site,) = env.glob("lib/python3*/site-packages")
    (site / "__editable__.demo-0.1.pth").write_text("import sys; sys.hooked = True\n")
    probe = ["python3", "-c", "import sys; print(hasattr(sys, 'hooked'))"]
    host = subprocess.run([str(env / "bin" / "python3"), *probe[1:]], capture_output=True, text=True)
    assert host.stdout.strip() == "True"  # the hook is real: the host's interpreter runs it
    build_image("hooked", python_env=env, root=image_dir)
    sb = provider.create(SandboxSpec(image="hooked", mem_mb=256, max_pids=64))
    try:
        r = sb.exec(probe)
        assert r.ok, r
        assert r.stdout.strip() == "False"
        assert sb.exec(["python3", "-c", "import sys; print(sys.prefix)"]).stdout.strip() == str(env)
    finally:
        sb.close()


def test_files_round_trip_and_persist(sandbox: LocalSandbox) -> None:
    sandbox.write_file("a/b/c.txt", "hello")
    sandbox.write_file("/tmp/t.bin", b"\x00\x01")
    r = sandbox.exec("cat a/b/c.txt; od -An -tx1 /tmp/t.bin; stat -c %U a/b/c.txt; echo made > out.txt")
    assert r.stdout.split() == ["hello", "00", "01", "sandbox"], r
    assert sandbox.read_file("out.txt") == b"made\n"
    assert sandbox.read_file("/workspace/a/b/c.txt") == b"hello"
    assert sandbox.exec("cat out.txt").stdout == "made\n"  # files outlive the exec that wrote them
    with pytest.raises(FileNotFoundError):
        sandbox.read_file("missing.txt")


@pytest.mark.parametrize("path", ["/etc/passwd", "/usr/x", "../escape", "a/../../b", ""])
def test_file_paths_outside_are_refused(sandbox: LocalSandbox, path: str) -> None:
    with pytest.raises(SandboxPathError):
        sandbox.write_file(path, "x")
    with pytest.raises(SandboxPathError):
        sandbox.read_file(path)


def test_host_never_follows_sandbox_links(sandbox: LocalSandbox) -> None:
    # Sandboxed code plants links to host files; the (root) server must not read or write through them.
    sandbox.exec("ln -s /etc/hostname leak; ln -s /etc dir; mkdir real; ln -s /etc real/inner")
    for path in ("leak", "dir/hostname", "real/inner/hostname"):
        with pytest.raises(SandboxPathError):
            sandbox.read_file(path)
        with pytest.raises(SandboxPathError):
            sandbox.write_file(path, "overwritten")
    assert Path("/etc/hostname").read_text() != "overwritten"


def test_reading_a_folder_names_it(sandbox: LocalSandbox) -> None:
    # It raised IsADirectoryError naming a descriptor ("Is a directory: 22"), as the Docker one did not.
    sandbox.exec("mkdir -p folder; mkfifo pipe")
    for path in ("folder", "pipe"):
        with pytest.raises(SandboxPathError, match=f"'{path}' is not a regular file"):
            sandbox.read_file(path)


def test_output_is_capped_with_a_marker(sandbox: LocalSandbox) -> None:
    r = sandbox.exec("head -c 10000 /dev/zero | tr '\\0' a; head -c 5000 /dev/zero | tr '\\0' b >&2")
    assert r.ok and r.stdout_truncated and r.stderr_truncated
    assert r.stdout == "a" * SMALL.max_output_bytes + truncation_marker(10000 - SMALL.max_output_bytes)
    assert r.stderr.startswith("b" * SMALL.max_output_bytes) and r.stderr.endswith(truncation_marker(904))


def test_timeout_kills_the_whole_tree(sandbox: LocalSandbox) -> None:
    started = time.monotonic()
    r = sandbox.exec("sleep 100 & sleep 100 & while :; do :; done", timeout_s=0.5)
    assert r.killed_by == "timeout" and "timeout" in r.limits_hit and not r.ok
    assert 0.5 <= r.wall_s < 3 and time.monotonic() - started < 4
    assert r.cpu_s > 0.1  # the busy loop's CPU time is counted although it was killed
    assert wait_no_processes(sandbox.user.uid) == []


def test_cpu_time_limit(provider: LocalProvider) -> None:
    sb = provider.create(SMALL.model_copy(update={"cpu_time_s": 1}))
    try:
        r = sb.exec("while :; do :; done", timeout_s=20)
        assert r.killed_by == "cpu_time", r
        assert r.wall_s < 10
    finally:
        sb.close()


def test_runs_on_exactly_the_granted_cores(sandbox: LocalSandbox, provider: LocalProvider) -> None:
    core = max(provider.host_cpus)
    script = (
        "import os\n"
        "print(sorted(os.sched_getaffinity(0)))\n"
        "try:\n    os.sched_setaffinity(0, set(range(os.cpu_count())))\n"
        "except OSError as e:\n    print('refused')\n"
        "print(sorted(os.sched_getaffinity(0)))\n"
        "print(os.environ['TANGRAM_CORES'], os.environ['TANGRAM_CPU_IDS'])\n"
    )
    r = sandbox.exec(["python3", "-c", script], cores=(core,))
    lines = r.stdout.splitlines()
    assert lines[0] == f"[{core}]" and lines[-2] == f"[{core}]", r  # widening the mask does not work
    assert lines[-1] == f"1 {core}"
    layout = provider.protections.cgroups
    # The exec groups: beside the sandbox's group on v1, nested in it on v2.
    slots = f"{sandbox.id}.*" if layout.version == 1 else f"{sandbox.id}/[0-9]*"
    if layout.has("cpuset"):  # held to the core by a cpuset: no quota needed
        cpus = [
            Path(p).read_text().strip() for p in glob.glob(f"{layout.bases['cpuset']}/{slots}/cpuset.cpus")
        ]
        assert cpus == [str(core)]
    elif layout.has("cpu"):
        quota = "cpu.cfs_quota_us" if layout.version == 1 else "cpu.max"
        quotas = [Path(p).read_text().split()[0] for p in glob.glob(f"{layout.bases['cpu']}/{slots}/{quota}")]
        assert quotas == ["100000"]  # one core's worth per period


@pytest.mark.parametrize("exec_agent", [True, False], ids=["agent", "bwrap-per-command"])
def test_an_unpinned_exec_after_a_pinned_one_runs_on_every_core(
    tmp_path: Path, image_dir: Path, exec_agent: bool
) -> None:
    # On cgroup v2 an exec slot's one group both counts and pins: the next unpinned exec in the
    # slot ran on the last pinned one's core (or under its quota), and could not widen it.
    provider = LocalProvider(state_dir=str(tmp_path), image_dir=str(image_dir), exec_agent=exec_agent)
    try:
        sb = provider.create(SMALL)
        every = ",".join(str(c) for c in sorted(provider.host_cpus))
        show = "python3 -c 'import os; print(\",\".join(map(str, sorted(os.sched_getaffinity(0)))))'"
        assert sb.exec(show, cores=(max(provider.host_cpus),)).stdout.strip() == str(max(provider.host_cpus))
        r = sb.exec(show)
        assert r.ok and r.stdout.strip() == every, r
    finally:
        provider.close()


def test_elastic_exec_is_told_its_cores(sandbox: LocalSandbox, provider: LocalProvider) -> None:
    cores = tuple(sorted(provider.host_cpus))
    r = sandbox.exec("echo $TANGRAM_CORES; nproc", cores=cores)
    assert r.stdout.split() == [str(len(cores))] * 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cmd": ""}, "empty"),
        ({"cmd": []}, "non-empty list"),
        ({"cmd": ["ok", 3]}, "list of strings"),
        ({"cmd": "true", "timeout_s": 0}, "positive"),
        ({"cmd": "true", "timeout_s": float("nan")}, "positive"),
        ({"cmd": "true", "cores": (10_000,)}, "not CPUs"),
        ({"cmd": "true", "cores": ("x",)}, "CPU ids"),
    ],
)
def test_bad_requests_get_typed_errors(sandbox: LocalSandbox, kwargs: dict, message: str) -> None:
    with pytest.raises(SandboxRequestError, match=message) as info:
        sandbox.exec(**kwargs)
    assert isinstance(info.value, TangramError) and isinstance(info.value, ValueError)


def test_spec_accepts_human_units_and_rejects_nonsense() -> None:
    spec = SandboxSpec(mem_mb="512MiB", wall_timeout_s="2m", output_kill_bytes="1GiB", disk_mb="1GiB")
    assert (spec.mem_mb, spec.wall_timeout_s, spec.output_kill_bytes, spec.disk_mb) == (
        512,
        120.0,
        1 << 30,
        1024,
    )
    with pytest.raises(ValueError):
        SandboxSpec(mem_mb=0)
    with pytest.raises(ValueError):
        SandboxSpec(wall_timeout_s="soon")


def test_disk_is_capped(provider: LocalProvider) -> None:
    sb = provider.create(SMALL.model_copy(update={"disk_mb": 8}))
    try:
        r = sb.exec("head -c 20000000 /dev/zero > big; echo $?; ls -l big")
        assert r.exit_code == 0 and r.stdout.split()[0] != "0", r  # the write failed: disk full
        assert int(r.stdout.split()[5]) <= 8 << 20
    finally:
        sb.close()


def test_reset_restores_the_image(sandbox: LocalSandbox) -> None:
    sandbox.write_file("notes.txt", "agent was here")
    sandbox.exec("echo x > /tmp/t; mkdir -p deep/er")
    sandbox.reset()
    expected = ["/tmp:", *tmp_mount_points(sandbox), "/workspace:"]
    assert sandbox.exec("ls -A /workspace /tmp").stdout.split() == expected
    with pytest.raises(FileNotFoundError):
        sandbox.read_file("notes.txt")


def test_reset_keeps_memory_accounting_clean(sandbox: LocalSandbox) -> None:
    # Workspace files live in memory (tmpfs) and count against the sandbox's limit; reset frees them.
    assert sandbox.group is not None
    sandbox.exec("head -c 100000000 /dev/zero > big")
    used = int(sandbox.group.read("memory", "memory.usage_in_bytes"))
    sandbox.reset()
    assert int(sandbox.group.read("memory", "memory.usage_in_bytes")) < used - 50_000_000


def test_close_removes_everything(provider: LocalProvider) -> None:
    sb = provider.create(SMALL)
    sb.exec("echo hi > f", cores=(min(provider.host_cpus),))
    paths = [sb.dir, *(sb.group.paths.values() if sb.group else [])]
    sb.close()
    sb.close()  # twice is fine
    assert not any(os.path.exists(p) for p in paths)
    assert sb.id not in Path("/proc/self/mountinfo").read_text()
    with pytest.raises(SandboxBroken):
        sb.exec("true")


def test_a_failing_sandbox_is_marked_broken(tmp_path: Path, image_dir: Path) -> None:
    # Without an exec agent, each exec builds the sandbox anew (the agent's own failures: test_sandbox_agent).
    provider = LocalProvider(state_dir=str(tmp_path), image_dir=str(image_dir), exec_agent=False)
    sb = provider.create(SMALL)
    try:
        os.rmdir(sb.host_tmp)  # what the sandbox is built from has vanished
        with pytest.raises(SandboxBroken, match="could not start") as info:
            sb.exec("true")
        assert info.value.sandbox_id == sb.id
        assert sb.health() is not None and "could not start" in (sb.health() or "")
        with pytest.raises(SandboxBroken):
            sb.reset()
    finally:
        sb.close()
        provider.close()


def test_result_model_round_trips() -> None:
    r = ExecResult(exit_code=0, stdout="x", limits_hit=["pids"])
    assert ExecResult.model_validate_json(r.model_dump_json()) == r and r.ok
