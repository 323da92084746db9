"""The full-text index: SQLite FTS5 (standard library) over the corpus's documents.

One file holds the documents (``docs``: id, title, description, text), their FTS5 index and the
generated questions (``questions``), so the search service and the env share one prepared artefact.
Ranking is BM25 with the title weighted above the body; a document whose title equals the query
comes first, as a search engine's entity card would.
"""

from __future__ import annotations

import contextlib
import json
import queue
import re
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TOKEN = re.compile(r"\w+", re.UNICODE)
SNIPPET_CHARS = 240


@dataclass(frozen=True)
class Doc:
    """One encyclopaedia article."""

    id: str
    title: str
    description: str
    text: str

    def body(self) -> str:
        """The article as the ``open`` endpoint shows it."""
        head = f"{self.title}\n{self.description}\n\n" if self.description else f"{self.title}\n\n"
        return head + self.text


def slug(title: str) -> str:
    """A stable document id from a title (``"Mark Twain"`` -> ``"mark_twain"``)."""
    return "_".join(_TOKEN.findall(title.lower())) or "doc"


def has_fts5() -> bool:
    """Whether this Python's SQLite was built with FTS5."""
    try:
        con = sqlite3.connect(":memory:")
        con.execute("CREATE VIRTUAL TABLE t USING fts5(x)")
        con.close()
        return True
    except sqlite3.OperationalError:
        return False


def build_index(
    docs: Iterable[Doc],
    path: str | Path,
    questions: Iterable[dict[str, Any]] = (),
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write ``docs`` (and ``questions``) to a fresh index at ``path``; ``progress(n)`` after each batch."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.unlink(missing_ok=True)
    con = sqlite3.connect(tmp)
    try:
        con.executescript(
            """
            CREATE TABLE docs (id TEXT PRIMARY KEY, title TEXT NOT NULL, description TEXT NOT NULL,
                               text TEXT NOT NULL, title_key TEXT NOT NULL);
            CREATE INDEX docs_title_key ON docs (title_key);
            CREATE VIRTUAL TABLE docs_fts USING fts5(title, body, content='', tokenize='unicode61');
            CREATE TABLE questions (id TEXT PRIMARY KEY, data TEXT NOT NULL);
            """
        )
        batch: list[Doc] = []

        def flush() -> None:
            con.executemany(
                "INSERT INTO docs (id, title, description, text, title_key) VALUES (?, ?, ?, ?, ?)",
                [(d.id, d.title, d.description, d.text, title_key(d.title)) for d in batch],
            )
            con.executemany(
                "INSERT INTO docs_fts (rowid, title, body) "
                "VALUES ((SELECT rowid FROM docs WHERE id = ?), ?, ?)",
                [(d.id, d.title, f"{d.description}\n{d.text}") for d in batch],
            )
            if progress is not None:
                progress(len(batch))
            batch.clear()

        for doc in docs:
            batch.append(doc)
            if len(batch) >= 500:
                flush()
        if batch:
            flush()
        con.executemany(
            "INSERT INTO questions (id, data) VALUES (?, ?)",
            [(q["id"], json.dumps(q)) for q in questions],
        )
        con.commit()
    finally:
        con.close()
    tmp.replace(path)
    return path


def title_key(text: str) -> str:
    """A title or query reduced to its lowercase words, for the exact-title lookup."""
    return " ".join(_TOKEN.findall(text.lower()))


def fts_query(text: str) -> str:
    """A user's query as an FTS5 expression: its words, each quoted, any of them (BM25 ranks)."""
    words = _TOKEN.findall(text.lower())[:32]
    return " OR ".join(f'"{w}"' for w in words)


class SearchIndex:
    """Read-only queries on an index file; safe to share between threads (one connection each)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(
                f"no search index at {self.path}: run `tangram-env prepare deep-search` to build it"
            )
        # Connections are pooled, not per thread: the service answers each request on a new thread.
        self._pool: queue.SimpleQueue[sqlite3.Connection] = queue.SimpleQueue()

    @contextlib.contextmanager
    def _con(self) -> Iterator[sqlite3.Connection]:
        try:
            con = self._pool.get_nowait()
        except queue.Empty:
            con = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
        try:
            yield con
        finally:
            self._pool.put(con)

    def search(self, query: str, k: int = 5) -> list[dict[str, str]]:
        """The ``k`` best documents for ``query``: id, title and a snippet of each."""
        expr = fts_query(query)
        if not expr:
            return []
        with self._con() as con:
            return self._search(con, query, expr, k)

    def _search(self, con: sqlite3.Connection, query: str, expr: str, k: int) -> list[dict[str, str]]:
        rows = con.execute(
            "SELECT d.id, d.title, d.description, d.text FROM docs_fts f JOIN docs d ON d.rowid = f.rowid "
            "WHERE docs_fts MATCH ? ORDER BY bm25(docs_fts, 8.0, 1.0) LIMIT ?",
            (expr, max(k, 1) * 4),
        ).fetchall()
        wanted = title_key(query)
        exact = [r for r in rows if title_key(r[1]) == wanted]
        if not exact:  # the entity card: a title equal to the query, even if BM25 missed it
            exact = con.execute(
                "SELECT id, title, description, text FROM docs WHERE title_key = ?", (wanted,)
            ).fetchall()
        ordered = exact + [r for r in rows if r not in exact]
        return [{"id": r[0], "title": r[1], "snippet": _snippet(r[2], r[3])} for r in ordered[: max(k, 1)]]

    def open(self, doc_id: str) -> Doc | None:
        """The document ``doc_id`` (None if there is none)."""
        with self._con() as con:
            sql = "SELECT id, title, description, text FROM docs WHERE id = ?"
            row = con.execute(sql, (doc_id,)).fetchone()
        return Doc(*row) if row else None

    def count(self) -> int:
        """Documents in the index."""
        with self._con() as con:
            return int(con.execute("SELECT count(*) FROM docs").fetchone()[0])

    def questions(self) -> list[dict[str, Any]]:
        """The questions stored with the index, in id order."""
        with self._con() as con:
            rows = con.execute("SELECT data FROM questions ORDER BY id").fetchall()
        return [json.loads(r[0]) for r in rows]


def _snippet(description: str, text: str) -> str:
    head = f"{description}. {text}" if description else text
    return head if len(head) <= SNIPPET_CHARS else head[: SNIPPET_CHARS - 1].rsplit(" ", 1)[0] + "…"
