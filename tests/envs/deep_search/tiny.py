"""A tiny encyclopaedia the tests build themselves: works credited to people with known years."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tangram_env.envs.deep_search.index import Doc, SearchIndex, build_index
from tangram_env.envs.deep_search.questions import generate, validate

TINY_DOCS = [
    Doc(
        "the_silent_river",
        "The Silent River",
        "1901 novel by Ada Quill",
        "The Silent River is a novel by the English writer Ada Quill about a ferryman.",
    ),
    Doc(
        "ada_quill",
        "Ada Quill",
        "English novelist (1850\u20131920)",
        "Ada Quill was an English novelist known for river stories.",
    ),
    Doc(
        "storm_over_kell",
        "Storm over Kell",
        "Painting by Borin Vale",
        "Storm over Kell is an oil painting of a sea storm by the Scottish painter Borin Vale.",
    ),
    Doc(
        "borin_vale",
        "Borin Vale",
        "Scottish painter (1790\u20131850)",
        "Borin Vale was a Scottish painter of seascapes.",
    ),
    Doc(
        "mira_tolan",
        "Mira Tolan",
        "Estonian composer (1888\u20131960)",
        "Mira Tolan was an Estonian composer of choral music.",
    ),
    Doc("ferry", "Ferry", "Boat that carries passengers", "A ferry is a boat used to carry passengers."),
    Doc("river", "River", "Natural flowing watercourse", "A river is a natural flowing watercourse."),
]


def build_tiny_index(root: Path) -> tuple[Path, list[dict[str, Any]]]:
    """Index :data:`TINY_DOCS` under ``root`` with its validated questions."""
    draft = build_index(TINY_DOCS, root / "draft.sqlite")
    questions = validate(generate(TINY_DOCS, comparisons=3), SearchIndex(draft))
    return build_index(TINY_DOCS, root / "index.sqlite", questions), questions
