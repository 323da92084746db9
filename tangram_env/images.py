"""Sandbox images: what a sandbox starts from, stored as directories under an image root.

An image is a starting workspace (files copied into every sandbox made from it, again on each
reset) and, optionally, a Python environment that sandboxes see read-only and find first on
``PATH``. ``default`` (unless an image of that name was built) is the Python that runs Tangram, with
an empty workspace. Images live under ``$TANGRAM_IMAGE_DIR`` or ``~/.cache/tangram/images``, one
folder per build plus ``<name>.json``, its manifest, written last so a half-built image never shows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, Field

from tangram_env.errors import UnknownNameError, did_you_mean
from tangram_env.sandbox import SandboxError

DEFAULT_IMAGE = "default"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
#: Places every sandbox has its own of, so a host path there cannot be shown to sandboxes as it is.
# Paths each sandbox has its own of. /tmp is not among them: host paths under it are bound read-only
# on top of the sandbox's private /tmp (a checkout or virtual environment that lives there still works).
PRIVATE_PATHS = ("/var/tmp", "/workspace", "/proc", "/dev", "/etc")


class ImageError(SandboxError):
    """An image could not be built or used."""


class Image(BaseModel):
    """An image's manifest: where its parts are on the host."""

    name: str
    created: float = Field(default_factory=time.time)
    workspace: str | None = Field(None, description="directory copied into each sandbox's workspace")
    python: str | None = Field(None, description="prefix of the Python environment sandboxes use")
    python_base: str | None = Field(None, description="prefix of the interpreter that environment runs on")
    read_only: list[str] = Field(default_factory=list, description="more host paths sandboxes see read-only")
    env: dict[str, str] = Field(default_factory=dict, description="environment of every exec")
    packages: list[str] = Field(default_factory=list, description="what was pip-installed into ``python``")
    build_dir: str | None = None

    def host_paths(self) -> list[str]:
        """Every host path a sandbox of this image must see read-only (beyond the system's)."""
        paths = [p for p in (self.python_base, self.python) if p]
        return list(dict.fromkeys([*paths, *self.read_only]))

    def check_paths(self) -> None:
        """Raise :class:`ImageError` if a path sandboxes must see is one each has its own of (``/tmp``...)."""
        for path in self.host_paths():
            clash = next((p for p in PRIVATE_PATHS if path == p or path.startswith(p + "/")), None)
            if clash is not None:
                raise ImageError(
                    f"image {self.name!r} needs {path} inside sandboxes, but each sandbox has its own "
                    f"{clash}: keep images and Python environments elsewhere (the image root defaults "
                    "to ~/.cache/tangram/images)"
                )

    def missing_paths(self) -> list[str]:
        """Host paths the image's sandboxes would bind that no longer exist (it must be rebuilt)."""
        return [path for path in self.host_paths() if not os.path.exists(path)]

    def check_usable(self) -> None:
        """:meth:`check_paths`, and raise :class:`ImageError` if a path it binds is gone from the host."""
        self.check_paths()
        missing = self.missing_paths()
        if missing:  # bubblewrap would fail on it with nothing better than "no such process"
            raise ImageError(
                f"image {self.name!r} binds {missing[0]}, which no longer exists on this host: build the "
                "image again (`tangram-server image build`; for swe-bench, `tangram-env prepare swe-bench`)"
            )

    def bin_dirs(self) -> list[str]:
        """Directories to put first on ``PATH``: the environment's, then its base interpreter's."""
        return [
            os.path.join(p, "bin") for p in dict.fromkeys(p for p in (self.python, self.python_base) if p)
        ]


class BuildProgress(Protocol):
    """Where :func:`build_image` reports what it is doing (the CLI draws a progress bar)."""

    def stage(self, description: str, total: int | None) -> None:
        """A new step begins, with ``total`` units of work if known."""
        ...

    def advance(self, units: int = 1, note: str | None = None) -> None:
        """``units`` more are done; ``note`` is the latest detail (a pip line, a file name)."""
        ...


class _Quiet:
    def stage(self, description: str, total: int | None) -> None:
        pass

    def advance(self, units: int = 1, note: str | None = None) -> None:
        pass


