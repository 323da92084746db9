"""The Docker provider on a real engine and the base image ``tangram/default`` (built by `.ci/run`).

Without an engine (or the image), only the clear errors are tested; nothing here ever pulls.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tangram_env.docker_build import docker_image_for
from tangram_env.sandbox import SandboxError, SandboxPathError, SandboxSpec, SandboxUnavailable

docker = pytest.importorskip("docker")

from tangram_env.server.sandbox.docker import (  # noqa: E402
    LABEL,
    OWNER_LABEL,
    DockerProvider,
    owner_is_gone,
    owner_label,
)


def _base_image_here() -> bool:
    try:
        docker.from_env().images.get("tangram/default:latest")
    except Exception:
        return False
    return True


needs_engine = pytest.mark.skipif(
    not _base_image_here(),
    reason="no Docker engine with tangram/default here (scripts/setup.sh and .ci/run make both)",
)
SPEC = SandboxSpec(
    mem_mb=128, max_pids=64, wall_timeout_s=20, max_output_bytes=4096, output_kill_bytes=1 << 20
)


@pytest.fixture(scope="module")
def provider() -> Iterator[DockerProvider]:
    made = DockerProvider()
    yield made
    made.close()


def test_image_names_map_to_docker_images() -> None:
    assert docker_image_for("default") == "tangram/default:latest"
    assert docker_image_for("Swe-Repo") == "tangram/swe-repo:latest"
    official = "swebench/sweb.eval.x86_64.django__django-11099:latest"
    assert docker_image_for(official) == official
    assert docker_image_for("default", {"default": "python:3.12-slim"}) == "python:3.12-slim"


def test_no_engine_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(SandboxUnavailable, match=r"no Docker engine answers here.*dockerd"):
        DockerProvider()


def test_owner_labels_name_live_and_dead_servers() -> None:
    label = owner_label()
    assert not owner_is_gone(label)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host, pid, start, _, boot, namespace = label.split(":")
    assert owner_is_gone(f"{host}:{dead.pid}:1")  # the labels of older servers still read
    assert owner_is_gone(f"{host}:{dead.pid}:1:0a1b2c3d")
    assert owner_is_gone(f"{host}:{dead.pid}:1:0a1b2c3d:{boot}:{namespace}")
    # A server of an earlier boot is gone, though a process of this boot has its pid and start time.
    assert owner_is_gone(f"{host}:{pid}:{start}:0a1b2c3d:an-earlier-boot:{namespace}")
    # Another PID namespace's pid names nothing here: its server cannot be looked at, so it is left alone.
    assert not owner_is_gone(f"{host}:{dead.pid}:1:0a1b2c3d:{boot}:1")
    assert not owner_is_gone(f"another-host:{dead.pid}:1")  # other hosts' containers are theirs


@pytest.mark.skipif(not shutil.which("unshare"), reason="needs unshare (util-linux)")
def test_a_server_in_another_pid_namespace_is_never_taken_for_dead() -> None:
    # Two servers on one engine and one host name, in PID namespaces of their own (containers sharing
    # the host's network and the engine's socket): the second's start-up sweep looked the first's pid up
    # in its own /proc, found another process or none, and removed the first's live containers.
    show = (
        "from tangram_env.server.sandbox.docker import owner_label; print(owner_label(), flush=True); input()"
    )
    other = subprocess.Popen(
        ["unshare", "--pid", "--kill-child", "--mount-proc", sys.executable, "-c", show],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout is not None
        label = other.stdout.readline().strip()
        if not label:
            pytest.skip(f"unshare cannot make a PID namespace here: {other.communicate()[1].strip()}")
        assert label.split(":")[1] == "1"  # the first process of its namespace
        assert not owner_is_gone(label), f"a live server of another PID namespace read as gone: {label}"
    finally:
        other.kill()
        other.communicate()


@needs_engine
def test_commands_files_limits_and_reset(provider: DockerProvider) -> None:
    box = provider.create(SPEC)
    try:
        assert box.exec("pwd").stdout.strip() == "/workspace"
        assert box.exec("python3 -c 'print(6 * 7)'").stdout == "42\n"
        box.write_file("a.txt", "hello")
        assert box.read_file("a.txt") == b"hello"
        assert box.exec(["cat", "a.txt"]).stdout == "hello"
        assert box.exec("cat", stdin=b"piped").stdout == "piped"
        with pytest.raises(FileNotFoundError):
            box.read_file("missing.txt")
        late = box.exec("sleep 30", timeout_s=1)
        assert late.killed_by == "timeout" and late.wall_s < 10
        cut = box.exec("head -c 10000 /dev/zero")
        assert cut.stdout_truncated and len(cut.stdout.encode()) < 4096 + 200 and cut.ok
        flood = box.exec("yes")
        assert flood.killed_by == "output" and flood.wall_s < 15
        assert box.exec("nproc", cores=(0,)).stdout == "1\n"  # the container's CPU set, this exec
        assert box.exec("echo $TANGRAM_CORES", cores=(0,)).stdout == "1\n"
        pid1 = box.exec("cat /proc/1/cmdline | tr '\\0' ' '").stdout
        assert "tangram-init" in pid1  # our init reaps what commands leave behind
        attrs = provider.client().api.inspect_container(box.container_id)["HostConfig"]
        assert attrs["Memory"] == 128 << 20 and attrs["MemorySwap"] == 128 << 20  # no swap
        assert attrs["PidsLimit"] == 64 and attrs["NetworkMode"] == "none"
        old = box.id
        box.reset()
        assert box.id != old and box.exec("test -e a.txt").exit_code != 0  # a fresh container
        assert box.health() is None
    finally:
        box.close()
    assert box.health() is not None  # removed


@needs_engine
def test_exec_returns_by_its_limit_though_an_escapee_holds_the_output(provider: DockerProvider) -> None:
    # The project's tools call a Docker exec from a thread of the orchestrator (bounded_exec), so it
    # must return by its limit even when a process that left the command's group keeps the stream open.
    box = provider.create(SPEC)
    try:
        assert box.bounded_exec
        t0 = time.monotonic()
        late = box.exec("setsid sleep 120 & echo started; sleep 120", timeout_s=1)
        waited = time.monotonic() - t0
        assert late.killed_by == "timeout" and late.stdout == "started\n", late
        assert waited < 1 + 2 + 3 + 3, waited  # the limit, the kill grace, the read slack, the engine
        assert box.exec("echo fine").stdout == "fine\n"  # the sandbox still serves
    finally:
        box.close()


@needs_engine
def test_links_and_directories_are_refused_by_name(provider: DockerProvider) -> None:
    # The archive of a link holds the link itself: reading one raised a bare KeyError from tarfile.
    box = provider.create(SPEC)
    try:
        box.exec("echo hi > real.txt; ln -s real.txt link.txt; ln -s missing dangling; mkdir folder")
        assert box.read_file("real.txt") == b"hi\n"
        for name in ("link.txt", "dangling"):
            with pytest.raises(SandboxPathError, match=f"{name}: it is a symbolic link"):
                box.read_file(name)
        with pytest.raises(SandboxPathError, match="folder: it is not a regular file"):
            box.read_file("folder")
    finally:
        box.close()


@needs_engine
def test_what_a_command_leaves_running_is_reaped_when_it_ends(provider: DockerProvider) -> None:
    # As the local provider does: `nohup` and `setsid` leftovers kept running between a session's
    # commands, burning cores granted to other sandboxes, and a fork bomb's held the pids limit.
    box = provider.create(SPEC)
    listing = "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"
    try:
        left = box.exec("setsid sleep 300 >/dev/null & nohup sleep 301 >/dev/null & (sleep 302 &); echo ok")
        assert left.stdout == "ok\n"
        running = box.exec(listing).stdout
        assert "tangram-init" in running and "sleep 30" not in running, running  # the container's own stays
        # One that holds the output open no longer keeps the command waiting for its limit.
        holder = box.exec("setsid sleep 300 & echo held", timeout_s=30)
        assert holder.ok and holder.stdout == "held\n" and holder.wall_s < 5, holder
        box.exec("bomb() { bomb | bomb & }; bomb; sleep 1", timeout_s=10)
        processes = box.exec("ls -d /proc/[0-9]* | wc -l")
        assert int(processes.stdout) <= 8, box.exec(listing).stdout  # init, this exec's few
    finally:
        box.close()


class _StallingProxy:
    """A unix socket in front of the Docker engine's that forwards every byte, except while stalled:
    an engine that stops answering (a stuck daemon) for this provider alone.
    """

    def __init__(self, path: str, engine: str = "/var/run/docker.sock") -> None:
        import socket
        import threading

        self.engine = engine
        self.flowing = threading.Event()
        self.flowing.set()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(self.engine)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: Any, sink: Any) -> None:
        try:
            while data := source.recv(65536):
                self.flowing.wait()
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(2)


@needs_engine
def test_an_engine_stalled_past_the_limit_is_no_time_out_of_the_command(tmp_path: Path) -> None:
    # A command that ended in a second, under a daemon that then stalled past its limit, read as
    # killed by its time limit: in a grading, a time-out is the patch's failure, so a reward of 0.0.
    import threading

    from tangram_env.sandbox import SandboxBroken

    proxy = _StallingProxy(str(tmp_path / "engine.sock"))
    stalled = DockerProvider(base_url=f"unix://{tmp_path / 'engine.sock'}", sweep=False)
    box = stalled.create(SPEC)
    try:
        assert box.exec("echo warm").stdout == "warm\n"
        threading.Timer(0.3, proxy.flowing.clear).start()
        threading.Timer(9.0, proxy.flowing.set).start()  # past the limit, the kill grace and the slack
        with pytest.raises(SandboxBroken, match="engine"):
            box.exec("sleep 1; echo done", timeout_s=2)
    finally:
        proxy.flowing.set()
        stalled.close()
        proxy.listener.close()


@needs_engine
@pytest.mark.parametrize("outside", ["kill", "restart"])
def test_a_container_killed_or_restarted_from_outside_breaks_the_sandbox(
    provider: DockerProvider, outside: str
) -> None:
    # The command's stream ended with 137, read as the command's own exit: a code env graded a right
    # answer 0.0 when its container was killed or restarted under the grading.
    import threading

    from tangram_env.sandbox import SandboxBroken

    box = provider.create(SPEC)
    try:
        assert box.exec("echo warm").ok
        client = docker.from_env()
        container = client.containers.get(box.container_id)
        act = container.kill if outside == "kill" else lambda: container.restart(timeout=0)
        threading.Timer(1.0, act).start()
        with pytest.raises(SandboxBroken, match="restarted" if outside == "restart" else "exited"):
            box.exec("sleep 10; echo done", timeout_s=20)
        assert box.health() is not None  # and the pool replaces it
        client.close()
    finally:
        box.close()


@needs_engine
def test_memory_and_pids_limits_stop_commands(provider: DockerProvider) -> None:
    box = provider.create(SPEC)
    try:
        hog = box.exec("python3 -c 'b = bytearray(400 << 20); print(len(b))'")
        assert hog.killed_by == "memory" and "memory" in hog.limits_hit
        bomb = box.exec("for i in $(seq 200); do sleep 5 & done; wait", timeout_s=15)
        assert not bomb.ok and "pids" in bomb.limits_hit
        deadline = time.monotonic() + 20  # the bomb's sleeps end within 5 s, and the pids come back
        while box.exec("echo alive").stdout != "alive\n":
            assert time.monotonic() < deadline, "the sandbox never recovered from the fork bomb"
            time.sleep(0.5)
    finally:
        box.close()


@needs_engine
def test_unknown_image_names_the_fix(provider: DockerProvider) -> None:
    with pytest.raises(SandboxUnavailable, match=r"not on this engine.*image build --docker"):
        provider.create(SandboxSpec(image="no-such-image"))


@needs_engine
def test_a_forked_child_uses_its_own_client(provider: DockerProvider) -> None:
    box = provider.create(SPEC)
    try:
        assert box.exec("echo parent").stdout == "parent\n"  # the parent's client has live connections
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(read_fd)
                os.write(write_fd, box.exec("echo child").stdout.encode())
            finally:
                os._exit(0)
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as f:
            assert f.read() == b"child\n"
        os.waitpid(pid, 0)
        assert box.exec("echo parent again").stdout == "parent again\n"
    finally:
        box.close()


@needs_engine
def test_containers_of_a_dead_server_are_swept() -> None:
    client = docker.from_env()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = owner_label().partition(":")[0]
    orphan = client.containers.run(
        "tangram/default:latest",
        ["sleep", "infinity"],
        detach=True,
        network_mode="none",
        labels={LABEL: "1", OWNER_LABEL: f"{host}:{dead.pid}:1"},
    )
    try:
        swept = DockerProvider()
        assert all(c.id != orphan.id for c in client.containers.list(all=True, filters={"label": LABEL}))
        swept.close()
    finally:
        try:
            orphan.remove(force=True)
        except docker.errors.NotFound:
            pass


@needs_engine
@pytest.mark.skipif(
    not os.environ.get("TANGRAM_SWEBENCH_INSTANCES"),
    reason="set TANGRAM_SWEBENCH_INSTANCES to a JSON/JSONL file of real SWE-bench instances to grade "
    "the first of each repository in its official image (pulled from Docker Hub)",
)
def test_official_instances_grade_with_their_gold_patch() -> None:
    from tangram_env.envs.swe_bench.grading import grade
    from tangram_env.envs.swe_bench.instance import load_instances

    firsts: dict[str, Any] = {}
    for inst in load_instances(os.environ["TANGRAM_SWEBENCH_INSTANCES"]):
        firsts.setdefault(inst.repo, inst)  # every repository, django and sympy by their own runners
    provider = DockerProvider(pull=True)
    try:
        for inst in firsts.values():
            box = provider.create(SandboxSpec(image=inst.sandbox_image, mem_mb=8192, wall_timeout_s=1800))
            assert grade(box, inst, inst.patch, timeout_s=1800)["resolved"], inst.instance_id
            box.reset()
            assert not grade(box, inst, None, timeout_s=1800)["resolved"], inst.instance_id
            box.close()
    finally:
        provider.close()


@needs_engine
def test_a_closed_providers_reaper_leaves_another_providers_containers(provider: DockerProvider) -> None:
    box = provider.create(SPEC)
    try:
        other = DockerProvider(sweep=False)
        assert other._reaper is not None
        reaper = other._reaper[0]
        other.close()
        assert reaper.wait(timeout=30) == 0  # it has removed what it owns: nothing
        assert box.exec("echo alive").stdout == "alive\n"
    finally:
        box.close()


@needs_engine
def test_a_server_starts_while_containers_are_being_removed() -> None:
    # Listing containers inspected each one after listing it: one removed in between (by its own
    # server closing, a reaper, another server's sweep) failed this server's start: "No such container".
    import threading

    client = docker.from_env()
    made = [
        client.containers.create(
            "tangram/default:latest",
            ["true"],
            network_mode="none",
            labels={LABEL: "1", OWNER_LABEL: owner_label()},
        ).id
        for _ in range(40)
    ]

    def remove_all() -> None:
        for container in made:
            client.api.remove_container(container, force=True)  # this process owns them: no sweep does

    remover = threading.Thread(target=remove_all)
    try:
        remover.start()
        while remover.is_alive():
            DockerProvider(sweep=True).close()  # raised NotFound
    finally:
        remover.join()
        client.close()


@needs_engine
def test_an_image_built_from_a_folder(tmp_path: Path) -> None:
    from tangram_env.server.sandbox.docker_build import build_docker_image

    (tmp_path / "greeting.txt").write_text("hello\n")
    name = f"test-built-{os.getpid()}"
    target = build_docker_image(name, from_dir=tmp_path, env={"GREETING_LANG": "en"})
    provider = DockerProvider(sweep=False)
    try:
        box = provider.create(SandboxSpec(image=name))
        assert box.exec("pwd; cat greeting.txt; echo $GREETING_LANG").stdout == "/workspace\nhello\nen\n"
    finally:
        provider.close()
        provider.client().images.remove(target, force=True)


@needs_engine
def test_a_directory_is_refused_before_its_archive_is_read(provider: DockerProvider) -> None:
    # A directory's archive holds its whole tree, and a sparse file makes that gigabytes on no disk:
    # the whole archive was read into the server's memory before the directory was refused.
    box = provider.create(SPEC)
    try:
        assert box.exec("mkdir d && truncate -s 300M d/sparse").ok
        tracemalloc.start()
        try:
            with pytest.raises(SandboxPathError, match="d: it is not a regular file"):
                box.read_file("d", max_bytes=1 << 20)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20, f"refusing a directory held {peak >> 20} MiB of its archive"
        assert box.read_file("d/sparse", max_bytes=None)[:4] == b"\0\0\0\0"  # a file is read whole
    finally:
        box.close()


@needs_engine
def test_leftovers_are_reaped_though_the_command_kills_its_wrapper(provider: DockerProvider) -> None:
    # The reap runs in the exec's wrapper shell, which a command may SIGKILL (same PID namespace, root):
    # what it left, a busy loop here, then burned cores between commands.
    box = provider.create(SPEC)
    kill_wrapper = (
        "sh -c 'while :; do :; done' >/dev/null 2>&1 & "
        # up from this shell to the exec's own process (its parent is outside the container): the wrapper
        'p=$$; while :; do read -r l < /proc/$p/stat; set -- ${l##*) }; [ "$2" = 0 ] && break; p=$2; done; '
        "kill -KILL $p; echo killed"
    )
    try:
        hostile = box.exec(kill_wrapper, timeout_s=10)
        assert hostile.stdout == "killed\n" and hostile.exit_code == 128 + 9, hostile
        running = box.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
        assert "while :" not in running, f"a command's busy loop outlived it: {running}"
    finally:
        box.close()


#: Commands run as the container's root that signal PID 1 or every process: each must fail as its own.
_KILLERS = {
    "kill -9 -1": "kill -9 -1",
    "term-init": "kill -TERM 1",
    "kill-init": "kill -KILL 1",
    "stop-init": "kill -STOP 1",
    "every-signal-to-every-process": (
        "python3 -c 'import os, signal\n"
        "stops = (signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)\n"
        "for s in range(1, signal.NSIG):\n"
        '    for p in os.listdir("/proc"):\n'
        "        if p.isdigit() and int(p) != os.getpid() and s not in stops:\n"
        "            try: os.kill(int(p), s)\n"
        "            except OSError: pass\n"
        "'"
    ),
    # Attached, PID 1 could be made to run exit(): it is not dumpable, so root without CAP_SYS_PTRACE cannot.
    "ptrace-init": (
        "python3 -c 'import ctypes; libc = ctypes.CDLL(None); "
        'assert libc.ptrace(16, 1, 0, 0) == -1, "attached"\''
    ),
}


@needs_engine
@pytest.mark.parametrize("command", list(_KILLERS.values()), ids=list(_KILLERS))
def test_no_command_can_stop_its_container(provider: DockerProvider, command: str) -> None:
    # Commands run as the container's root: `kill -9 -1` killed Docker's init's `sleep infinity`, and a
    # SIGTERM to PID 1 was forwarded to it; tini then exited and the container stopped, so a grading whose
    # code did so was lost to the infrastructure (no reward) instead of the 0.0 its failure earned.
    box = provider.create(SPEC)
    try:
        hit = box.exec(command, timeout_s=20)  # its own failure, or none: never a broken sandbox
        assert "attached" not in hit.stderr, hit
        assert box.health() is None
        assert box.exec("echo alive").stdout == "alive\n"
        assert "tangram-init" in box.exec("tr '\\0' ' ' < /proc/1/cmdline").stdout
    finally:
        box.close()


@needs_engine
def test_an_image_without_python3_falls_back_to_dockers_init(caplog: pytest.LogCaptureFixture) -> None:
    # Our init needs python3; without it the container runs `sleep infinity` under Docker's init, which
    # still reaps what commands leave (though a command inside can stop it, as the warning says).
    name = f"test-no-python-{os.getpid()}"
    _build_image(f"tangram/{name}:latest", "FROM tangram/default:latest\nRUN rm /usr/bin/python3\n")
    provider = DockerProvider(sweep=False)
    try:
        with caplog.at_level("WARNING"):
            box = provider.create(SandboxSpec(image=name))
        assert "has no python3" in caplog.text
        assert box.exec("echo runs").stdout == "runs\n"
        assert box.exec("setsid sleep 300 >/dev/null & echo left").stdout == "left\n"
        running = box.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
        assert "sleep infinity" in running and "sleep 300" not in running, running
        box.reset()  # the image is known now: straight to the fallback
        assert box.exec("echo again").stdout == "again\n"
    finally:
        provider.close()
        provider.client().images.remove(f"tangram/{name}:latest", force=True)


def _build_image(tag: str, dockerfile: str, files: dict[str, tuple[str, int]] | None = None) -> None:
    """Build ``tag`` here from ``dockerfile`` and ``files`` (name: text and mode), with no registry."""
    import tarfile

    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        for name, (text, mode) in {"Dockerfile": (dockerfile, 0o644), **(files or {})}.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(text.encode()), mode
            tar.addfile(info, io.BytesIO(text.encode()))
    context.seek(0)
    docker.from_env().images.build(fileobj=context, custom_context=True, tag=tag, rm=True)


@needs_engine
def test_an_image_with_an_entrypoint_runs_commands() -> None:
    # Its ENTRYPOINT took the container's own process for arguments: the container exited at once, and
    # the sandbox failed with "its own process ... is not running".
    name = f"test-entrypoint-{os.getpid()}"
    _build_image(f"tangram/{name}:latest", 'FROM tangram/default:latest\nENTRYPOINT ["false"]\n')
    provider = DockerProvider(sweep=False)
    try:
        box = provider.create(SandboxSpec(image=name))
        assert box.exec("echo runs").stdout == "runs\n"
        assert "tangram-init" in box.exec("tr '\\0' ' ' < /proc/1/cmdline").stdout  # ours, not the image's
    finally:
        provider.close()
        provider.client().images.remove(f"tangram/{name}:latest", force=True)


@needs_engine
def test_a_container_that_fails_its_preparation_is_removed() -> None:
    # A container whose first exec failed stayed until the server exited: one made by create (no
    # sandbox held it), and the previous container of a reset (the last session's files and processes).
    name = f"test-no-keeper-{os.getpid()}"
    # The container's own process ends at once: our init (its python3), then the fallback's sleep.
    ends = ("#!/bin/sh\nexit 0\n", 0o755)
    _build_image(
        f"tangram/{name}:latest",
        "FROM tangram/default:latest\nCOPY sleep /usr/bin/sleep\nCOPY python3 /usr/local/bin/python3\n",
        {"sleep": ends, "python3": ends},
    )
    provider = DockerProvider(sweep=False)
    client = provider.client()

    def left() -> list[str]:
        mine = {"label": f"{OWNER_LABEL}={provider.owner}"}
        return [c["Id"][:12] for c in client.api.containers(all=True, filters=mine)]

    try:
        with pytest.raises(SandboxError, match="not running"):
            provider.create(SandboxSpec(image=name))
        assert left() == [], "a container that failed its preparation in create was left"
        box = provider.create(SPEC)
        box.write_file("notes.txt", "the last session's")
        box.spec = SandboxSpec(image=name)  # its next container fails its preparation
        with pytest.raises(SandboxError, match="not running"):
            box.reset()
        assert left() == [], "a reset whose new container failed left the old one (or the new one)"
        assert box.health() is not None  # broken: its pool discards it
    finally:
        provider.close()
        client.images.remove(f"tangram/{name}:latest", force=True)


@needs_engine
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs")
def test_concurrent_execs_share_the_union_of_their_cores(provider: DockerProvider) -> None:
    # Each exec set the container's CPU set to its own cores, moving the other exec running at once
    # onto them (and both under one core's quota).
    box = provider.create(SPEC)
    allowed = "$(grep Cpus_allowed_list /proc/self/status | cut -f2)"
    seen: dict[str, str] = {}

    def run(me: str, other: str, core: int, then: str) -> None:
        # Each reads its CPU set once both run, then waits until the other has read its own.
        seen[me] = box.exec(
            f"touch /tmp/{me}; until [ -e /tmp/{other} ]; do sleep 0.05; done; echo {allowed}; "
            f"touch /tmp/{me}.read; until [ -e /tmp/{other}.read ]; do sleep 0.05; done; {then}",
            timeout_s=20,
            cores=(core,),
        ).stdout

    # The second then waits (up to 10 s) for the first to end, and the CPU set to shrink to its own core.
    shrunk = f'for i in $(seq 100); do [ "{allowed}" = 1 ] && break; sleep 0.1; done; echo {allowed}'
    try:
        threads = [
            threading.Thread(target=run, args=("a", "b", 0, "true")),
            threading.Thread(target=run, args=("b", "a", 1, shrunk)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert (seen["a"], seen["b"]) == ("0-1\n", "0-1\n1\n"), seen
        assert box.exec("nproc", cores=(0,)).stdout == "1\n"
    finally:
        box.close()
