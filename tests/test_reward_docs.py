"""The custom-env examples of docs/rewards.md and docs/reward-models.md run as written, and pass
gymnasium's ``check_env`` (their own ``__main__`` blocks call it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _example(doc: str, marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / doc).read_text(), re.S)
    (code,) = [block for block in blocks if marker in block]
    return code


@pytest.mark.parametrize(
    ("doc", "marker", "printed"),
    [("rewards.md", "class MyEnv(", 1.0), ("reward-models.md", "class AnswerEnv(", 1 / 3)],
)
def test_a_custom_env_example_runs_as_written(doc: str, marker: str, printed: float, tmp_path: Path) -> None:
    # They defined only _step: reset() raised a bare NotImplementedError and they had no spaces.
    script = tmp_path / "example.py"
    script.write_text(_example(doc, marker))
    env = {k: v for k, v in os.environ.items() if k != "TANGRAM_ADDRESS"}  # the embedded orchestrator
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert float(out.stdout.strip().splitlines()[-1]) == pytest.approx(printed)
