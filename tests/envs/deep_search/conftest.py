"""A tiny encyclopaedia the tests build themselves: works credited to people with known years."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tangram_env.envs.deep_search.index import Doc, SearchIndex, build_index
from tangram_env.envs.deep_search.questions import generate, validate
from tangram_env.envs.deep_search.service import ServiceProcess

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


@pytest.fixture(scope="session")
def tiny_index(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """An index of :data:`TINY_DOCS` with its validated questions."""
    root = tmp_path_factory.mktemp("deep-search")
    draft = build_index(TINY_DOCS, root / "draft.sqlite")
    questions = validate(generate(TINY_DOCS, comparisons=3), SearchIndex(draft))
    return build_index(TINY_DOCS, root / "index.sqlite", questions), questions


@pytest.fixture
def search_service(tiny_index: tuple[Path, list[dict[str, Any]]]) -> Iterator[ServiceProcess]:
    """An open (no keys, no quota) search service over the tiny index."""
    svc = ServiceProcess(tiny_index[0])
    yield svc
    svc.stop()
