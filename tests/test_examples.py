"""The examples run as users run them: the README's quickstart, then the asyncio and adapter examples."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

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


def _run_example(*argv: str, timeout: float = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TANGRAM_ADDRESS"}  # the embedded default
    out = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def _needs(module: str, extra: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed here (pip install 'tangram-env[{extra}]')")


def test_async_rollouts_runs_concurrent_trajectories_on_one_loop() -> None:
    # 64 trajectories keep CI short; the example's default is 256 (about 30 s on two cores).
    out = _run_example("examples/async_rollouts.py", "--trajectories", "64", "--steps", "2")
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["trajectories"] == 64 and figures["tool_calls"] == 128 and figures["steps_per_s"] > 0
    assert figures["act_p50_ms"] <= figures["act_p99_ms"]


def test_gymnasium_make_vec_example() -> None:
    out = _run_example("examples/gymnasium_make_vec.py")
    assert "tasks: run-length-encode" in out and "per-test time limits: (5.0, 5.0, 5.0, 5.0)" in out


def test_mini_swe_agent_example_resolves_the_instance() -> None:
    _needs("minisweagent", "mini-swe-agent")
    out = _run_example("examples/mini_swe_agent_swe_bench.py")
    assert "agent exit status Submitted" in out and "resolved: True (reward 1.0)" in out


def test_skyrl_example_rewards_the_right_answer() -> None:
    _needs("skyrl_gym", "skyrl")
    out = _run_example("examples/skyrl_code.py")
    # the wrong answer passes some tests; the right one earns the rest, so the return is 1
    assert "turn 2: reward" in out and "done True" in out and "return 1.00" in out


def test_verl_example_rewards_right_answers() -> None:
    _needs("verl", "verl")
    out = _run_example("examples/verl_code_tool.py")
    assert "right answers: 8/16" in out


def test_readme_asyncio_example_runs_as_written(tmp_path) -> None:  # type: ignore[no-untyped-def]
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## For trainer authors") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None and "await env.astep" in code.group(1)
    script = tmp_path / "readme_asyncio.py"
    script.write_text(code.group(1))
    out = _run_example(str(script))
    assert 0.0 <= float(out.strip()) <= 1.0
