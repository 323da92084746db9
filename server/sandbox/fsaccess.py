"""Reading and writing files inside a sandbox's directories from the host, without following its links.

Sandboxed code controls the workspace: a symlink there may point at ``/etc/shadow``, and the host
(often root) must never follow it. Every path component is opened with ``O_NOFOLLOW`` relative to
the previous one, so a link planted anywhere on the way (even swapped in mid-walk) fails the call.
"""

from __future__ import annotations

import os
import posixpath
import stat

from tangram_env.sandbox import SandboxPathError, check_file_size

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def split_relative(path: str) -> list[str]:
    """The components of a relative path, refusing ``..`` and empty names."""
    parts = [p for p in posixpath.normpath(path).split("/") if p not in ("", ".")]
    if not parts or ".." in parts or posixpath.normpath(path).startswith(".."):
        raise SandboxPathError(f"{path!r} is not a file path inside the sandbox")
    return parts


def _walk(root: str, parts: list[str], *, create: bool, owner: tuple[int, int] | None) -> int:
    """An fd of the directory holding ``parts[-1]``, opened one component at a time."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for name in parts[:-1]:
            try:
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(name, 0o755, dir_fd=fd)
                if owner is not None:
                    os.chown(name, *owner, dir_fd=fd, follow_symlinks=False)
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise SandboxPathError(f"cannot enter {name!r} (a link or not a directory): {exc}") from exc
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_beneath(root: str, relative: str, max_bytes: int | None = None) -> bytes:
    """The bytes of ``root/relative``; links are refused, a missing file raises FileNotFoundError."""
    parts = split_relative(relative)
    dir_fd = _walk(root, parts, create=False, owner=None)
    try:
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            raise SandboxPathError(f"cannot read {relative!r}: {exc}") from exc
    finally:
        os.close(dir_fd)
    info = os.fstat(fd)  # before fdopen, which refuses a directory naming only the descriptor
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise SandboxPathError(f"{relative!r} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        check_file_size(relative, info.st_size, max_bytes)
        return f.read() if max_bytes is None else f.read(max_bytes)


def write_beneath(root: str, relative: str, data: bytes, owner: tuple[int, int] | None = None) -> None:
    """Write ``data`` to ``root/relative`` (parents created), owned by ``owner`` if given."""
    parts = split_relative(relative)
    dir_fd = _walk(root, parts, create=True, owner=owner)
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(parts[-1], flags, 0o644, dir_fd=dir_fd)
        except OSError as exc:
            raise SandboxPathError(f"cannot write {relative!r}: {exc}") from exc
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "wb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise SandboxPathError(f"{relative!r} is not a regular file")
        if owner is not None:
            os.fchown(f.fileno(), *owner)
        f.write(data)
