"""The Docker provider on a real engine and the base image ``tangram/default`` (built by `.ci/run`).

Without an engine (or the image), only the clear errors are tested; nothing here ever pulls.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tangram_env.docker_build import docker_image_for
from tangram_env.sandbox import SandboxPathError, SandboxSpec, SandboxUnavailable

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
    assert not owner_is_gone(owner_label())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host, _, _ = owner_label().partition(":")
    assert owner_is_gone(f"{host}:{dead.pid}:1")
    assert owner_is_gone(f"{host}:{dead.pid}:1:0a1b2c3d") and not owner_is_gone(owner_label())
    assert not owner_is_gone(f"another-host:{dead.pid}:1")  # other hosts' containers are theirs


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
        assert "init" in pid1  # Docker's init reaps what commands leave behind
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
        assert "sleep infinity" in running and "sleep 30" not in running, running  # the container's own stays
        # One that holds the output open no longer keeps the command waiting for its limit.
        holder = box.exec("setsid sleep 300 & echo held", timeout_s=30)
        assert holder.ok and holder.stdout == "held\n" and holder.wall_s < 5, holder
        box.exec("bomb() { bomb | bomb & }; bomb; sleep 1", timeout_s=10)
        processes = box.exec("ls -d /proc/[0-9]* | wc -l")
        assert int(processes.stdout) <= 8, box.exec(listing).stdout  # init, its sleep, this exec's few
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
