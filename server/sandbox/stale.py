"""Clean-up of sandboxes whose server died: found by their free lock, removed with what they held."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import shutil
from typing import Any

from tangram_env.server.sandbox.cgroups import CgroupGroup
from tangram_env.server.sandbox.linux import is_mount_point, unmount


def remove_sandbox_dir(path: str, fs: str) -> None:
    """Unmount a sandbox's tmpfs (if mounted) and delete its directory."""
    with contextlib.suppress(OSError):
        if is_mount_point(fs):
            unmount(fs)
    shutil.rmtree(path, ignore_errors=True)


def sweep_stale(state_dir: str) -> int:
    """Remove sandboxes whose server died (their lock is free): processes, cgroups, mounts, files."""
    removed = 0
    for entry in os.scandir(state_dir):
        lock = os.path.join(entry.path, "lock")
        if not entry.is_dir(follow_symlinks=False) or not os.path.exists(lock):
            continue
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # alive: its creator still holds the lock
        try:
            state: dict[str, Any] = {}
            with contextlib.suppress(OSError, ValueError), open(os.path.join(entry.path, "state.json")) as f:
                state = json.load(f)
            version = state.get("cgroup_version", 1)
            for pattern in state.get("exec_globs", []):  # v1: the parts' groups beside the sandbox's
                for path in glob.glob(pattern):
                    CgroupGroup({"x": path}, version).remove()
            CgroupGroup(state.get("cgroups", {}), version).remove()  # v2: with its parts nested in it
            remove_sandbox_dir(entry.path, state.get("fs", os.path.join(entry.path, "fs")))
            removed += 1
        finally:
            os.close(fd)
    return removed
