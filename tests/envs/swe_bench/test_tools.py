"""The generic sandbox tools (bash, view, str_replace, create) as actions through a real orchestrator."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tangram_env import Action, Client


@pytest.fixture
def call(swe_server: Any) -> Iterator[Any]:
    """Run one tool call in this test's own sandbox session (the default image)."""
    client = Client(swe_server.address)
    session = f"tools-{uuid.uuid4().hex[:8]}"

    def run(kind: str, **payload: Any) -> Any:
        (fut,) = client.submit([Action(kind=kind, payload=payload, affinity=session, image="default")])
        result = fut.result(timeout=120)
        assert result.ok, (result.error_type, result.message)
        return result.value

    yield run
    client.close_sessions([session])
    client.close()


def test_bash_runs_in_the_workspace_and_reports_exit_codes(call: Any) -> None:
    out = call("bash", command="pwd && echo hi >&2 && exit 3")
    assert out["exit_code"] == 3 and out["stderr"].strip() == "hi" and out["stdout"].strip()
    assert call("bash", command="sleep 5", timeout_s=1)["killed_by"] == "timeout"


def test_files_persist_across_calls_of_one_session(call: Any) -> None:
    created = call("create", path="pkg/mod.py", file_text="def f():\n    return 1\n\n\nVALUE = 1\n")
    assert "created pkg/mod.py" in created["output"]
    assert "already exists" in call("create", path="pkg/mod.py", file_text="x")["error"]
    shown = call("view", path="pkg/mod.py")
    assert shown["lines"] == 5 and "     2\t    return 1" in shown["output"]
    assert call("view", path="pkg/mod.py", view_range=[5, -1])["output"] == "     5\tVALUE = 1"
    listing = call("view", path=".")
    assert "pkg/mod.py" in listing["output"] and listing["kind"] == "directory"
    edited = call("str_replace", path="pkg/mod.py", old_str="return 1", new_str="return 2")
    assert "return 2" in edited["output"]
    assert (
        call(
            "bash", command="python3 -c 'import sys; sys.path.insert(0, \"pkg\"); import mod; print(mod.f())'"
        )["stdout"].strip()
        == "2"
    )


def test_edit_mistakes_come_back_as_errors_for_the_agent(call: Any) -> None:
    call("create", path="a.txt", file_text="x\nx\ny\n")
    assert "occurs 2 times" in call("str_replace", path="a.txt", old_str="x", new_str="z")["error"]
    assert "lines 1, 2" in call("str_replace", path="a.txt", old_str="x", new_str="z")["error"]
    assert "does not occur" in call("str_replace", path="a.txt", old_str="nope", new_str="z")["error"]
    assert "no such file" in call("view", path="missing.py")["error"]
    assert "no such file" in call("str_replace", path="missing.py", old_str="a", new_str="b")["error"]
    assert "has 3 lines" in call("view", path="a.txt", view_range=[9, 10])["error"]