def image_root(root: str | os.PathLike[str] | None = None) -> Path:
    """Where images are stored: ``root``, ``$TANGRAM_IMAGE_DIR``, or ``~/.cache/tangram/images``."""
    chosen = root or os.environ.get("TANGRAM_IMAGE_DIR") or Path.home() / ".cache" / "tangram" / "images"
    return Path(chosen).expanduser()


def default_image() -> Image:
    """The built-in image: the Python running Tangram (its virtual environment too), empty workspace."""
    return Image(name=DEFAULT_IMAGE, created=0.0, python=sys.prefix, python_base=sys.base_prefix)


def check_name(name: str) -> str:
    """``name`` if it can name an image (letters, digits, ``._-``, up to 64), else :class:`ImageError`."""
    if not _NAME.match(name):
        raise ImageError(f"bad image name {name!r}: use letters, digits, '.', '_' and '-' (at most 64)")
    return name


def list_images(root: str | os.PathLike[str] | None = None) -> list[Image]:
    """Every built image under the root, by name."""
    base = image_root(root)
    if not base.is_dir():
        return []
    found = []
    for manifest in sorted(base.glob("*.json")):
        try:
            found.append(Image.model_validate_json(manifest.read_text()))
        except (OSError, ValueError):
            continue  # a manifest being replaced or damaged: not an image
    return found


def get_image(name: str, root: str | os.PathLike[str] | None = None) -> Image:
    """The image called ``name`` (``default`` is built in), or :class:`UnknownNameError` with hints."""
    manifest = image_root(root) / f"{name}.json"
    if _NAME.match(name) and manifest.is_file():
        return Image.model_validate_json(manifest.read_text())
    if name == DEFAULT_IMAGE:
        return default_image()
    names = [DEFAULT_IMAGE, *(i.name for i in list_images(root))]
    extra = did_you_mean(name, names)
    raise UnknownNameError(
        f"no sandbox image named {name!r} in {image_root(root)}{extra} "
        "(build one with `tangram-server image build`)"
    )


def build_image(
    name: str,
    *,
    from_dir: str | os.PathLike[str] | None = None,
    requirements: str | os.PathLike[str] | None = None,
    pip: Sequence[str] = (),
    pip_args: Sequence[str] = (),
    python_env: str | os.PathLike[str] | None = None,
    python: str | None = None,
    env: dict[str, str] | None = None,
    read_only: Iterable[str] = (),
    root: str | os.PathLike[str] | None = None,
    progress: BuildProgress | None = None,
) -> Image:
    """Build (or rebuild) the image ``name`` and return its manifest.

    ``from_dir`` is copied as the starting workspace. ``requirements`` (a pip requirements file)
    and ``pip`` (package specs) are installed into a new virtual environment of the image, made
    from ``python`` (default: the interpreter that runs Tangram); ``pip_args`` go to ``pip
    install`` as given (``--no-index``, ``--find-links``...). ``python_env`` instead names an existing
    virtual environment that sandboxes use as is, read-only. A rebuild replaces the previous build
    once the new one is complete.
    """
    check_name(name)
    report = progress or _Quiet()
    if python_env is not None and (requirements or pip):
        raise ImageError("give either python_env (an existing environment) or packages to install, not both")
    base = image_root(root).absolute()
    if requirements or pip:
        Image(name=name, python=str(base / name)).check_paths()  # fail before the slow part
    base.mkdir(parents=True, exist_ok=True)
    build_dir = base / f"{name}@{uuid.uuid4().hex[:10]}"
    build_dir.mkdir()
    try:
        image = Image(name=name, env=dict(env or {}), read_only=[str(Path(p).resolve()) for p in read_only])
        if from_dir is not None:
            image.workspace = str(_copy_workspace(Path(from_dir), build_dir / "workspace", report))
        if python_env is not None:
            image.python, image.python_base = _describe_env(Path(python_env))
        elif requirements or pip:
            image.python, image.python_base = _make_venv(build_dir / "venv", python, report)
            image.packages = _pip_install(image.python, requirements, list(pip), list(pip_args), report)
        else:
            image.python, image.python_base = sys.prefix, sys.base_prefix
        image.build_dir = str(build_dir)
        image.check_paths()
        old = _previous_build(base, name)
        tmp_manifest = base / f".{name}.json.{os.getpid()}"
        tmp_manifest.write_text(image.model_dump_json(indent=2))
        os.replace(tmp_manifest, base / f"{name}.json")
    except BaseException:
        shutil.rmtree(build_dir, ignore_errors=True)
        raise
    if old and old != build_dir:
        shutil.rmtree(old, ignore_errors=True)
    report.stage(f"image {name} ready", 1)
    report.advance(1)
    return image


