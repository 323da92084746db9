"""A patch that fills the grading sandbox's disk, for real in a small local sandbox: what its
application leaves is its own doing, so a patch that leaves the grader no room to set the tests up
grades 0.0 with the reason, not "no reward". A sandbox already too full before the patch is the
sandbox's settings: the grading is undone.

The instance is ``calc`` (conftest.py): ``add`` subtracts. In the local sandbox the workspace and
/tmp share one tmpfs of ``disk_mb`` with ``disk_mb`` / 4 KiB inodes.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tangram_env.envs.swe_bench.grading import MIN_FREE_BYTES, MIN_FREE_INODES, GradingUnavailable, grade
from tangram_env.envs.swe_bench.instance import SweBenchInstance
from tests.envs.swe_bench.conftest import BUGGY, calc_instance, git
from tests.envs.swe_bench.test_hacks import calc_with

DISK_MB = 64
#: Inodes the grader makes before it applies the patch: its folder, the runner, the plugin's folder
#: and file, the patch file.
BEFORE_APPLY = 5
NO_ROOM = "the patch leaves the sandbox no room to run the tests"


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SweBenchInstance, Any, Path]]:
    """The ``calc`` instance, a local sandbox of its image with a 64 MiB disk, and its repository."""
    from tangram_env.sandbox import SandboxSpec
    from tangram_env.server.sandbox.local import LocalProvider

    root = tmp_path_factory.mktemp("calc-small")
    made = calc_instance(root, sys.prefix)
    inst, _ = next(made)
    provider = LocalProvider(image_dir=str(root / "images"))
    try:
        box = provider.create(SandboxSpec(image=inst.image, disk_mb=DISK_MB))
        fs = box.exec(["stat", "-f", "-c", "%T %c", "."]).stdout.split()
        if fs != ["tmpfs", str(DISK_MB << 8)]:
            pytest.skip(f"the local sandbox's disk is not a capped tmpfs here ({fs})")
        yield inst, box, root / "repo"
    finally:
        provider.close()
        next(made, None)  # its own sandbox and provider closed


def free(box: Any) -> tuple[int, int]:
    """Free inodes and bytes of the sandbox's disk."""
    inodes, blocks, size = box.exec(["stat", "-f", "-c", "%d %a %S", "."]).stdout.split()
    return int(inodes), int(blocks) * int(size)


def inode_bomb(inodes: int, depth: int = 200) -> str:
    """A patch whose application makes exactly ``inodes`` inodes: empty files at the end of chains of
    folders (``c<i>/x/.../x/f``, ``d`` + 2 inodes each), outside the test machinery.
    """
    paths, i = [], 0
    while inodes > 0:
        d = min(depth, inodes - 2)
        paths.append(f"c{i}f" if d < 0 else f"c{i}/" + "x/" * d + "f")
        inodes -= d + 2 if d >= 0 else 1
        i += 1
    return "".join(f"diff --git a/{p} b/{p}\nnew file mode 100644\nindex 0000000..e69de29\n" for p in paths)


@pytest.mark.parametrize("left", [0, 1, 2])
def test_an_inode_bomb_is_the_patchs_failure(small: tuple[SweBenchInstance, Any, Path], left: int) -> None:
    # Sized so that `git apply` leaves `left` inodes: the grader's next writes (restoring the tests,
    # the runner's folder) used to fail with ENOSPC, which read as "no reward" instead of its 0.0.
    inst, box, _ = small
    box.reset()
    inodes, _ = free(box)
    out = grade(box, inst, calc_with("") + inode_bomb(inodes - BEFORE_APPLY - left), timeout_s=120)
    assert out["resolved"] is False and out["statuses"] == {}, out
    assert out["reason"].startswith(NO_ROOM) and f"({left} inodes /" in out["reason"], out
    assert out["tampering"] is None and out["run_error"] == out["reason"]


def test_a_byte_bomb_is_the_patchs_failure(small: tuple[SweBenchInstance, Any, Path]) -> None:
    # A binary patch compresses: a few KiB of it fill the disk with zeros.
    inst, box, repo = small
    box.reset()
    _, size = free(box)
    (repo / "zeros.bin").write_bytes(bytes(size - (MIN_FREE_BYTES // 2)))
    git(repo, "add", "-N", "zeros.bin")
    patch = git(repo, "diff", "--binary")
    git(repo, "rm", "-q", "--cached", "zeros.bin")
    (repo / "zeros.bin").unlink()
    out = grade(box, inst, patch, timeout_s=120)
    assert out["resolved"] is False and out["reason"].startswith(NO_ROOM), out


def test_a_fix_with_room_to_spare_still_resolves(small: tuple[SweBenchInstance, Any, Path]) -> None:
    inst, box, _ = small
    box.reset()
    inodes, _ = free(box)
    # Short chains: the grader lists every path the patch wrote, within the sandbox's output cap.
    bomb = inode_bomb(inodes - BEFORE_APPLY - 2 * MIN_FREE_INODES, depth=8)
    assert grade(box, inst, inst.patch, timeout_s=120)["resolved"] is True
    box.reset()
    out = grade(box, inst, inst.patch + bomb, timeout_s=120)
    assert out["resolved"] is True, out["reason"]
    box.reset()
    fixed = calc_with("", BUGGY.replace("a - b", "a + b")) + inode_bomb(inodes - BEFORE_APPLY)
    assert grade(box, inst, fixed, timeout_s=120)["reason"].startswith(NO_ROOM)  # a fix that fills it too


@pytest.mark.parametrize("what", ["inodes", "bytes"])
def test_a_sandbox_too_full_before_the_patch_leaves_the_grading_undone(
    small: tuple[SweBenchInstance, Any, Path], what: str
) -> None:
    # Full before any of the patch was written: the sandbox's settings, not the patch.
    inst, box, _ = small
    box.reset()
    inodes, size = free(box)
    fill = (
        f"mkdir /tmp/fill && cd /tmp/fill && i=0; while [ $i -lt {inodes - 100} ]; do : >$i; i=$((i+1)); done"
        if what == "inodes"
        else f"head -c {size - (MIN_FREE_BYTES // 2)} /dev/zero > /tmp/fill"
    )
    assert box.exec(["sh", "-c", fill], timeout_s=120).ok
    with pytest.raises(GradingUnavailable, match=r"too full to grade in.*disk_mb"):
        grade(box, inst, calc_with("x = 1\n"), timeout_s=120)


def test_a_diff_cut_at_the_output_cap_says_so(small: tuple[SweBenchInstance, Any, Path]) -> None:
    # The sandbox's output cap (1 MiB by default) is below the diff tool's own limit: the error names
    # the cap, not a size the diff never reached.
    from tangram_env import Action
    from tangram_env.envs.swe_bench.tools import DiffArgs, diff
    from tangram_env.kinds import ActionContext
    from tangram_env.sandbox import SandboxSpec
    from tangram_env.server.sandbox.local import LocalProvider

    inst, box, repo = small
    provider = LocalProvider(image_dir=str(repo.parent / "images"))
    try:
        capped = provider.create(SandboxSpec(image=inst.image, max_output_bytes=64 << 10))
        assert capped.exec(["sh", "-c", "seq 100000 > big.txt"]).ok
        ctx = ActionContext(action=Action(kind="swe_bench.diff", payload={}), sandbox=capped)
        out = diff(DiffArgs(base=inst.base_commit), ctx)
    finally:
        provider.close()
    assert out["patch"] is None and "output cap" in out["error"] and "max_output_bytes" in out["error"], out
