"""Helpers shared by the benchmarks: percentiles, a table printer, a server subprocess."""

from __future__ import annotations

import math
import os
import select
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


class Server:
    """A ``tangram-server`` subprocess on a random loopback port (stopped with SIGTERM)."""

    def __init__(self, *args: str) -> None:
        read_fd, write_fd = os.pipe()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tangram_env.server",
                "--bind",
                "tcp://127.0.0.1:0",
                "--ready-fd",
                str(write_fd),
                "--log-level",
                "WARNING",
                *args,
            ],
            pass_fds=(write_fd,),
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        os.close(write_fd)
        ready, _, _ = select.select([read_fd], [], [], 60)
        self.address = os.read(read_fd, 4096).decode().strip() if ready else ""
        os.close(read_fd)
        if not self.address:
            self.proc.kill()
            raise RuntimeError("tangram-server did not start")

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(15)
