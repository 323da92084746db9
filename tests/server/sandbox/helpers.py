"""Helpers for the sandbox tests: the limits they run under, and checks of what a sandbox left behind."""

from __future__ import annotations

import os
import time

from tangram_env.sandbox import SandboxSpec
from tangram_env.server.sandbox.local import LocalSandbox

#: The limits most tests run under: small enough that bombs end fast.
SMALL = SandboxSpec(
    mem_mb=256, max_pids=64, wall_timeout_s=10, max_output_bytes=4096, output_kill_bytes=8 << 20
)


def processes_of_uid(uid: int) -> list[int]:
    """Host pids whose real uid is ``uid`` (what a sandbox left running, if anything)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            found.append(int(entry))
                        break
        except OSError:
            continue
    return found


def processes_running(needle: str) -> list[int]:
    """Host pids whose command line contains ``needle`` (a command's unusual argument)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if needle.encode() in f.read().replace(b"\0", b" "):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def wait_no_processes(uid: int, timeout_s: float = 2.0) -> list[int]:
    """Poll until no host process runs as ``uid`` (dying ones take a moment); what is left."""
    deadline = time.monotonic() + timeout_s
    left = processes_of_uid(uid)
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = processes_of_uid(uid)
    return left


def tmp_mount_points(sb: LocalSandbox) -> list[str]:
    """What /tmp shows in a clean sandbox: the mount points of image paths under the host's /tmp
    (a checkout living there), nothing else."""
    return sorted({p.split("/")[2] for p in sb.image.host_paths() if p.startswith("/tmp/")})


def assert_clean(sb: LocalSandbox) -> None:
    """After an attack: reset, then the sandbox holds no process and an empty workspace and tmp."""
    sb.reset()
    assert wait_no_processes(sb.user.uid) == []
    r = sb.exec("ls -A /tmp /workspace; ls /proc | grep -c '^[0-9]'")
    assert r.exit_code == 0, r
    lines = r.stdout.split()
    # Only the listings' headers (and image mount points) remain, and the processes of this very
    # command (sh, ls, grep) beside the sandbox's init, its exec agent and the agent's spare child.
    head = ["/tmp:", *tmp_mount_points(sb), "/workspace:"]
    assert lines[: len(head)] == head, r.stdout
    assert int(lines[-1]) <= 6, r.stdout
