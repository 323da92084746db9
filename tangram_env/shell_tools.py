"""Generic sandbox tools any env can offer an agent: ``bash``, ``view``, ``str_replace`` and ``create``.

Each is an action kind that runs in the trajectory's sandbox (placement ``sandbox``; the env sets the
action's affinity to its session, so every call of an episode sees the same files). Relative paths
are relative to the sandbox's workspace, where commands also start. Mistakes of the caller (a file
that does not exist, an ``old_str`` that is not unique) come back as a result with ``error`` set, for
the agent to read; only a broken sandbox is an action failure.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.json_schema import SkipJsonSchema

from tangram_env.kinds import ActionContext, tool

#: Characters of stdout/stderr a tool result carries (the rest is cut with a marker).
OUTPUT_CAP = 30_000
MAX_FILE_BYTES = 4 << 20
#: The longest command line ``bash`` takes (the kernel caps one argument of exec at 128 KiB).
MAX_COMMAND = 100_000
#: The longest time limit of one ``bash`` call, in seconds.
MAX_BASH_TIMEOUT_S = 1800
_LIST_LIMIT = 400
_SNIPPET = 4


class BashArgs(BaseModel):
    """Run a shell command."""

    model_config = ConfigDict(extra="forbid")

    command: str = Field(min_length=1, max_length=MAX_COMMAND, description="the bash command line to run")
    timeout_s: float | None = Field(
        None, gt=0, le=MAX_BASH_TIMEOUT_S, description="time limit in seconds (default: the tool's)"
    )


class ProgramBashArgs(BashArgs):
    """What the ``bash`` tool takes: an agent's arguments (:class:`BashArgs`, what envs accept from a
    model), and what only programs set (a sandbox session: a mini-swe-agent submission is output).
    """

    max_output: SkipJsonSchema[int] = Field(
        OUTPUT_CAP, ge=1, le=MAX_FILE_BYTES, description="characters of stdout, and of stderr, returned"
    )


class ViewArgs(BaseModel):
    """Show a file with line numbers, or list a directory."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        min_length=1, max_length=4096, description="file or directory (relative: in the workspace)"
    )
    view_range: list[int] | None = Field(
        None,
        description="[first, last] line numbers to show, 1-based and inclusive; last -1 means to the end",
    )

    @field_validator("view_range")
    @classmethod
    def _two_lines(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return value
        if len(value) != 2 or value[0] < 1 or (value[1] != -1 and value[1] < value[0]):
            raise ValueError("view_range is [first, last] with 1 <= first <= last, or last = -1")
        return value


class StrReplaceArgs(BaseModel):
    """Replace the one occurrence of ``old_str`` in a file with ``new_str``."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, max_length=4096, description="file to edit (relative: in the workspace)")
    old_str: str = Field(min_length=1, description="text to replace; must occur exactly once in the file")
    new_str: str = Field("", description="the replacement (empty: delete old_str)")


class CreateArgs(BaseModel):
    """Create a new file."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        min_length=1, max_length=4096, description="file to create (relative: in the workspace)"
    )
    file_text: str = Field(max_length=MAX_FILE_BYTES, description="the whole content of the new file")


