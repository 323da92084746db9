"""The swe-bench env's own action kinds: ``swe_bench.diff`` and ``swe_bench.grade``.

``swe_bench.diff`` runs in the trajectory's sandbox and returns the working tree's changes against the
instance's base commit (new files and whatever the agent committed included) as a patch.
``swe_bench.grade`` runs in a fresh sandbox of the instance's image (closed afterwards, never lent to an
episode: it held the hidden tests): it applies the patch's changes to
the source (edits to test machinery are dropped and listed), restores the tests and applies the
instance's test patch, and runs FAIL_TO_PASS and PASS_TO_PASS with planted tests beside them, sharded
over as many cores as the scheduler grants (an elastic action). The verdict is decided here, in the
tool's process, never in the sandbox; a grading that could not be done fails the action (see
:mod:`.grading`). This module is a plugin the orchestrator imports, so it imports nothing heavy.
"""

from __future__ import annotations

import shlex
from typing import Any

from pydantic import BaseModel, Field

from tangram_env.kinds import ActionContext, tool

#: A patch larger than this is refused (an agent that commits a build tree, not a fix).
MAX_PATCH_BYTES = 4 << 20
#: Most test shards (cores) one grading action asks for.
MAX_GRADE_PAR = 8


class DiffArgs(BaseModel):
    """Which repository to diff, and against what."""

    workdir: str | None = Field(None, description="repository root in the sandbox (None: the workspace)")
    base: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        pattern=r"^[^-\s][^\s]*$",
        description="the commit the changes are taken against: the instance's base commit (None: HEAD)",
    )


class GradeArgs(BaseModel):
    """A patch to grade and the instance (SWE-bench's fields) it is graded on."""

    instance: dict[str, Any] = Field(description="the SWE-bench instance, as its JSON fields")
    patch: str | None = Field(
        None, max_length=MAX_PATCH_BYTES, description="the diff to grade (None: no patch)"
    )
    timeout_s: float = Field(900.0, gt=0, le=7200, description="time limit of the test run")


#: The diff of the index against the base commit, after ``git add -A``; names of the files on stderr.
#: Against the base, not HEAD: an agent that commits its fix (amends, or commits on a branch of its
#: own) still has it graded. A base the agent made unreachable is still in the object store; one it
#: destroyed (``gc --prune``, a new ``.git``) is an error, and the episode has no patch to grade.
#: No replace objects, external diff or text conversion: what the repository's configuration says
#: does not change the patch.
_DIFF = """
base=$(git --no-replace-objects rev-parse --verify --quiet "$1^{commit}") || {
    echo "the base commit $1 is not in the repository any more" >&2; exit 3; }
git add -A >/dev/null || exit
git -c core.quotepath=off --no-replace-objects diff --cached --no-color --no-ext-diff --no-textconv \
    --binary "$base" -- || exit
git -c core.quotepath=off --no-replace-objects diff --cached --name-only "$base" -- >&2
"""


@tool(name="swe_bench.diff", placement="sandbox", cpu=0.5, mem_mb=256, timeout_s=60)
def diff(args: DiffArgs, ctx: ActionContext) -> dict[str, Any]:
    """The working tree's changes against ``args.base`` (HEAD if None), new files and commits made
    since included, as a git patch.
    """
    root = args.workdir or ctx.sandbox.workspace
    res = ctx.sandbox.exec(
        ["sh", "-c", _DIFF, "sh", args.base or "HEAD"],
        cwd=root,
        timeout_s=max(1.0, min(60.0, ctx.remaining() - 1)),
    )
    if not res.ok:
        return {
            "patch": None,
            "files": [],
            "error": f"git diff failed in {shlex.quote(root)}: "
            f"{(res.stderr or res.stdout).strip()[-2000:] or res.exit_code}",
        }
    if len(res.stdout.encode("utf-8")) > MAX_PATCH_BYTES:
        return {"patch": None, "files": [], "error": f"the diff is larger than {MAX_PATCH_BYTES} bytes"}
    if res.stdout_truncated:
        # Cut by the sandbox, not by this tool: its output cap can be below MAX_PATCH_BYTES.
        return {
            "patch": None,
            "files": [],
            "error": "the diff was cut at the sandbox's output cap (SandboxSpec.max_output_bytes, "
            f"{len(res.stdout.encode('utf-8'))} bytes came back); it cannot be graded whole. Raise "
            f"max_output_bytes to at least {MAX_PATCH_BYTES} to grade diffs up to that size",
        }
    return {"patch": res.stdout, "files": [f for f in res.stderr.splitlines() if f.strip()]}


@tool(
    name="swe_bench.grade",
    placement="sandbox",
    cpu=1,
    mem_mb=2048,
    timeout_s=1800,
    min_par=1,
    max_par=MAX_GRADE_PAR,
    retire_sandbox=True,  # it held the hidden tests: never reset and lent to an episode
)
def grade(args: GradeArgs, ctx: ActionContext) -> dict[str, Any]:
    """Grade a patch on a SWE-bench instance in a fresh sandbox of its image; SWE-bench's report."""
    from tangram_env.envs.swe_bench.grading import grade as run_grade
    from tangram_env.envs.swe_bench.instance import SweBenchInstance

    instance = SweBenchInstance.model_validate(args.instance)
    limit = max(10.0, min(args.timeout_s, ctx.remaining() - 30.0))
    result = run_grade(
        ctx.sandbox, instance, args.patch, shards=max(1, ctx.parallelism), cores=ctx.cores, timeout_s=limit
    )
    result["parallelism"] = ctx.parallelism
    return result
