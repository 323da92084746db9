"""cgroup v2 against the kernel's own unified hierarchy, where one is mounted and writable.

Hosts in hybrid mode (cgroup v1 for the controllers, plus a cgroup2 mount, as the development
machines) offer v2 no controller that v1 holds: memory, pids, cpu and cpuset cannot be tested here,
and a v1 hierarchy cannot be unmounted under Docker. What runs for real: discovery under our own
group, the move of a process that sits alone in its group into a leaf (the kernel's "no internal
processes" refusal, with hugetlb standing in for the controllers v1 holds), a shared group left
alone for the hierarchy's root, sandbox and exec groups
nested as the local provider makes them, a process moved into an exec group, its CPU time read
from the exec group's ``cpu.stat``, and the groups killed and removed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tangram_env.server.sandbox.cgroups import CgroupGroup, CgroupLayout, _parse_v2_mount

ROOT = Path(__file__).resolve().parents[3]


def _unified_mount() -> str | None:
    with open("/proc/self/mountinfo") as f:
        found = _parse_v2_mount(f.read())
    if found is None or found[1] != "/":
        return None
    mount = found[0]
    return mount if os.access(mount, os.W_OK) else None


MOUNT = _unified_mount()
pytestmark = pytest.mark.skipif(
    MOUNT is None or os.geteuid() != 0, reason="no writable cgroup2 mount (needs root and a v2 hierarchy)"
)


@pytest.fixture
def own() -> Iterator[str]:
    """A group of our own in the real unified hierarchy (removed with everything in it afterwards)."""
    assert MOUNT is not None
    path = os.path.join(MOUNT, f"tangram-test-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    os.mkdir(path)
    yield path
    assert CgroupGroup({"cpuacct": path}, version=2).remove(), f"{path} stayed"


@pytest.fixture
def hugetlb_offered(own: str) -> Iterator[None]:
    """hugetlb offered to our group: enabled for the root's children, if it was not, and only for the
    test (no v1 hierarchy holds it here, nobody sets hugetlb limits; its limits stay at max).
    """
    assert MOUNT is not None
    root_control = Path(MOUNT, "cgroup.subtree_control")
    if "hugetlb" not in Path(MOUNT, "cgroup.controllers").read_text().split():
        pytest.skip("the unified hierarchy offers no controller to delegate here")
    enabled_here = "hugetlb" not in root_control.read_text().split()
    if enabled_here:
        root_control.write_text("+hugetlb")
    try:
        yield  # our group may now enable it for its children: once it holds no process of its own
    finally:
        if enabled_here:
            CgroupGroup({"cpuacct": own}, version=2).remove()  # the controller goes only when unused
            try:
                root_control.write_text("-hugetlb")
            except OSError:  # another group started using it meanwhile: leave it on
                pass


def _discover_in_child(own: str, controllers: tuple[str, ...], companion: bool = False) -> dict[str, object]:
    """Run discovery in a child placed in ``own`` (never moving the test process itself)."""
    script = f"""
