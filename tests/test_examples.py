"""The README's first command runs the quickstart: it must keep working as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import ROOT


def test_quickstart_scores_right_and_wrong_answers() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TANGRAM_ADDRESS"}  # the embedded default
    out = subprocess.run(
        [sys.executable, "examples/quickstart.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    rewards = dict(re.findall(r"^(right|wrong) answer: reward ([0-9.]+)", out.stdout, re.M))
    assert float(rewards["right"]) == 1.0 and float(rewards["wrong"]) < 1.0, out.stdout
    assert "ACT" in out.stdout
