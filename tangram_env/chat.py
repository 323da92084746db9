"""Chat-native text envs: observations as chat messages, actions as OpenAI-style tool calls.

A text env built with ``chat=True`` speaks the shape chat trainers already hold:

- observations are the *new* messages of the turn, ready to append to the conversation: the reset
  gives ``[{"role": "user", "content": <task>}]``; a step answering tool calls gives one
  ``{"role": "tool", "tool_call_id": ..., "content": ...}`` per call, otherwise a ``user`` message;
- an action is the assistant's message (``{"role": "assistant", "content": ..., "tool_calls": [...]}``
  as OpenAI returns it), a list of tool calls, one tool call, or plain text;
- ``env.tools`` is the env's tools as an OpenAI ``tools`` list (checked by :func:`check_tools`).

The env's own logic stays text in, text out: :class:`ChatTextEnv` converts at the edges.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import gymnasium

#: What OpenAI (and most servers speaking its API) accept as a function name.
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
ROLES = ("system", "user", "assistant", "tool")


def check_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``tools`` if it is a valid OpenAI ``tools`` list, else a ValueError naming what is wrong."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ValueError(
                f'tools[{i}] must be {{"type": "function", "function": {{...}}}}, got {tool!r:.200}'
            )
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ValueError(f"tools[{i}] has the name {name!r}; names must match {TOOL_NAME.pattern}")
        if name in seen:
            raise ValueError(f"tools[{i}]: the name {name!r} is used twice")
        seen.add(name)
        params = function.get("parameters", {"type": "object"})
        if not isinstance(params, dict) or params.get("type") != "object":
            raise ValueError(f"tools[{i}] ({name}): parameters must be a JSON schema of type object")
    return tools


class ChatMessages(gymnasium.spaces.Space[list[dict[str, Any]]]):
    """The space of chat message lists (each message a dict with a ``role`` and string ``content``)."""

    def __init__(self) -> None:
        super().__init__(shape=None, dtype=None)

    def contains(self, x: Any) -> bool:
        """Whether ``x`` is a list of chat messages."""
        return isinstance(x, list) and all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in x
        )

    def sample(self, mask: Any = None, probability: Any = None) -> list[dict[str, Any]]:
        """An empty user message (chat content has no meaningful random sample)."""
        return [{"role": "user", "content": ""}]

    @property
    def is_np_flattenable(self) -> bool:
        """Messages do not flatten into an array."""
        return False

    def __repr__(self) -> str:
        return "ChatMessages()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChatMessages)


class ChatAction(ChatMessages):
    """The space of chat actions: text, an assistant message, a list of tool calls or one tool call."""

    def contains(self, x: Any) -> bool:
        """Whether ``x`` is something :func:`read_action` accepts."""
        if isinstance(x, str):
            return True
        if isinstance(x, dict):
            return "tool_calls" in x or "content" in x or "function" in x
        return isinstance(x, list) and all(isinstance(c, dict) for c in x)

    def sample(self, mask: Any = None, probability: Any = None) -> Any:
        """An empty assistant message."""
        return {"role": "assistant", "content": ""}

    def __repr__(self) -> str:
        return "ChatAction()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChatAction)


@dataclass(frozen=True)
class ChatTurn:
    """An action read by :func:`read_action`: the assistant's text and its tool calls (OpenAI shape)."""

    text: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def call_ids(self) -> list[str]:
        """The ids of the calls, in order (each gets its own ``tool`` message back)."""
        return [str(c.get("id") or f"call_{i}") for i, c in enumerate(self.tool_calls)]


def read_action(action: Any) -> ChatTurn:
    """The text and tool calls of a chat action (see the module docstring for the accepted shapes)."""
    if isinstance(action, str):
        return ChatTurn(action)
    if isinstance(action, list):
        return ChatTurn("", [_call(c) for c in action])
    if isinstance(action, dict):
        if "function" in action:
            return ChatTurn("", [_call(action)])
        calls = action.get("tool_calls") or []
        content = action.get("content")
        text = content if isinstance(content, str) else _content_text(content)
        return ChatTurn(text, [_call(c) for c in calls])
    raise TypeError(
        f"a chat action is text, an assistant message, or tool calls; got {type(action).__name__}"
    )


def _call(call: Any) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise TypeError(f"a tool call is a dict in OpenAI's shape, got {type(call).__name__}")
    return call


def _content_text(content: Any) -> str:
    """Text of a message whose content is a list of parts (``[{"type": "text", "text": ...}]``)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def call_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call's arguments as a dict (OpenAI sends them as a JSON string); {} when unreadable."""
    raw = call.get("function", call).get("arguments", {})
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return {}
    return raw if isinstance(raw, dict) else {}


def call_name(call: dict[str, Any]) -> str:
    """A tool call's function name."""
    return str(call.get("function", call).get("name", ""))


def reply(text: str, turn: ChatTurn | None) -> list[dict[str, Any]]:
    """The messages answering ``turn``: one ``tool`` message per call, else one ``user`` message."""
    if turn is not None and turn.tool_calls:
        return [{"role": "tool", "tool_call_id": i, "content": text} for i in turn.call_ids]
    return [{"role": "user", "content": text}]


class ChatTextEnv:
    """Mixin for :class:`~tangram_env.env.TangramEnv` subclasses whose observations and actions are text.

    With ``self.chat`` set (the env's ``chat=True`` argument), observations become chat messages and
    actions may be assistant messages with tool calls; the subclass's ``_reset``/``_step`` still see
    and return text. A subclass says how tool calls become its text action in :meth:`_chat_text`.
    """

    chat: bool = False
    _chat_turn: ChatTurn | None = None
    observation_space: gymnasium.spaces.Space[Any]
    action_space: gymnasium.spaces.Space[Any]

    def _use_chat(self, chat: bool) -> None:
        """Switch chat mode on (call from ``__init__`` after the spaces are set)."""
        self.chat = chat
        if chat:
            self.observation_space = ChatMessages()
            self.action_space = ChatAction()

    def _chat_text(self, turn: ChatTurn) -> str:
        """The text action for ``turn``: its tool calls as JSON if it has any, else its text."""
        if turn.tool_calls:
            return json.dumps({"tool_calls": turn.tool_calls})
        return turn.text

    def begin_step(self, action: Any) -> Any:
        """Read a chat action into the env's text action, then step as usual."""
        if self.chat:
            self._chat_turn = read_action(action)
            action = self._chat_text(self._chat_turn)
        return super().begin_step(action)  # type: ignore[misc]

    def _finish_reset(self, value: Any, results: Any) -> Any:
        obs, info = super()._finish_reset(value, results)  # type: ignore[misc]
        if self.chat:
            self._chat_turn = None
            obs = reply(obs, None)
        return obs, info

    def _finish_step(self, value: Any, results: Any) -> Any:
        obs, *rest = super()._finish_step(value, results)  # type: ignore[misc]
        if self.chat:
            obs = reply(obs, self._chat_turn)
        return (obs, *rest)

    def _flagged_step(self, error: Any, results: Any) -> Any:
        # The base class gives the last text observation back; a chat env's observations are messages,
        # and a chat trainer appends them, so the turn's tool calls still each get their answer.
        obs, *rest = super()._flagged_step(error, results)  # type: ignore[misc]
        if self.chat:
            obs = reply(f"The episode ended here: {error}", self._chat_turn)
        return (obs, *rest)