import json, os, sys
from tangram_env.server.sandbox import cgroups
cgroups.V2_CONTROLLERS = {controllers!r}
own = sys.argv[1]
with open(os.path.join(own, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
layout = cgroups.CgroupLayout._discover_v2({MOUNT!r}, "/", "/" + os.path.relpath(own, {MOUNT!r}))
with open("/proc/self/cgroup") as f:
    mine = [line for line in f.read().splitlines() if line.startswith("0::")][0]
print(json.dumps({{"bases": layout.bases, "version": layout.version, "mine": mine}}))
"""
    sleeper = None
    if companion:  # another process shares the group
        sleeper = subprocess.Popen(["sleep", "60"])
        Path(own, "cgroup.procs").write_text(str(sleeper.pid))
    try:
        out = subprocess.run(
            [sys.executable, "-c", script, own],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=60,
        )
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_a_process_alone_in_its_group_moves_to_a_leaf_and_delegates(own: str, hugetlb_offered: None) -> None:
    found = _discover_in_child(own, ("hugetlb",))
    base = os.path.join(own, "tangram")
    assert found["version"] == 2 and found["bases"] == {"hugetlb": base, "cpuacct": base}
    rel = "/" + os.path.relpath(own, MOUNT)
    assert found["mine"] == f"0::{rel}/tangram-server"  # it left the group that now delegates
    assert "hugetlb" in Path(own, "cgroup.subtree_control").read_text().split()
    assert "hugetlb" in Path(base, "cgroup.subtree_control").read_text().split()


def test_a_group_shared_with_other_processes_is_left_alone(own: str, hugetlb_offered: None) -> None:
    # A login session's group (the shell beside a server root started): enabling controllers there
    # would mean moving the shell. Nobody is moved; as root, the base goes under the hierarchy's
    # root instead (before, the sandboxes got no cgroup at all: no memory limit but rlimits).
    assert MOUNT is not None
    top = os.path.join(MOUNT, "tangram")
    existed = os.path.isdir(top)
    try:
        found = _discover_in_child(own, ("hugetlb",), companion=True)
        assert found["bases"] == {"hugetlb": top, "cpuacct": top} and found["version"] == 2
        assert found["mine"] == "0::/" + os.path.relpath(own, MOUNT)
        assert not os.path.exists(os.path.join(own, "tangram-server"))
    finally:
        if not existed:
            CgroupGroup({"cpuacct": top}, version=2).remove()


def test_exec_groups_nest_count_cpu_time_and_are_removed(own: str) -> None:
    base = os.path.join(own, "tangram")
    os.mkdir(base)
    layout = CgroupLayout({"cpuacct": base}, version=2)
    sandbox = layout.group("sb-1")
    slot = layout.group("sb-1.0", ("cpuacct",))
    assert set(slot.paths.values()) == {os.path.join(base, "sb-1", "0")}  # nested, as v2 requires
    slot.write("cpuacct", "cpuacct.usage", 0)  # counted from here (v2 cannot reset it)
    burner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt=time.process_time()\nwhile time.process_time()-t<0.3: pass\ntime.sleep(60)",
        ]
    )
    try:
        for procs in slot.procs_files():
            Path(procs).write_text(str(burner.pid))
        assert slot.pids() == {burner.pid} and sandbox.pids() == {burner.pid}
        deadline = time.monotonic() + 30
        while int(slot.read("cpuacct", "cpuacct.usage") or 0) < 250_000_000 and time.monotonic() < deadline:
            time.sleep(0.05)
        used_ns = int(slot.read("cpuacct", "cpuacct.usage"))
        assert 250_000_000 <= used_ns < 30_000_000_000, used_ns  # its CPU time, read from the kernel
        assert sandbox.kill_all(5.0) and burner.wait(5) == -9
    finally:
        burner.kill()
        burner.wait()
    assert layout.slot_indices("sb-1") == {0}
    assert sandbox.remove() and not os.path.exists(os.path.join(base, "sb-1"))


def test_a_command_joins_its_exec_group_through_a_descriptor_it_was_given(own: str) -> None:
    # The exec agent's child moves itself: it writes 0 to descriptors the server opened (on v2, the
    # exec group's cgroup.procs), closes them and execs; the command runs in the group from its start.
    base = os.path.join(own, "tangram")
    os.mkdir(base)
    layout = CgroupLayout({"cpuacct": base}, version=2)
    layout.group("sb-2")
    slot = layout.group("sb-2.0", ("cpuacct",))
    files = slot.join_files(("cpuacct",))
    assert files == [os.path.join(base, "sb-2", "0", "cgroup.procs")]
    fds = [os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in files]
    script = (
        "import os, sys\n"
        "for fd in map(int, sys.argv[1:]):\n"
        "    os.write(fd, b'0'); os.close(fd)\n"
        "os.execvp('cat', ['cat', '/proc/self/cgroup'])\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", script, *map(str, fds)],
            capture_output=True,
            text=True,
            check=True,
            pass_fds=fds,
            timeout=60,
        )
    finally:
        for fd in fds:
            os.close(fd)
    rel = "/" + os.path.relpath(os.path.join(base, "sb-2", "0"), MOUNT)
    assert f"0::{rel}" in out.stdout.splitlines(), out.stdout
    assert slot.remove() and layout.group("sb-2").remove()
