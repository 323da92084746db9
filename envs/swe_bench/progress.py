"""Progress reports of prepare: a silent default and a rich progress bar, one line per package."""

from __future__ import annotations

import threading
from typing import Any

from tangram_env.envs.swe_bench.packages import Package


class Progress:
    """Where prepare reports; the default prints nothing. The CLI passes a rich progress bar."""

    def package(self, pkg: Package, target: int) -> None:
        """Work on ``pkg`` begins; it aims for ``target`` instances."""

    def stage(self, pkg: Package, text: str) -> None:
        """What is happening to ``pkg`` now."""

    def kept(self, pkg: Package, count: int, screened: int, total: int) -> None:
        """``count`` instances kept after screening ``screened`` of ``total`` candidates."""

    def done(self, pkg: Package, count: int) -> None:
        """``pkg`` is finished with ``count`` instances."""


class RichProgress(Progress):
    """A rich progress bar, one line per package."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar

        self.bar = Bar(
            TextColumn("{task.fields[name]:<12}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
        )
        self.tasks: dict[str, Any] = {}
        self.lock = threading.Lock()

    def __enter__(self) -> RichProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def package(self, pkg: Package, target: int) -> None:
        """Add the package's line."""
        with self.lock:
            self.tasks[pkg.name] = self.bar.add_task("starting", total=target, name=pkg.name)

    def stage(self, pkg: Package, text: str) -> None:
        """Show what the package is at."""
        with self.lock:
            self.bar.update(self.tasks[pkg.name], description=text)

    def kept(self, pkg: Package, count: int, screened: int, total: int) -> None:
        """Move the package's bar."""
        with self.lock:
            self.bar.update(
                self.tasks[pkg.name],
                completed=count,
                description=f"screened {screened}/{total} candidate bugs",
            )

    def done(self, pkg: Package, count: int) -> None:
        """Close the package's bar at its count."""
        with self.lock:
            task = self.tasks[pkg.name]
            self.bar.update(
                task, completed=count, total=max(count, 1), description=f"{count} instances validated"
            )
