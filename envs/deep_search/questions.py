"""Questions generated from the corpus's own structure, each with the path that answers it.

Two kinds, both checkable by exact match:

* **two-hop**: a work whose description credits a person ("1885 novel by Mark Twain") and that
  person's article, whose description gives their years ("American author (1835-1910)"): *In what
  year was the creator of Adventures of Huckleberry Finn (1885 novel) born?* -> ``1835``. The agent
  must find the work, read who made it, then find that person.
* **comparison**: two people with known birth years: *Who was born earlier, Mark Twain or Leo
  Tolstoy?* -> ``Leo Tolstoy``. Both articles must be read.

:func:`validate` keeps only questions whose intended path works on the built index: each title
searched finds its article first, and the answer is written in the articles read.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable
from typing import Any

from tangram_env.envs.deep_search.index import Doc, SearchIndex

# "American author and humorist (1835-1910)" (en dash or hyphen): years of the common era only
# (no "BC", no "c.").
_LIFE = re.compile(r"^(?P<what>[^()]+?)\s*\((?P<born>\d{3,4})\s*[\u2013-]\s*(?P<died>\d{3,4})\)$")
_BY = re.compile(r"^(?P<what>.+?)\s+(?:written |directed |composed |painted )?by\s+(?P<who>[^,;()]+)$")


def birth_years(docs: Iterable[Doc]) -> dict[str, tuple[Doc, int]]:
    """Title -> (article, birth year) for people whose description gives their years."""
    out: dict[str, tuple[Doc, int]] = {}
    for d in docs:
        m = _LIFE.match(d.description)
        if m and int(m["born"]) < int(m["died"]) <= 2100:
            out[d.title] = (d, int(m["born"]))
    return out


def generate(docs: list[Doc], *, seed: int = 0, comparisons: int = 200) -> list[dict[str, Any]]:
    """Every two-hop question the corpus supports, and up to ``comparisons`` comparison questions."""
    people = birth_years(docs)
    out: list[dict[str, Any]] = []
    for work in docs:
        m = _BY.match(work.description)
        if not m or m["who"].strip() not in people or work.title in people:
            continue
        person, born = people[m["who"].strip()]
        what = m["what"].strip()
        what = what[0].lower() + what[1:]
        out.append(
            {
                "id": f"2hop-{work.id}",
                "type": "two-hop",
                "question": f"In what year was the creator of {work.title} ({what}) born?",
                "answer": str(born),
                "path": [work.id, person.id],
                "searches": [work.title, person.title],
            }
        )
    rng = random.Random(seed)
    names = sorted(people)
    made: set[tuple[str, str]] = set()
    tries = 0
    while len(made) < comparisons and len(names) >= 2 and tries < comparisons * 20:
        tries += 1
        a, b = rng.sample(names, 2)
        (da, ya), (db, yb) = people[a], people[b]
        if ya == yb or (a, b) in made or (b, a) in made:
            continue
        made.add((a, b))
        out.append(
            {
                "id": f"cmp-{da.id}-{db.id}",
                "type": "comparison",
                "question": f"Who was born earlier, {a} or {b}?",
                "answer": a if ya < yb else b,
                "path": [da.id, db.id],
                "searches": [a, b],
            }
        )
    return out


def validate(
    questions: Iterable[dict[str, Any]], index: SearchIndex, progress: Callable[[], None] | None = None
) -> list[dict[str, Any]]:
    """The questions whose intended path works on ``index`` (see the module docstring)."""
    kept: list[dict[str, Any]] = []
    for q in questions:
        if progress is not None:
            progress()
        bodies: list[str] = []
        ok = True
        for title, doc_id in zip(q["searches"], q["path"], strict=True):
            hits = index.search(title, k=1)
            doc = index.open(doc_id)
            if not hits or hits[0]["id"] != doc_id or doc is None:
                ok = False
                break
            bodies.append(doc.body())
        if not ok:
            continue
        if q["type"] == "two-hop":  # the work's article names its creator, whose article gives the year
            ok = q["searches"][1] in bodies[0] and q["answer"] in bodies[1]
        else:
            ok = any(q["answer"] in b for b in bodies)
        if ok:
            kept.append(q)
    return kept
