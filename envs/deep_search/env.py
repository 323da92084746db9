"""The ``deep-search`` env: answer a multi-hop question by searching and reading an encyclopaedia.

Each step the agent calls one tool, written as a function call in JSON::

    {"name": "search", "arguments": {"query": "Adventures of Huckleberry Finn"}}
    {"name": "open", "arguments": {"doc_id": "mark_twain"}}
    {"name": "answer", "arguments": {"answer": "1835"}}

``search`` and ``open`` run as actions (one request each of the ``web-search`` API, scheduled under
its quota); ``answer`` ends the episode with reward 1.0 for an exact match after normalisation (or the
token F1 with ``reward="f1"``; ``info`` has both). ``max_turns`` calls at most, then the episode is
truncated with reward 0. Observation: the question, then the last tool's output. A malformed call costs
a turn and says what was wrong. A search service that fails (down, refusing the key) is not the
agent's doing: the step raises :class:`~tangram_env.errors.RewardUnavailable` (vector envs flag it)
instead of scoring it. An answer to a comparison that also names the wrong choice scores 0.
"""

from __future__ import annotations

import json
import os
import string
import threading
from pathlib import Path
from typing import Any

from gymnasium import spaces

from tangram_env.env import EnvGen, TangramEnv, check_turns
from tangram_env.envs.deep_search.grading import (
    exact_match,
    f1_score,
    names_another_choice,
    names_another_number,
    names_no_choice,
)
from tangram_env.envs.deep_search.tools import OpenArgs, SearchArgs
from tangram_env.protocol import Action
from tangram_env.rewards import graded

MAX_ACTION = 4096
MAX_OBSERVATION = 60_000
# Observations are Unicode (names, places); anything outside this set is shown as "?".
OBS_CHARSET = frozenset(string.printable) | frozenset(
    chr(i) for i in range(0xA0, 0x3000) if chr(i).isprintable()
)

TOOL_SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the encyclopaedia; returns article ids, titles and snippets.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "words to search for"}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "open",
            "description": "Read an article in full, by the id a search returned.",
            "parameters": {
                "type": "object",
                "properties": {"doc_id": {"type": "string", "description": "article id"}},
                "required": ["doc_id"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "answer",
            "description": "Give the final answer (ends the episode).",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string", "description": "a short answer"}},
                "required": ["answer"],
            },
        },
    },
]


def parse_call(text: str) -> tuple[str, dict[str, Any]]:
    """A tool call ``{"name": ..., "arguments": {...}}`` as (name, arguments); ValueError says why not."""
    if len(text) > MAX_ACTION:
        raise ValueError(f"the action is {len(text)} characters long; at most {MAX_ACTION}")
    try:
        call = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the action is not JSON ({exc.msg})") from None
    except RecursionError:  # "[[[[..." is the agent's text: it must not crash the step
        raise ValueError("the action's JSON is nested too deeply") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError('the action must be {"name": TOOL, "arguments": {...}}')
    args = call.get("arguments", {})
    if isinstance(args, str):  # some chat APIs send the arguments JSON-encoded
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            raise ValueError("the arguments are not JSON, or nested too deeply") from None
    if not isinstance(args, dict):
        raise ValueError("the arguments must be an object")
    return call["name"], args


