"""Reading an agent's tool call from text.

The action is one tool call in the function-calling JSON format of the env's tools. Accepted shapes:

- ``{"name": "bash", "arguments": {"command": "ls"}}`` (``arguments`` may be a JSON string, as in
  OpenAI's ``tool_calls``; ``parameters``, ``args`` and ``input`` are accepted for ``arguments``);
- ``{"type": "function", "function": {"name": ..., "arguments": ...}}``;
- ``{"tool_calls": [<one call>]}`` or ``[<one call>]`` (exactly one call per step);
- any of these inside a ```` ```json ```` fence or ``<tool_call>...</tool_call>`` tags, around other text.

Raw-text fallback, when the text holds no JSON call: the first ```` ```bash ```` (or ``sh``/``shell``)
fenced block is run as ``bash``; the text ``submit`` alone submits. Anything else is a
:class:`CallError` whose message tells the agent what was wrong.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from tangram_env.errors import describe_validation_error, did_you_mean

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_JSON_FENCE = re.compile(r"```(?:json)?[ \t]*\n(.*?)```", re.DOTALL)
_SHELL_FENCE = re.compile(r"```(?:bash|sh|shell|console)[ \t]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """A tool call that names a known tool with arguments that validate."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class CallError:
    """Why the text is not a usable tool call (shown to the agent as the observation)."""

    message: str


def _decode(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _candidates(text: str) -> list[Any]:
    """JSON values in ``text``: the whole text, tagged calls, fenced blocks."""
    found: list[Any] = []
    whole = _decode(text.strip())
    if whole is not None:
        found.append(whole)
    for pattern in (_TAGGED, _JSON_FENCE):
        for match in pattern.finditer(text):
            value = _decode(match.group(1).strip())
            if value is not None:
                found.append(value)
    return found


def _unwrap(value: Any) -> tuple[Any, str]:
    """The single call inside ``value`` (unwrapping lists and ``tool_calls``), or an error text."""
    if isinstance(value, dict) and "tool_calls" in value:
        value = value["tool_calls"]
    if isinstance(value, list):
        if len(value) != 1:
            return None, f"expected exactly one tool call per step, got {len(value)}"
        value = value[0]
    if isinstance(value, dict) and isinstance(value.get("function"), dict):
        value = value["function"]
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None, 'a tool call is a JSON object {"name": <tool>, "arguments": {...}}'
    return value, ""


def parse_call(text: str, tools: dict[str, type[BaseModel] | None]) -> ToolCall | CallError:
    """The tool call in ``text`` for the tools named in ``tools`` (name -> argument model; None: no
    arguments), or the reason it is not one.
    """
    if not isinstance(text, str):
        return CallError(f"the action must be text, got {type(text).__name__}")
    problem = ""
    for value in _candidates(text):
        call, problem = _unwrap(value)
        if call is not None:
            return _validate(call, tools)
    if problem:
        return CallError(problem)
    shell = _SHELL_FENCE.search(text)
    if shell and "bash" in tools:
        return _validate({"name": "bash", "arguments": {"command": shell.group(1).strip()}}, tools)
    if text.strip().lower() in ("submit", "submit()") and "submit" in tools:
        return ToolCall("submit", {})
    return CallError(
        "no tool call found. Reply with one call as JSON, e.g. "
        f'{{"name": "bash", "arguments": {{"command": "ls"}}}}; tools: {", ".join(tools)}'
    )


def _validate(call: dict[str, Any], tools: dict[str, type[BaseModel] | None]) -> ToolCall | CallError:
    name = call["name"]
    if name not in tools:
        extra = did_you_mean(name, tools, n=1)
        return CallError(f"unknown tool {name!r}{extra} (tools: {', '.join(tools)})")
    raw: Any = next((call[k] for k in ("arguments", "parameters", "args", "input") if k in call), {})
    if isinstance(raw, str):
        decoded = _decode(raw) if raw.strip() else {}
        if not isinstance(decoded, dict):
            return CallError(f"the arguments of {name} must be a JSON object, got the string {raw[:200]!r}")
        raw = decoded
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        return CallError(f"the arguments of {name} must be a JSON object, got {type(raw).__name__}")
    model = tools[name]
    if model is None:
        return ToolCall(name, {})
    try:
        args = model.model_validate(raw)
    except ValidationError as exc:
        return CallError(f"invalid arguments for {name}: {describe_validation_error(exc)}")
    return ToolCall(name, args.model_dump(exclude_none=True))
