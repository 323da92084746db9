"""The local provider on a pure cgroup v2 host (every controller on the unified hierarchy), as most
users' hosts are. The development and CI machines are hybrid, so these run there inside a QEMU guest
that boots a v2-only kernel (``scripts/cgroup_v2_guest.sh``, which ``.ci/run`` calls); elsewhere
they are skipped. The limits themselves are the other sandbox tests' (memory, fork bombs, CPU), which
run in that guest too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tangram_env.server.sandbox.cgroups import CgroupGroup, _parse_mounts, _parse_v2_mount
from tangram_env.server.sandbox.local import LocalProvider, LocalSandbox
from tests.server.sandbox.helpers import SMALL

ROOT = Path(__file__).resolve().parents[3]


def _pure_v2() -> bool:
    """No controller on a v1 hierarchy, and the ones sandboxes use offered by the unified one."""
    mountinfo = Path("/proc/self/mountinfo").read_text()
    unified = _parse_v2_mount(mountinfo)
    if _parse_mounts(mountinfo) or unified is None:
        return False
    offered = Path(unified[0], "cgroup.controllers").read_text().split()
    return {"memory", "pids", "cpu", "cpuset"} <= set(offered)


pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not _pure_v2(),
    reason="not root on a pure cgroup v2 host (run it in scripts/cgroup_v2_guest.sh)",
)


@pytest.fixture
def sandbox(provider: LocalProvider) -> Iterator[LocalSandbox]:
    sb = provider.create(SMALL)
    yield sb
    sb.close()


def _procs(path: str) -> set[int]:
    return {int(p) for p in Path(path, "cgroup.procs").read_text().split()}


def test_sandboxes_keep_an_exec_agent(provider: LocalProvider) -> None:
    # Before, v2 hosts got a bubblewrap per command: no background processes, no warm judge.
    assert provider.protections.cgroups.moves_by_opener()
    assert provider.exec_agent


def test_everything_of_a_sandbox_lives_inside_its_limits(sandbox: LocalSandbox) -> None:
    # The sandbox's group holds the memory and process limits and no process of its own (it hands
    # the CPU controllers down); the agent, each exec and what is kept in the background are leaves
    # nested in it, so every one of them counts against the limits.
    assert sandbox.group is not None
    top = sandbox.group.paths["memory"]
    assert Path(top, "memory.max").read_text().strip() == str(SMALL.mem_mb << 20)
    assert Path(top, "pids.max").read_text().strip() == str(SMALL.max_pids)
    assert set(Path(top, "cgroup.subtree_control").read_text().split()) >= {"cpu", "cpuset"}
    assert _procs(top) == set()
    agent = os.path.join(top, "agent")
    assert len(_procs(agent)) >= 3  # bubblewrap, its init, the agent (and its spare)
    core = max(os.sched_getaffinity(0))
    r = sandbox.exec("cat /proc/self/cgroup; sleep 60 >/dev/null 2>&1 &", cores=(core,), background=True)
    assert r.ok and r.stdout.strip() == "0::/../0", r  # seen from the agent's cgroup namespace
    assert Path(top, "0", "cpuset.cpus").read_text().strip() == str(core)
    kept = _procs(os.path.join(top, "bg"))
    assert len(kept) == 1 and _procs(os.path.join(top, "0")) == set()
    assert sandbox.group.pids() >= kept | _procs(agent)
    sandbox.reset()  # what was kept goes with a reset
    assert _procs(os.path.join(top, "bg")) == set()


def test_a_server_started_from_a_login_shell_still_limits_its_sandboxes(tmp_path: Path) -> None:
    # Root starts the server from a shell: its group (the session's) holds the shell too, and cannot
    # hand controllers down without moving it. The sandboxes' groups go under the hierarchy's root;
    # before, they got no group at all (memory unlimited but for rlimits, and no exec agent).
    session = Path("/sys/fs/cgroup", f"test-session-{os.getpid()}.scope")
    session.mkdir()
    shell = subprocess.Popen(["sleep", "120"])
    script = f"""
import json, os
from tangram_env.server.sandbox.local import LocalProvider
from tests.server.sandbox.helpers import SMALL
with open("{session}/cgroup.procs", "w") as f:
    f.write(str(os.getpid()))
provider = LocalProvider(state_dir={str(tmp_path)!r})
sb = provider.create(SMALL)
top = sb.group.paths["memory"]
out = {{"agent": provider.exec_agent, "top": top, "max": open(top + "/memory.max").read().strip(),
        "ran": sb.exec("echo hi").stdout, "mine": open("/proc/self/cgroup").read().strip()}}
sb.close()
provider.close()
print(json.dumps(out))
"""
    try:
        (session / "cgroup.procs").write_text(str(shell.pid))
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False, cwd=ROOT
        )
        assert done.returncode == 0, done.stderr[-2000:]
        found = json.loads(done.stdout)
    finally:
        shell.kill()
        shell.wait()
        CgroupGroup({"cpuacct": str(session)}, version=2).remove()
    assert found["top"].startswith("/sys/fs/cgroup/tangram/sb-"), found
    assert found["max"] == str(SMALL.mem_mb << 20) and found["agent"] and found["ran"] == "hi\n", found
    assert found["mine"] == f"0::/{session.name}", found  # the server itself was not moved


def test_a_server_in_a_container_delegates_from_its_cgroup_namespace() -> None:
    # A privileged container on a v2 host: the container's group is the root of its cgroup namespace
    # and holds every process of the container (here its init, a sleep). The server moves them all
    # into a leaf ``init`` (as Docker-in-Docker does) and makes its groups beside it; before, the
    # sandboxes got no group at all.
    container = Path("/sys/fs/cgroup", f"test-container-{os.getpid()}")
    container.mkdir()
    init = subprocess.Popen(["sleep", "120"])
    script = (
        "import json\n"
        "from tangram_env.server.sandbox.cgroups import CgroupLayout\n"
        "layout = CgroupLayout.discover()\n"
        "print(json.dumps({'bases': layout.bases, 'mine': open('/proc/self/cgroup').read().strip()}))\n"
    )
    # Join the container's group, then take a cgroup namespace, and a cgroup2 mount, rooted there.
    remount = "umount /sys/fs/cgroup && mount -t cgroup2 cgroup2 /sys/fs/cgroup"
    inside = (
        f"echo $$ > {container}/cgroup.procs && exec unshare --cgroup --mount --propagation private "
        f'sh -c \'{remount} && exec {sys.executable} -c "$0"\' "$0"'
    )
    try:
        (container / "cgroup.procs").write_text(str(init.pid))
        done = subprocess.run(
            ["sh", "-c", inside, script], capture_output=True, text=True, timeout=120, check=False, cwd=ROOT
        )
        assert done.returncode == 0, done.stderr[-2000:]
        found = json.loads(done.stdout)
        init_group = Path(f"/proc/{init.pid}/cgroup").read_text().strip()
    finally:
        init.kill()
        init.wait()
        CgroupGroup({"cpuacct": str(container)}, version=2).remove()
    assert found["bases"]["memory"] == "/sys/fs/cgroup/tangram", found  # the namespace's view
    assert found["mine"] == "0::/init" and init_group == f"0::/{container.name}/init", (found, init_group)
