"""``tangram-env prepare deep-search``: build the search index and the validated questions.

Reads the vital-articles corpus (see :mod:`.corpus`), writes every article to a SQLite FTS5 index,
generates two-hop and comparison questions from the articles' structure (:mod:`.questions`), keeps
those whose intended path works on the index, and stores them in the same file. Everything lives at
``$TANGRAM_CACHE_DIR/deep-search/index.sqlite`` (default ``~/.cache/tangram/deep-search``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tangram_env.envs.deep_search.corpus import load_vital_articles
from tangram_env.envs.deep_search.index import SearchIndex, build_index, has_fts5
from tangram_env.envs.deep_search.questions import generate, validate


def default_index_path() -> Path:
    """``$TANGRAM_CACHE_DIR/deep-search/index.sqlite``, else under ``~/.cache/tangram``."""
    base = os.environ.get("TANGRAM_CACHE_DIR")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "tangram"
    return root / "deep-search" / "index.sqlite"


def prepare(
    out: str | Path | None = None, corpus: str | Path | None = None, *, comparisons: int = 200, seed: int = 0
) -> tuple[Path, int, int]:
    """Build the index at ``out``; return its path, the documents and the questions kept."""
    from rich.progress import Progress

    path = Path(out) if out else default_index_path()
    docs = list(load_vital_articles(corpus))
    questions = generate(docs, seed=seed, comparisons=comparisons)
    with Progress() as bar:
        task = bar.add_task("indexing articles", total=len(docs))
        draft = build_index(docs, path.with_suffix(".draft"), progress=lambda n: bar.advance(task, n))
        check = bar.add_task("validating questions", total=len(questions))
        kept = validate(questions, SearchIndex(draft), progress=lambda: bar.advance(check))
        final = bar.add_task("writing the index", total=len(docs))
        build_index(docs, path, kept, progress=lambda n: bar.advance(final, n))
    draft.unlink(missing_ok=True)
    return path, len(docs), len(kept)


def prepare_main(argv: list[str]) -> int:
    """``tangram-env prepare deep-search [--out FILE] [--corpus JSON] [--comparisons N]``."""
    p = argparse.ArgumentParser(prog="tangram-env prepare deep-search", description=__doc__.split("\n")[0])
    p.add_argument("--out", help=f"index file (default {default_index_path()})")
    p.add_argument("--corpus", help="articles JSON (default: the installed vital-articles package)")
    p.add_argument("--comparisons", type=int, default=200, help="comparison questions to generate")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not has_fts5():
        print(
            "tangram-env: this Python's SQLite has no FTS5; the deep-search index needs it", file=sys.stderr
        )
        return 1
    try:
        path, ndocs, nquestions = prepare(args.out, args.corpus, comparisons=args.comparisons, seed=args.seed)
    except FileNotFoundError as exc:
        print(f"tangram-env: {exc}", file=sys.stderr)
        return 1
    print(f"deep-search: {ndocs} articles and {nquestions} validated questions in {path}")
    return 0