class DeepSearchEnv(TangramEnv[str, str]):
    """Multi-hop question answering over an encyclopaedia; see the module docstring.

    ``index``: the prepared index (default: what ``tangram-env prepare deep-search`` built);
    ``search_url``: the search service (default ``TANGRAM_SEARCH_URL``, else the env starts a local
    ``tangram-search-server`` over ``index`` and stops it on close); ``question_ids``: a subset.
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi"]}
    reset_options = frozenset({"question_id"})

    def __init__(
        self,
        *,
        index: str | os.PathLike[str] | None = None,
        search_url: str | None = None,
        max_turns: int = 8,
        question_ids: list[str] | None = None,
        reward: str = "em",
        k: int = 5,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        from tangram_env.envs.deep_search.index import SearchIndex
        from tangram_env.envs.deep_search.prepare import default_index_path

        if reward not in ("em", "f1"):
            raise ValueError(f"reward must be 'em' or 'f1', got {reward!r}")
        self.max_turns = check_turns(max_turns)
        self.index_path = Path(index) if index is not None else default_index_path()
        questions = SearchIndex(self.index_path).questions()
        if question_ids is not None:
            by_id = {q["id"]: q for q in questions}
            missing = [i for i in question_ids if i not in by_id]
            if missing:
                raise ValueError(f"no questions {missing} in {self.index_path}")
            questions = [by_id[i] for i in question_ids]
        if not questions:
            raise ValueError(f"{self.index_path} holds no questions: run `tangram-env prepare deep-search`")
        self.questions = questions
        self._owns_service = False
        self.search_url = search_url or os.environ.get("TANGRAM_SEARCH_URL") or ""
        self.reward_metric, self.k = reward, k
        self.observation_space = spaces.Text(max_length=MAX_OBSERVATION, min_length=0, charset=OBS_CHARSET)
        self.action_space = spaces.Text(max_length=MAX_ACTION, min_length=0, charset=string.printable)
        self.question = questions[0]
        self.turn = 0
        self._observation = ""

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools in the function-calling format LLM agents read."""
        return TOOL_SCHEMAS

    def _endpoint(self) -> str:
        if not self.search_url:  # nothing configured: serve the index ourselves, on loopback
            self.search_url = _local_services.acquire(self.index_path)
            self._owns_service = True
        return self.search_url

    def _show(self, text: str) -> str:
        text = "".join(ch if ch in OBS_CHARSET else "?" for ch in text)
        self._observation = text[:MAX_OBSERVATION]
        return self._observation

    def _reset(
        self, *, seed: int | None, options: dict[str, Any] | None
    ) -> EnvGen[tuple[str, dict[str, Any]]]:
        question_id = (options or {}).get("question_id")
        if question_id is not None:
            matches = [q for q in self.questions if q["id"] == question_id]
            if not matches:
                raise ValueError(f"no question {question_id!r} in this env")
            self.question = matches[0]
        else:
            self.question = self.questions[int(self.np_random.integers(len(self.questions)))]
        self.turn = 0
        obs = self._show(f"Question: {self.question['question']}")
        return obs, {
            "question_id": self.question["id"],
            "type": self.question["type"],
            "max_turns": self.max_turns,
        }
        yield []  # a reset needs no action

    def _step(self, action: str) -> EnvGen[tuple[str, float, bool, bool, dict[str, Any]]]:
        self.turn += 1
        info: dict[str, Any] = {"question_id": self.question["id"], "turn": self.turn}
        reward, terminated = 0.0, False
        try:
            name, args = parse_call(str(action))
            output = ""
            if name == "answer":
                given, gold = args.get("answer", ""), self.question["answer"]
                if not isinstance(given, str):
                    raise ValueError(f"'answer' must be a string, not {type(given).__name__}")
                em, f1 = exact_match(given, gold), f1_score(given, gold)
                choices = self.question["searches"]
                comparison = self.question["type"] == "comparison"
                # Hedges score nothing under either metric: token F1 would pay every guess in a list.
                if names_another_number(given, gold) or (
                    comparison
                    and (names_another_choice(given, gold, choices) or names_no_choice(given, gold, choices))
                ):
                    em = f1 = 0.0
                reward = em if self.reward_metric == "em" else f1
                info.update(em=em, f1=f1, answer=given, gold=gold)
                terminated = True
                output = f"Your answer: {given}"
            elif name in ("search", "open"):
                payload = (
                    {"query": str(args.get("query", "")), "k": self.k}
                    if name == "search"
                    else {"doc_id": str(args.get("doc_id", ""))}
                )
                model = SearchArgs if name == "search" else OpenArgs
                model.model_validate(payload)  # the agent's arguments: a ValidationError is a ValueError
                payload["endpoint"] = self._endpoint()
                (result,) = yield [Action(kind=f"deep_search.{name}", payload=payload)]
                # A failed call (the service down, the key refused) is not the agent's doing: the
                # step earns no reward (RewardUnavailable: raised, or flagged in vector envs).
                output = _render(name, graded(result, f"the {name} call"))
            else:
                raise ValueError(f"unknown tool {name!r}; use search, open or answer")
        except ValueError as exc:
            output = f"Invalid action: {exc}"
            info["invalid"] = str(exc)
        obs = self._show(f"Question: {self.question['question']}\n\n{output}")
        truncated = not terminated and self.turn >= self.max_turns
        return obs, reward, terminated, truncated, info

    def _close(self) -> None:
        if self._owns_service:
            _local_services.release(self.index_path)
            self._owns_service = False

    def render(self) -> str | None:
        """The current observation as text (``render_mode="ansi"``)."""
        return self._observation if self.render_mode == "ansi" else None


class _LocalServices:
    """One local search service per index for all the envs of a process (a vector env shares it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[Path, tuple[Any, int]] = {}

    def acquire(self, index: Path) -> str:
        from tangram_env.envs.deep_search.service import ServiceProcess

        with self._lock:
            svc, users = self._running.get(index, (None, 0))
            if svc is None:
                svc = ServiceProcess(index)
            self._running[index] = (svc, users + 1)
            return str(svc.url)

    def release(self, index: Path) -> None:
        with self._lock:
            svc, users = self._running.pop(index, (None, 0))
            if svc is not None and users > 1:
                self._running[index] = (svc, users - 1)
            elif svc is not None:
                svc.stop()


_local_services = _LocalServices()


def _render(name: str, value: Any) -> str:
    if name == "search":
        hits = value.get("results", [])
        if not hits:
            return f"No results for {value.get('query', '')!r}."
        return "\n".join(f"{i}. [{h['id']}] {h['title']}: {h['snippet']}" for i, h in enumerate(hits, 1))
    if "error" in value:
        return f"Cannot open: {value['error']}"
    return f"[{value['id']}] {value['text']}"
