"""Helpers shared by the benchmarks: percentiles, a table printer, a server subprocess."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tangram_env.launch import ServerProcess

ROOT = Path(__file__).resolve().parent.parent


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by the nearest-rank method; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def print_table(title: str, rows: Sequence[tuple[str, Any]]) -> None:
    """A two-column table on stdout."""
    width = max(len(name) for name, _ in rows)
    print(f"\n{title}\n{'-' * len(title)}")
    for name, value in rows:
        shown = f"{value:,.1f}" if isinstance(value, float) else str(value)
        print(f"{name:<{width}}  {shown}")


def start_server(*args: str) -> ServerProcess:
    """A ``tangram-server`` child on a random loopback port that imports this checkout."""
    return ServerProcess(*args, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)


@contextlib.contextmanager
def fresh_python() -> Iterator[str]:
    """``python3`` of a fresh, empty virtual environment of this Python (removed afterwards).

    The plain interpreter a sandbox's is measured against: no editable installs' import hooks, and
    none of the ``.pth`` files a host may keep in the base interpreter's site-packages.
    """
    with tempfile.TemporaryDirectory(prefix="tangram-fresh-python-") as root:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", root], check=True)
        yield os.path.join(root, "bin", "python3")
