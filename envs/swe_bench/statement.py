"""Problem statements for injected bugs, written the way a user files an issue.

A statement says what was run and what went wrong (the failing tests and their assertion or exception
messages) and what was expected; it never names the changed line or the fix. Wording is picked from a
few phrasings by a seed, so a set of instances does not read as one template.
"""

from __future__ import annotations

import random
import re

_MAX_SHOWN = 3
_MAX_MESSAGE_LINES = 12
_MAX_MESSAGE_CHARS = 900

_OPENINGS = (
    "After upgrading to {pkg} {version}, part of the test suite fails for me.",
    "I'm seeing test failures with {pkg} {version} on a clean checkout.",
    "Running the tests of {pkg} {version} gives failures that look like a regression.",
    "Something is off in {pkg} {version}: some of its own tests fail.",
)
_EXPECTED = (
    "I would expect these tests to pass; they exercise documented behaviour.",
    "Expected: the tests pass, as the behaviour they check is what the documentation describes.",
    "These used to pass, and nothing in my environment changed apart from the checkout.",
)
_CLOSINGS = (
    "Could someone take a look?",
    "Happy to provide more details if needed.",
    "Let me know if you need anything else to reproduce this.",
    "",
)


def _short(message: str) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", message).strip()  # colour codes from assertion rewriting
    # Object addresses differ from run to run: left out, so a statement is the same every time.
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", text)
    text = re.sub(r"\b0x[0-9a-fA-F]{6,}\b", "0x...", text)
    text = re.sub(r"\.\.\.x[0-9a-fA-F]{6,}>", "...>", text)  # pytest's shortened reprs
    lines = text.splitlines()[:_MAX_MESSAGE_LINES]
    text = "\n".join(lines)
    if len(text) > _MAX_MESSAGE_CHARS:
        text = text[:_MAX_MESSAGE_CHARS] + " ..."
    return text or "(the test failed without a message)"


def _test_name(nodeid: str) -> str:
    return nodeid.rsplit("::", 1)[-1]


def _title(failing: list[str], messages: dict[str, str]) -> str:
    first = failing[0]
    headline = _short(messages.get(first, "")).splitlines()[0]
    if len(headline) > 90:
        headline = headline[:87] + "..."
    return f"{_test_name(first)} fails: {headline}"


def write_statement(
    package: str,
    version: str,
    failing: list[str],
    messages: dict[str, str],
    seed: int = 0,
    command: str | None = None,
) -> str:
    """An issue-style report of ``failing`` (node ids, in order) with their failure ``messages``;
    ``command`` is what the reporter ran (default: pytest on the failing tests).
    """
    if not failing:
        raise ValueError("a problem statement needs at least one failing test")
    rng = random.Random(seed)
    shown = failing[:_MAX_SHOWN]
    parts = [_title(failing, messages), "", rng.choice(_OPENINGS).format(pkg=package, version=version), ""]
    count = f"{len(failing)} test{'s' if len(failing) != 1 else ''}"
    parts.append(
        f"Running `{command or 'python -m pytest ' + ' '.join(shown)}` reports {count} failing"
        + (f" ({len(failing) - len(shown)} more not shown):" if len(failing) > len(shown) else ":")
    )
    for nodeid in shown:
        parts += ["", f"`{nodeid}`:", "```", _short(messages.get(nodeid, "")), "```"]
    if len(failing) > len(shown):
        parts += [
            "",
            "Also failing: "
            + ", ".join(f"`{_test_name(t)}`" for t in failing[len(shown) : 12])
            + (" and others." if len(failing) > 12 else "."),
        ]
    parts += ["", rng.choice(_EXPECTED)]
    closing = rng.choice(_CLOSINGS)
    if closing:
        parts += ["", closing]
    return "\n".join(parts) + "\n"
