"""cgroup v2 (unified hierarchy), tested against a temporary directory laid out like a v2 cgroupfs:
the development machines run v1, so this checks the v2 file names and formats, the nesting of exec
groups and the delegation through ``cgroup.subtree_control``, not a real v2 kernel."""

from __future__ import annotations

import os
from pathlib import Path

from tangram_env.server.sandbox.cgroups import CgroupLayout
from tangram_env.server.sandbox.execgroups import ExecSlots

KERNEL_FILES = {  # what the kernel puts in every v2 group (the ones these tests look at)
    "cgroup.procs": "",
    "cgroup.subtree_control": "",
    "cgroup.controllers": "cpuset cpu io memory pids",
    "memory.max": "max",
    "memory.swap.max": "max",
    "memory.events": "low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n",
    "pids.max": "max",
    "pids.events": "max 1\n",
    "cpu.max": "max 100000",
    "cpuset.cpus": "",
    "cpu.stat": "usage_usec 5000\nuser_usec 4000\nsystem_usec 1000\n",
}


def _group_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in KERNEL_FILES.items():
        (path / name).write_text(text)
    return path


def _layout(tmp_path: Path) -> tuple[CgroupLayout, Path]:
    mount = tmp_path / "cgroup"
    own = _group_dir(mount / "system.slice" / "tangram.service")
    (own / "cgroup.procs").write_text(f"{os.getpid()}\n")
    base = _group_dir(own / "tangram")
    _group_dir(base / "sb-1")
    _group_dir(base / "sb-1" / "0")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"30 25 0:26 / {mount} rw,nosuid,nodev,noexec - cgroup2 cgroup2 rw,nsdelegate\n")
    proc_cgroup = tmp_path / "cgroup.txt"
    proc_cgroup.write_text("0::/system.slice/tangram.service\n")
    return CgroupLayout.discover(str(mountinfo), str(proc_cgroup)), base


def test_discovery_delegates_the_controllers_down_to_the_base(tmp_path: Path) -> None:
    layout, base = _layout(tmp_path)
    assert layout.version == 2
    assert layout.bases == {c: str(base) for c in ("memory", "pids", "cpu", "cpuset", "cpuacct")}
    wanted = "+memory +pids +cpu +cpuset"
    assert (base.parent / "cgroup.subtree_control").read_text() == wanted
    assert (base / "cgroup.subtree_control").read_text() == wanted


def test_sandbox_limits_and_counters_use_v2_files(tmp_path: Path) -> None:
    layout, base = _layout(tmp_path)
    group = layout.group("sb-1", ("memory", "pids"))
    box = base / "sb-1"
    assert (box / "cgroup.subtree_control").read_text() == "+cpu +cpuset"  # handed down to execs
    group.write("memory", "memory.limit_in_bytes", 256 << 20)
    group.write("memory", "memory.memsw.limit_in_bytes", 256 << 20)  # v1: memory + swap
    group.write("pids", "pids.max", 64)
    assert (box / "memory.max").read_text() == str(256 << 20)
    assert (box / "memory.swap.max").read_text() == "0"  # v2: swap alone, so none
    assert (box / "pids.max").read_text() == "64"
    assert group.counter("memory", "memory.oom_control", "oom_kill") == 2  # from memory.events
    assert group.counter("pids", "pids.events", "max") == 1
    assert group.procs_files() == []  # its execs' groups hold the processes


def test_exec_groups_nest_under_their_sandbox(tmp_path: Path) -> None:
    layout, base = _layout(tmp_path)
    layout.group("sb-1", ("memory", "pids"))
    slot = layout.group("sb-1.0", ("cpuacct", "cpuset", "cpu"))
    exec_dir = base / "sb-1" / "0"
    assert set(slot.paths.values()) == {str(exec_dir)}
    assert slot.procs_files() == [str(exec_dir / "cgroup.procs")]  # one group per process on v2
    slot.write("cpuset", "cpuset.cpus", "0-1")
    slot.write("cpu", "cpu.cfs_period_us", 100_000)
    slot.write("cpu", "cpu.cfs_quota_us", 200_000)
    assert (exec_dir / "cpuset.cpus").read_text() == "0-1"
    assert (exec_dir / "cpu.max").read_text() == "200000 100000"  # two cores' worth per period
    slot.write("cpuacct", "cpuacct.usage", 0)  # v2 cannot reset usage: counted from here
    (exec_dir / "cpu.stat").write_text("usage_usec 7500\nuser_usec 6000\nsystem_usec 1500\n")
    assert slot.read("cpuacct", "cpuacct.usage") == str(2_500 * 1000)  # nanoseconds, as v1 gives
    slots = ExecSlots(layout, "sb-1", str(tmp_path / "locks"))
    assert slots._indices() == [0]
    slots.prepare(1)
    claim = slots.claim()
    assert claim is not None and set(claim.group.paths.values()) == {str(exec_dir)}
    slots.release(claim)


def test_a_v1_host_keeps_the_v1_layout(tmp_path: Path) -> None:
    mount = tmp_path / "memory"
    own = mount / "tangram-test"
    own.mkdir(parents=True)
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        f"40 25 0:35 / {mount} rw,nosuid - cgroup cgroup rw,memory\n"
        f"30 25 0:26 / {tmp_path / 'unified'} rw - cgroup2 cgroup2 rw\n"
    )
    proc_cgroup = tmp_path / "cgroup.txt"
    proc_cgroup.write_text("9:memory:/tangram-test\n0::/\n")
    layout = CgroupLayout.discover(str(mountinfo), str(proc_cgroup))
    assert layout.version == 1 and layout.bases == {"memory": str(own / "tangram")}
