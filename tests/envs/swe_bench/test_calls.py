from __future__ import annotations

import json

import pytest

from tangram_env.envs.swe_bench.calls import CallError, ToolCall, parse_call
from tangram_env.shell_tools import ARGS_MODELS

TOOLS = {**ARGS_MODELS, "submit": None}


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "bash", "arguments": {"command": "ls -la"}}',
        # OpenAI's tool_calls give the arguments as a JSON string
        '{"name": "bash", "arguments": "{\\"command\\": \\"ls -la\\"}"}',
        '{"type": "function", "function": {"name": "bash", "arguments": {"command": "ls -la"}}}',
        '{"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", '
        '"arguments": "{\\"command\\": \\"ls -la\\"}"}}]}',
        '[{"name": "bash", "parameters": {"command": "ls -la"}}]',
        'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>',
        'I will list files:\n```json\n{"name": "bash", "arguments": {"command": "ls -la"}}\n```\n',
        "Raw fallback:\n```bash\nls -la\n```\n",
    ],
)
def test_accepted_formats_give_the_same_call(text: str) -> None:
    assert parse_call(text, TOOLS) == ToolCall("bash", {"command": "ls -la"})


def test_submit_as_json_or_plain_word() -> None:
    assert parse_call('{"name": "submit", "arguments": {}}', TOOLS) == ToolCall("submit", {})
    assert parse_call("  submit\n", TOOLS) == ToolCall("submit", {})


def test_edit_tools_validate_their_arguments() -> None:
    call = parse_call(
        json.dumps({"name": "str_replace", "arguments": {"path": "a.py", "old_str": "x", "new_str": "y"}}),
        TOOLS,
    )
    assert call == ToolCall("str_replace", {"path": "a.py", "old_str": "x", "new_str": "y"})
    view = parse_call('{"name": "view", "arguments": {"path": "a.py", "view_range": [3, -1]}}', TOOLS)
    assert view == ToolCall("view", {"path": "a.py", "view_range": [3, -1]})


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("hello there", "no tool call found"),
        ('{"name": "bsh", "arguments": {"command": "ls"}}', "did you mean 'bash'"),
        ('{"name": "bash", "arguments": {}}', "invalid arguments for bash: command: Field required"),
        ('{"name": "bash", "arguments": {"command": "ls", "cwd": "/"}}', "cwd"),
        ('{"name": "bash", "arguments": "ls"}', "must be a JSON object"),
        ('{"name": "bash", "arguments": [1]}', "must be a JSON object"),
        ('{"name": "view", "arguments": {"path": "a", "view_range": [5, 2]}}', "view_range"),
        (
            '[{"name": "bash", "arguments": {"command": "a"}}, '
            '{"name": "bash", "arguments": {"command": "b"}}]',
            "exactly one tool call",
        ),
        ('{"arguments": {"command": "ls"}}', '"name"'),
        ('{"name": "create", "arguments": {"path": "a.py"}}', "file_text"),
    ],
)
def test_bad_calls_say_what_is_wrong(text: str, needle: str) -> None:
    out = parse_call(text, TOOLS)
    assert isinstance(out, CallError)
    assert needle in out.message


def test_non_text_actions_are_errors_not_exceptions() -> None:
    out = parse_call(42, TOOLS)
    assert isinstance(out, CallError) and "must be text" in out.message
