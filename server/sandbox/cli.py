"""``tangram-server image ...``: build, list and remove sandbox images (with a progress bar)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from tangram_env.errors import TangramError
from tangram_env.images import build_image, image_root, list_images, remove_image


class _RichProgress:
    """:class:`~tangram_env.images.BuildProgress` drawn as a rich progress bar."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task: TaskID | None = None

    def stage(self, description: str, total: int | None) -> None:
        if self.task is not None:  # the previous stage is complete: fill its bar
            done = self.progress.tasks[self.task].total or max(
                1, int(self.progress.tasks[self.task].completed)
            )
            self.progress.update(self.task, total=done, completed=done)
            self.progress.stop_task(self.task)
        self.task = self.progress.add_task(description, total=total, note="")

    def advance(self, units: int = 1, note: str | None = None) -> None:
        if self.task is not None:
            self.progress.update(self.task, advance=units, note=note or "")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tangram-server image", description="Sandbox images.")
    parser.add_argument(
        "--root", help="image directory (default: $TANGRAM_IMAGE_DIR or ~/.cache/tangram/images)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build (or rebuild) an image")
    build.add_argument("name", nargs="?", help="image name (with --docker: default if omitted)")
    build.add_argument(
        "--docker",
        action="store_true",
        help="build the Docker provider's image tangram/NAME (default: Debian with Python, no registry)",
    )
    build.add_argument(
        "--from", dest="from_dir", metavar="DIR", help="directory copied as the starting workspace"
    )
    build.add_argument("--requirements", "-r", metavar="FILE", help="pip requirements file to install")
    build.add_argument("--pip", nargs="+", default=[], metavar="PKG", help="packages to pip-install")
    build.add_argument(
        "--pip-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for pip install (repeatable)",
    )
    build.add_argument(
        "--python-env", metavar="PATH", help="use this existing virtual environment, read-only"
    )
    build.add_argument("--python", metavar="EXE", help="interpreter the image's environment is made from")
    build.add_argument("--env", action="append", default=[], metavar="K=V", help="environment of every exec")
    listing = sub.add_parser("list", help="list built images")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    remove = sub.add_parser("remove", help="delete a built image")
    remove.add_argument("name")
    return parser


def image_main(argv: list[str]) -> int:
    """Run ``tangram-server image <argv>``; returns the process exit status."""
    args = _parser().parse_args(argv)
    console = Console(stderr=True)
    try:
        if args.command == "build":
            return _build(args, console)
        if args.command == "list":
            return _list(args)
        remove_image(args.name, args.root)
        console.print(f"removed image {args.name}")
        return 0
    except (TangramError, OSError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 1


def _build(args: argparse.Namespace, console: Console) -> int:
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--env wants KEY=VALUE, got {item!r}")
        env[key] = value
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    started = time.monotonic()
    if args.docker:
        return _build_docker(args, env, console, columns)
    if not args.name:
        raise ValueError("name the image to build (only --docker builds `default` when none is named)")
    with Progress(*columns, TextColumn("[dim]{task.fields[note]}"), console=console, transient=False) as bar:
        image = build_image(
            args.name,
            from_dir=args.from_dir,
            requirements=args.requirements,
            pip=args.pip,
            pip_args=args.pip_arg,
            python_env=args.python_env,
            python=args.python,
            env=env,
            root=args.root,
            progress=_RichProgress(bar),
        )
    console.print(
        f"built image [bold]{image.name}[/bold] in {time.monotonic() - started:.1f}s at {image.build_dir}"
    )
    return 0


def _build_docker(args: argparse.Namespace, env: dict[str, str], console: Console, columns: Any) -> int:
    from tangram_env.server.sandbox.docker_build import build_docker_image

    unsupported = [
        flag
        for flag, value in (
            ("--requirements", args.requirements),
            ("--pip", args.pip),
            ("--python-env", args.python_env),
            ("--python", args.python),
        )
        if value
    ]
    if unsupported:
        raise ValueError(f"{', '.join(unsupported)} build local images only, not with --docker")
    started = time.monotonic()
    with Progress(*columns, TextColumn("[dim]{task.fields[note]}"), console=console, transient=False) as bar:
        target = build_docker_image(
            args.name or "default", from_dir=args.from_dir, env=env, progress=_RichProgress(bar)
        )
    console.print(f"built Docker image [bold]{target}[/bold] in {time.monotonic() - started:.1f}s")
    return 0


def _list(args: argparse.Namespace) -> int:
    images = list_images(args.root)
    if args.json:
        json.dump([i.model_dump() for i in images], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    table = Table(title=f"sandbox images in {image_root(args.root)}")
    for column in ("name", "built", "workspace", "python", "packages"):
        table.add_column(column)
    for image in images:
        table.add_row(
            image.name,
            time.strftime("%Y-%m-%d %H:%M", time.localtime(image.created)),
            "yes" if image.workspace else "-",
            image.python or "-",
            str(len(image.packages)),
        )
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(image_main(sys.argv[1:]))
