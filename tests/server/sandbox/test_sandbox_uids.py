"""Sandbox uid leases: a uid goes to one sandbox at a time, and never to one while a process runs as it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tangram_env.server.sandbox.uids import UidLeases

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="running a process as another uid needs root")


def test_a_uid_a_process_still_runs_as_is_not_leased(tmp_path: Path) -> None:
    # A crashed server's lock is gone at once, but what its sandboxes left runs on until it is cleaned
    # up: leased again, that uid would give the next sandbox's code to them to signal, trace and read.
    base = 3_900_000 + os.getpid() % 10_000 * 2
    leftover = subprocess.Popen(["sleep", "60"], user=base, group=base)
    try:
        leases = UidLeases(base, 2, lock_dir=str(tmp_path))
        uid, fd = leases.lease()
        assert uid == base + 1
        UidLeases.release(fd)
    finally:
        leftover.kill()
        leftover.wait()
    uid, fd = UidLeases(base, 2, lock_dir=str(tmp_path)).lease()
    assert uid == base  # free once nothing runs as it
    UidLeases.release(fd)