def remove_image(name: str, root: str | os.PathLike[str] | None = None) -> None:
    """Delete a built image (its manifest, then its files)."""
    image = get_image(check_name(name), root)
    manifest = image_root(root) / f"{name}.json"
    if not manifest.is_file():
        raise ImageError(f"{name!r} is built in and cannot be removed")
    manifest.unlink()
    if image.build_dir:
        shutil.rmtree(image.build_dir, ignore_errors=True)


def _previous_build(base: Path, name: str) -> Path | None:
    try:
        old = Image.model_validate_json((base / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None
    return Path(old.build_dir) if old.build_dir else None


def _copy_workspace(src: Path, dst: Path, report: BuildProgress) -> Path:
    if not src.is_dir():
        raise ImageError(f"--from {src}: not a directory")
    files = [p for p in src.rglob("*") if not p.is_dir() or p.is_symlink()]
    report.stage(f"copying {src}", len(files) or 1)
    dst.mkdir()
    for path in sorted(src.rglob("*")):
        target = dst / path.relative_to(src)
        if path.is_symlink():
            target.symlink_to(os.readlink(path))
        elif path.is_dir():
            target.mkdir(exist_ok=True)
            continue
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
        report.advance(1, str(path.relative_to(src)))
    if not files:
        report.advance(1)
    # Sandboxes (another uid) read the image: files readable, directories searchable, none writable.
    for path in [dst, *dst.rglob("*")]:
        if not path.is_symlink():
            mode = path.stat().st_mode
            path.chmod((mode | 0o444 | (0o111 if path.is_dir() else 0)) & ~0o022)
    return dst


def _describe_env(prefix: Path) -> tuple[str, str]:
    """(prefix, base prefix) of an existing Python environment (a venv's base from pyvenv.cfg)."""
    prefix = prefix.expanduser().resolve()
    if not (prefix / "bin" / "python").exists() and not (prefix / "bin" / "python3").exists():
        raise ImageError(f"{prefix} is not a Python environment (no bin/python)")
    cfg = prefix / "pyvenv.cfg"
    if not cfg.is_file():
        return str(prefix), str(prefix)
    for line in cfg.read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "home":
            return str(prefix), str(Path(value.strip()).resolve().parent)
    raise ImageError(f"{cfg} has no 'home' line: cannot find the environment's interpreter")


def _make_venv(target: Path, python: str | None, report: BuildProgress) -> tuple[str, str]:
    report.stage("creating the virtual environment", 1)
    interpreter = python or os.path.join(sys.base_prefix, "bin", "python3")
    done = subprocess.run(
        [interpreter, "-m", "venv", "--without-pip", str(target)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise ImageError(f"creating a virtual environment with {interpreter} failed: {done.stderr.strip()}")
    report.advance(1)
    return _describe_env(target)


def _pip_install(
    prefix: str,
    requirements: str | os.PathLike[str] | None,
    packages: list[str],
    extra: list[str],
    report: BuildProgress,
) -> list[str]:
    # The pip of the running interpreter installs into the new environment (--python), so the
    # environment itself needs no pip of its own.
    cmd = [sys.executable, "-m", "pip", "--python", os.path.join(prefix, "bin", "python"), "install"]
    cmd += ["--disable-pip-version-check", "--no-input", "--progress-bar", "off", *extra]
    if requirements:
        if not Path(requirements).is_file():
            raise ImageError(f"--requirements {requirements}: no such file")
        cmd += ["-r", str(requirements)]
    cmd += packages
    report.stage("installing packages", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line.rstrip())
        report.advance(1, line.strip()[:80])
    if proc.wait() != 0:
        tail = "\n".join(lines[-15:])
        raise ImageError(f"pip install failed (exit {proc.returncode}):\n{tail}")
    listing = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            os.path.join(prefix, "bin", "python"),
            "list",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        return [f"{p['name']}=={p['version']}" for p in json.loads(listing.stdout)]
    except ValueError:
        return packages