def cap(text: str, limit: int = OUTPUT_CAP) -> str:
    """``text`` cut to ``limit`` characters, middle dropped, with a marker saying how much."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - limit} characters cut ...]\n{text[-half:]}"


def _timeout(ctx: ActionContext, wanted: float | None, default: float) -> float:
    return max(1.0, min(wanted or default, ctx.remaining() - 1.0))


@tool(name="bash", placement="sandbox", cpu=1, mem_mb=1024, timeout_s=300)
def bash(args: ProgramBashArgs, ctx: ActionContext) -> dict[str, Any]:
    """Run a bash command in the sandbox's workspace and return its exit code and output. Each call is a
    fresh shell: `cd` and variables do not carry over (chain commands with &&).
    """
    res = ctx.sandbox.exec(
        ["bash", "-c", args.command], timeout_s=_timeout(ctx, args.timeout_s, 120.0), cores=ctx.cores
    )
    limit = args.max_output
    return {
        "exit_code": res.exit_code,
        "stdout": cap(res.stdout, limit),
        "stderr": cap(res.stderr, limit),
        "truncated": res.stdout_truncated
        or res.stderr_truncated
        or len(res.stdout) > limit
        or len(res.stderr) > limit,
        "killed_by": res.killed_by,
        "wall_s": round(res.wall_s, 3),
    }


_READ = (
    'if [ -d "$1" ]; then echo DIR; '
    'find "$1" -maxdepth 2 -not -path "*/.*" -not -name "__pycache__" | sort | '
    f"head -n {_LIST_LIMIT + 1}; "
    'elif [ -f "$1" ]; then echo FILE; cat -- "$1"; else echo "no such file or directory: $1" >&2; exit 2; fi'
)


def _read(ctx: ActionContext, path: str) -> tuple[str | None, str, str]:
    """(``"DIR"``/``"FILE"``/None, content, error) of ``path`` in the sandbox."""
    res = ctx.sandbox.exec(["sh", "-c", _READ, "sh", path], timeout_s=_timeout(ctx, None, 30.0))
    if not res.ok:
        return None, "", (res.stderr.strip() or f"could not read {path} (exit code {res.exit_code})")
    if res.stdout_truncated:
        return (
            None,
            "",
            f"{path} is too large to show whole; view a range of it or use bash (head, grep, sed -n)",
        )
    kind, _, body = res.stdout.partition("\n")
    return kind, body, ""


def _numbered(lines: list[str], first: int) -> str:
    return "\n".join(f"{n:6}\t{line}" for n, line in enumerate(lines, first))


@tool(name="view", placement="sandbox", cpu=0.5, mem_mb=256, timeout_s=60)
def view(args: ViewArgs, ctx: ActionContext) -> dict[str, Any]:
    """Show a file with line numbers (optionally only view_range), or list a directory two levels deep."""
    kind, body, error = _read(ctx, args.path)
    if kind is None:
        return {"error": error}
    if kind == "DIR":
        entries = body.splitlines()
        more = len(entries) > _LIST_LIMIT
        listing = "\n".join(entries[:_LIST_LIMIT]) + ("\n[... more entries not shown]" if more else "")
        return {"path": args.path, "kind": "directory", "output": listing}
    lines = body.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    first, last = 1, len(lines)
    if args.view_range is not None:
        first = args.view_range[0]
        last = len(lines) if args.view_range[1] == -1 else min(args.view_range[1], len(lines))
        if first > max(1, len(lines)):
            return {"error": f"view_range starts at line {first} but {args.path} has {len(lines)} lines"}
    return {
        "path": args.path,
        "kind": "file",
        "lines": len(lines),
        "output": cap(_numbered(lines[first - 1 : last], first)),
    }


def _write(ctx: ActionContext, path: str, text: str, *, make_parents: bool) -> str:
    """Write ``text`` at ``path``; an error message, or "" when it worked."""
    mkdir = 'mkdir -p -- "$(dirname -- "$1")" && ' if make_parents else ""
    res = ctx.sandbox.exec(
        ["sh", "-c", f'{mkdir}cat > "$1"', "sh", path],
        stdin=text.encode("utf-8"),
        timeout_s=_timeout(ctx, None, 30.0),
    )
    return "" if res.ok else (res.stderr.strip() or f"could not write {path} (exit code {res.exit_code})")


def _snippet(text: str, at: int, added: str) -> str:
    lines = text.split("\n")
    start_line = text[:at].count("\n")
    end_line = start_line + added.count("\n")
    first = max(0, start_line - _SNIPPET)
    return _numbered(lines[first : end_line + _SNIPPET + 1], first + 1)


@tool(name="str_replace", placement="sandbox", cpu=0.5, mem_mb=256, timeout_s=60)
def str_replace(args: StrReplaceArgs, ctx: ActionContext) -> dict[str, Any]:
    """Edit a file: replace old_str, which must occur exactly once, with new_str. Returns the edited
    region with line numbers.
    """
    kind, body, error = _read(ctx, args.path)
    if kind is None:
        return {"error": error}
    if kind == "DIR":
        return {"error": f"{args.path} is a directory"}
    count = body.count(args.old_str)
    if count == 0:
        return {
            "error": f"old_str does not occur in {args.path} (whitespace and indentation must match exactly)"
        }
    if count > 1:
        starts, pos = [], body.find(args.old_str)
        while pos != -1:
            starts.append(body[:pos].count("\n") + 1)
            pos = body.find(args.old_str, pos + 1)
        lines = ", ".join(map(str, starts[:20]))
        return {
            "error": f"old_str occurs {count} times in {args.path} (lines {lines}); include more context "
            "to make it unique"
        }
    at = body.index(args.old_str)
    new_body = body[:at] + args.new_str + body[at + len(args.old_str) :]
    error = _write(ctx, args.path, new_body, make_parents=False)
    if error:
        return {"error": error}
    return {"path": args.path, "output": cap(_snippet(new_body, at, args.new_str))}


@tool(name="create", placement="sandbox", cpu=0.5, mem_mb=256, timeout_s=60)
def create(args: CreateArgs, ctx: ActionContext) -> dict[str, Any]:
    """Create a new file with file_text as its content (parent directories are made). Fails if the path
    exists: edit existing files with str_replace.
    """
    check = ctx.sandbox.exec(
        ["sh", "-c", 'test -e "$1"', "sh", args.path], timeout_s=_timeout(ctx, None, 30.0)
    )
    if check.ok:
        return {"error": f"{args.path} already exists; use str_replace to edit it"}
    error = _write(ctx, args.path, args.file_text, make_parents=True)
    if error:
        return {"error": error}
    return {"path": args.path, "output": f"created {args.path} ({len(args.file_text.splitlines())} lines)"}


class ReadFileArgs(BaseModel):
    """Read a file's bytes."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, max_length=4096, description="file to read (relative: in the workspace)")


class WriteFileArgs(BaseModel):
    """Write bytes to a file (parent directories are made; an existing file is replaced)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, max_length=4096, description="file to write (relative: in the workspace)")
    data: bytes = Field(max_length=MAX_FILE_BYTES, description="the file's whole content")


@tool(name="read_file", placement="sandbox", cpu=0.25, mem_mb=128, timeout_s=60)
def read_file(args: ReadFileArgs, ctx: ActionContext) -> dict[str, Any]:
    """The bytes of a file in the sandbox (for sandbox sessions; agents read files with view)."""
    return {"path": args.path, "data": ctx.sandbox.read_file(args.path, max_bytes=MAX_FILE_BYTES)}


@tool(name="write_file", placement="sandbox", cpu=0.25, mem_mb=128, timeout_s=60)
def write_file(args: WriteFileArgs, ctx: ActionContext) -> dict[str, Any]:
    """Write a file in the sandbox (for sandbox sessions; agents write files with create/str_replace)."""
    ctx.sandbox.write_file(args.path, args.data)
    return {"path": args.path, "bytes": len(args.data)}


#: The argument model of each tool here, by name (envs validate calls with them before sending).
ARGS_MODELS: dict[str, type[BaseModel]] = {
    "bash": BashArgs,
    "view": ViewArgs,
    "str_replace": StrReplaceArgs,
    "create": CreateArgs,
}
