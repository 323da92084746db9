"""A scripted agent that follows a question's intended path, reading the answer from what it opens.

It searches each title of the path, opens the article the search ranks first, and reads the birth
years from the articles' descriptions: the year itself for a two-hop question, the earlier-born name
for a comparison. It sees only observations (never the gold answer), so a score of 1.0 checks the
question, the index, the search service and the env end to end.
"""

from __future__ import annotations

import json
import re
from typing import Any

_YEARS = re.compile(r"\((\d{3,4})\s*[\u2013-]\s*\d{3,4}\)")
_FIRST_HIT = re.compile(r"^1\. \[([^\]]+)\]", re.MULTILINE)


def call(name: str, **arguments: Any) -> str:
    """A tool call as the env's action text."""
    return json.dumps({"name": name, "arguments": arguments})


def solve(env: Any, question: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Play one episode of ``question`` along its intended path; return the reward and the last info."""
    env.reset(options={"question_id": question["id"]})
    births: list[tuple[str, int]] = []
    for title in question["searches"]:
        obs, _, _, _, _ = env.step(call("search", query=title))
        hit = _FIRST_HIT.search(obs)
        if hit is None:
            raise AssertionError(f"search for {title!r} found nothing: {obs[:300]}")
        obs, _, _, _, _ = env.step(call("open", doc_id=hit.group(1)))
        lines = obs.splitlines()
        top = next((i for i, line in enumerate(lines) if line.startswith("[")), len(lines))
        description = lines[top + 1] if top + 1 < len(lines) else ""  # "[id] Title", then its description
        years = _YEARS.search(description)
        if years is not None:
            births.append((title, int(years.group(1))))
    two_hop = question["type"] == "two-hop"  # the last person's year, or the earlier-born name
    answer = str(births[-1][1]) if two_hop else min(births, key=lambda b: b[1])[0]
    _, reward, terminated, _, info = env.step(call("answer", answer=answer))
    assert terminated
    return float(reward), info
