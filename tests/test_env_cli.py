"""``tangram-env`` run as users run it: a mistake (an env, an address, a corpus file) is one line on
stderr and a non-zero status, never a traceback."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ServerProcess, run_module


def _env_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_module("tangram_env.cli", *args, env={**os.environ, **env}, timeout_s=120)


def _one_line(run: subprocess.CompletedProcess[str], status: int, said: str) -> None:
    assert run.returncode == status, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], run.stderr


def test_smoke_of_an_unknown_env_names_the_known_ones() -> None:
    run = _env_cli("smoke", "nosuchenv")
    _one_line(run, 2, "no env registered as 'nosuchenv' (registered: code, deep-search, swe-bench)")


@pytest.mark.parametrize(
    ("address", "said"),
    [
        ("garbage", "orchestrator address 'garbage' must start with tcp://, ipc:// or inproc://"),
        ("tcp://127.0.0.1:9", "no orchestrator answered at tcp://127.0.0.1:9 within 1s"),
    ],
)
def test_smoke_without_an_orchestrator_there_says_so(address: str, said: str) -> None:
    run = _env_cli("smoke", "code", "--address", address, TANGRAM_CONNECT_TIMEOUT_S="1")
    _one_line(run, 1, said)


def test_smoke_on_an_orchestrator_without_the_envs_tools_names_the_missing_plugin() -> None:
    srv = ServerProcess("--no-entry-points", "--no-gpu-worker", "--sandbox", "none")
    try:
        run = _env_cli("smoke", "code", "--address", srv.address, "--episodes", "1", "--max-steps", "1")
    finally:
        srv.stop()
    _one_line(run, 1, "no tool or reward model named 'code.run_tests'")


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("[]", "holds a JSON list; it must hold a JSON object mapping titles to articles"),
        ("not json", "is not JSON (Expecting value"),
        ('{"x": 1, "y": {"title": "Y"}}', 'has no usable article (none with an "extract")'),
    ],
)
def test_prepare_deep_search_refuses_a_corpus_without_articles(tmp_path: Path, text: str, said: str) -> None:
    from tangram_env.envs.deep_search.index import has_fts5

    if not has_fts5():
        pytest.skip("this Python's SQLite has no FTS5")
    corpus = tmp_path / "corpus.json"
    corpus.write_text(text)
    out = tmp_path / "index.sqlite"
    run = _env_cli("prepare", "deep-search", "--corpus", str(corpus), "--out", str(out))
    _one_line(run, 1, said)
    assert not out.exists()  # no empty index that would look prepared


def test_prepare_help_names_what_it_prepares() -> None:
    run = _env_cli("prepare", "--help")
    assert run.returncode == 0
    assert "swe-bench" in run.stdout and "deep-search" in run.stdout
