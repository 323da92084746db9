"""Answer grading: exact match and token F1 after the usual normalisation (SQuAD's, as QA papers use).

Normalising lowercases, drops punctuation and the articles *a*, *an*, *the*, and collapses whitespace,
so "The Eiffel Tower." matches "eiffel tower". Pure functions: the trainer grades, nothing remote.
"""

from __future__ import annotations

import collections
import re
import string
import unicodedata

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation) | {"\u2018", "\u2019", "\u201c", "\u201d", "\u2013", "\u2014"}


def normalize_answer(text: str) -> str:
    """Lowercase, strip accents' combining marks, punctuation and articles; one space between words."""
    text = unicodedata.normalize("NFKD", text.lower())
    text = "".join(ch for ch in text if not unicodedata.combining(ch) and ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    """1.0 when the normalised strings are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    """Harmonic mean of token precision and recall between the normalised strings."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = collections.Counter(pred) & collections.Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)
