"""Run mypy over the project as it is imported: ``server/`` etc. mapped under ``tangram_env``.

The folders map onto one import namespace through pyproject's package-dir, which mypy cannot read, so
this builds a tree of symlinks with the import layout and checks that.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAPPING = {"server": "server", "envs": "envs", "reward_models": "reward_models"}


def main() -> int:
    tree = ROOT / "build" / "typecheck" / "tangram_env"
    tree.mkdir(parents=True, exist_ok=True)
    for entry in (ROOT / "tangram_env").iterdir():
        link = tree / entry.name
        if not link.exists():
            link.symlink_to(entry)
    for name, folder in MAPPING.items():
        link = tree / name
        if not link.exists():
            link.symlink_to(ROOT / folder)
    env = {**os.environ, "MYPYPATH": str(tree.parent)}
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "-p", "tangram_env"]
    return subprocess.call(cmd, env=env, cwd=tree.parent)


if __name__ == "__main__":
    sys.exit(main())
