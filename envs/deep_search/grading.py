"""Answer grading: exact match and token F1 after the usual normalisation (SQuAD's, as QA papers use).

Normalising lowercases, drops punctuation and the articles *a*, *an*, *the*, and collapses whitespace,
so "The Eiffel Tower." matches "eiffel tower". An answer to a choice ("Who was born earlier, A or B?")
that names a wrong choice too scores 0 under either metric. Pure functions: the trainer grades,
nothing remote.
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


_DISAMBIGUATOR = re.compile(r"\s*\([^()]*\)\s*$")


def gold_forms(gold: str) -> list[str]:
    """``gold``, and without an article title's disambiguator: "Jonathan Edwards (theologian)" is
    rightly answered "Jonathan Edwards".
    """
    plain = _DISAMBIGUATOR.sub("", gold)
    return [gold, plain] if plain and plain != gold else [gold]


def exact_match(prediction: str, gold: str) -> float:
    """1.0 when the normalised strings are equal (for any form of ``gold``), else 0.0."""
    return max(float(normalize_answer(prediction) == normalize_answer(g)) for g in gold_forms(gold))


def f1_score(prediction: str, gold: str) -> float:
    """Harmonic mean of token precision and recall between the normalised strings (the best form of
    ``gold``).
    """
    return max(_f1(prediction, g) for g in gold_forms(gold))


def _f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = collections.Counter(pred) & collections.Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def names_another_choice(prediction: str, gold: str, choices: list[str]) -> bool:
    """Whether ``prediction`` names a choice of the question other than ``gold`` (a word of that
    choice's own, one the gold answer lacks): naming every choice of "A or B?" is no answer, and
    token F1 would pay it about two thirds.
    """
    words, gold_words = set(normalize_answer(prediction).split()), set(normalize_answer(gold).split())
    return any(words & (set(normalize_answer(c).split()) - gold_words) for c in choices)


def names_another_number(prediction: str, gold: str) -> bool:
    """Whether ``prediction`` holds a number the gold answer lacks, where the gold answer holds one:
    "1927 1928 1929" for 1928 is a list of guesses, which token F1 would pay half.
    """
    gold_numbers = {w for g in gold_forms(gold) for w in normalize_answer(g).split() if w.isdigit()}
    numbers = {w for w in normalize_answer(prediction).split() if w.isdigit()}
    return bool(gold_numbers) and bool(numbers - gold_numbers)


def names_no_choice(prediction: str, gold: str, choices: list[str]) -> bool:
    """Whether ``prediction`` names none of the choices where ``gold`` is one of them.

    "de", or "de zzqx", for "Guy de Maupassant or Paco de Lucía?" picks neither name, though token F1
    would pay it whichever is right. A yes/no comparison's gold names no choice.
    """
    gold_words, words = set(normalize_answer(gold).split()), set(normalize_answer(prediction).split())
    return _names_a_choice(gold_words, choices) and not _names_a_choice(words, choices)


def _names_a_choice(words: set[str], choices: list[str]) -> bool:
    """Whether ``words`` hold a word of some choice's own (one no other choice has), or every word of a
    choice that has none of its own ("John Smith" beside "John Smith Jr").
    """
    named = [set(normalize_answer(c).split()) for c in choices]
    for i, choice in enumerate(named):
        own = choice - set().union(*(other for j, other in enumerate(named) if j != i))
        if (words & own) if own else (choice and choice <= words):
            return True
    return False
