"""Provider selection, protection detection, the unisolated opt-out, and clean-up after a crash."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from tangram_env.errors import UnknownNameError
from tangram_env.sandbox import SandboxSpec, SandboxUnavailable
from tangram_env.server.sandbox import detect_protections, make_provider
from tangram_env.server.sandbox.local import LocalProvider
from tangram_env.server.sandbox.protections import host_protections
from tangram_env.server.sandbox.unisolated import UnisolatedProvider
from tests.server.sandbox.helpers import SMALL, wait_no_processes


def test_detect_protections_names_each_one() -> None:
    found = detect_protections()
    assert all(isinstance(v, bool) for v in found.values())
    expected = {"bwrap", "pid_namespace", "net_namespace", "mount_namespace", "uid_drop", "cgroup_memory"}
    assert expected <= set(found)


def test_refuses_to_start_without_isolation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no bubblewrap to be found
    with pytest.raises(SandboxUnavailable, match=r"bubblewrap.*make_provider\('none'\)"):
        LocalProvider(state_dir=str(tmp_path / "state"))
    assert host_protections(str(tmp_path / "state")).as_dict()["bwrap"] is False


def test_logs_what_it_found(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tangram_env.server.sandbox"):
        provider = make_provider("local", state_dir=str(tmp_path / "s"))
    provider.close()
    assert any(
        "sandbox protections:" in r.message and "net_namespace=on" in r.message for r in caplog.records
    )


def test_none_is_an_explicit_opt_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        provider = make_provider("none", state_dir=str(tmp_path / "none"))
        sb = provider.create(SMALL)
    assert isinstance(provider, UnisolatedProvider)
    assert any("WITHOUT isolation" in r.message for r in caplog.records)
    try:
        r = sb.exec("pwd; echo $TANGRAM_CORES", cores=(0,))
        assert r.stdout.split() == [sb.workspace, "1"]
        sb.write_file("f.txt", "x")
        assert sb.read_file("f.txt") == b"x" and Path(sb.workspace, "f.txt").read_text() == "x"
        assert sb.exec("while :; do :; done", timeout_s=0.5).killed_by == "timeout"
        assert sb.exec("head -c 20000000 /dev/zero").killed_by == "output"
        sb.reset()
        assert os.listdir(sb.workspace) == []
    finally:
        provider.close()
    assert not Path(sb.dir).exists()


def test_a_crashed_server_is_cleaned_up_by_the_next(tmp_path: Path) -> None:
    state = str(tmp_path / "crash")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # a server that dies without closing anything, its sandbox mid-command
        try:
            provider = LocalProvider(state_dir=state)
            sb = provider.create(SMALL)
            sb.exec("echo data > f")
            os.write(write_fd, f"{sb.id} {sb.user.uid}".encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    sandbox_id, uid = os.read(read_fd, 100).decode().split()
    os.close(read_fd)
    os.waitpid(pid, 0)
    assert os.path.isdir(os.path.join(state, sandbox_id))
    assert sandbox_id in Path("/proc/self/mountinfo").read_text()
    successor = LocalProvider(state_dir=state)  # sweeps what the dead one left
    try:
        assert not os.path.exists(os.path.join(state, sandbox_id))
        assert sandbox_id not in Path("/proc/self/mountinfo").read_text()
        bases = successor.protections.cgroups.bases.values()
        assert not [b for b in bases if any(e.startswith(sandbox_id) for e in os.listdir(b))]
        assert wait_no_processes(int(uid)) == []
        sb = successor.create(SandboxSpec())  # its uid can be leased again
        sb.close()
    finally:
        successor.close()
        shutil.rmtree(state, ignore_errors=True)


def test_docker_is_selectable_by_name_and_says_what_it_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")  # as on a host without one
    with pytest.raises(SandboxUnavailable, match="Docker"):  # not "no sandbox provider named"
        make_provider("docker")


def test_a_provider_named_by_module_and_class(tmp_path: Path) -> None:
    name = "tangram_env.server.sandbox.unisolated:UnisolatedProvider"
    provider = make_provider(name, state_dir=str(tmp_path / "state"))
    try:
        assert provider.name == "none"
    finally:
        provider.close()
    with pytest.raises(UnknownNameError, match="cannot load the sandbox provider"):
        make_provider("tangram_env.server.sandbox.unisolated:Nope")


def test_a_provider_declared_by_another_package_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real installed-package layout: a module and a dist-info folder with its entry points.
    (tmp_path / "myprov.py").write_text(
        "from tangram_env.server.sandbox.unisolated import UnisolatedProvider\n"
        "class MyProvider(UnisolatedProvider):\n"
        "    name = 'mine'\n"
    )
    dist = tmp_path / "myprov-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myprov\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[tangram_env.sandbox_providers]\nmine = myprov:MyProvider\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from tangram_env.server.sandbox.providers import provider_names

    assert "mine" in provider_names()
    provider = make_provider("mine", state_dir=str(tmp_path / "state"))
    try:
        assert type(provider).__name__ == "MyProvider" and provider.name == "mine"
    finally:
        provider.close()
