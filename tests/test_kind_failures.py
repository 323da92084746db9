"""A real orchestrator facing kinds that fail: bad registrations, bad results, broken plugins.

Every failure costs its own action a result that names the kind, the cause and the fix; the server
keeps serving everyone else.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel

import tangram_env
from tangram_env import Action, Client
from tests.conftest import ServerProcess

PLUGINS = "tests.kind_failure_plugins"


class Nothing(BaseModel):
    pass


@tangram_env.tool(name="kf.local_only", cpu=0.1, mem_mb=16, timeout_s=5)
def local_only(args: Nothing) -> None:
    """Registered in the test process only: the server never imports this module."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # An installed package whose tangram_env.plugins entry point fails to import.
    site = tmp_path_factory.mktemp("site")
    (site / "brokenplug").mkdir()
    (site / "brokenplug" / "__init__.py").write_text("")
    (site / "brokenplug" / "tools.py").write_text("import a_dependency_not_installed_anywhere\n")
    dist = site / "brokenplug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[tangram_env.plugins]\nbrokenplug = brokenplug.tools\n")
    srv = ServerProcess("--plugin", PLUGINS, "--no-gpu-worker", pythonpath=(str(site),))
    yield srv
    srv.stop()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.address) as c:
        yield c


def test_a_kind_whose_limit_no_grant_takes_fails_alone_while_another_client_is_served(
    server: ServerProcess, client: Client
) -> None:
    with Client(server.address) as other:
        (slow,) = other.submit([Action(kind="kf.wait", payload={"seconds": 1.0})])
        (bad,) = client.submit([Action(kind="kf.no_limit")])
        failure = bad.result(timeout=30)
        assert failure.error_type == "rejected" and "'kf.no_limit' cannot be started" in failure.message
        assert "timeout_s" in failure.message
        assert slow.result(timeout=30).value == "done"  # the other client's work went on
    assert client.call("kf.wait", {}) == "done"  # and the server still serves


def test_a_result_with_int_dict_keys_names_the_tool_and_the_fix(client: Client) -> None:
    result = client.run("kf.int_keys", {})
    assert result.error_type == "error"
    assert "kf.int_keys" in result.message and "value['lengths'][1]" in result.message
    assert "keys must be strings" in result.message


def test_an_exception_whose_str_fails_is_reported_by_its_type(client: Client) -> None:
    result = client.run("kf.bad_str", {})
    assert result.error_type == "error"
    assert result.message.startswith("BadStr: ") and "str() raised RuntimeError" in result.message


def test_a_huge_exception_message_is_cut_and_keeps_its_type(client: Client) -> None:
    result = client.run("kf.huge_message", {})
    assert result.error_type == "error"
    assert result.message.startswith("ValueError: yyy") and "characters cut" in result.message
    assert len(result.message) < 10_000 and len(result.traceback) < 40_000
    assert client.call("kf.wait", {}) == "done"


def test_a_misspelt_argument_is_refused_unless_the_model_ignores_extra_keys(client: Client) -> None:
    result = client.run("kf.wait", {"second": 1})
    assert result.error_type == "rejected" and "bad_payload" in result.message
    assert "unknown key 'second' (did you mean 'seconds'?); it accepts 'seconds'" in result.message
    assert client.call("kf.loose", {"n": 2, "m": 1}) == 2  # extra="ignore", its own choice


def test_an_unknown_kind_names_the_entry_point_plugin_that_failed_to_import(client: Client) -> None:
    result = client.run("brokenplug.echo", {})
    assert result.error_type == "rejected" and "unknown_kind" in result.message
    assert "brokenplug (brokenplug.tools: ModuleNotFoundError" in result.message
    assert "a_dependency_not_installed_anywhere" in result.message


def test_the_plugins_own_tools_still_run(client: Client, tmp_path: Path) -> None:
    path = tmp_path / "touched"
    assert client.call("test.touch", {"path": str(path), "line": "x"}) == "x"


def test_an_unknown_kind_this_process_registered_names_the_module_to_load(client: Client) -> None:
    result = client.run("kf.local_only", {})
    assert (
        result.error_type == "rejected" and "no tool or reward model named 'kf.local_only'" in result.message
    )
    assert "registered in this process (by tests.test_kind_failures)" in result.message
    assert "start it with --plugin tests.test_kind_failures" in result.message
