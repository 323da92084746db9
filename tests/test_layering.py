"""The layering of the design, checked on the source: envs, reward models and the SDK never import the
server (the SDK only starts one, in its embedded launcher, as a separate process).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

#: Folders whose code must import only ``tangram_env`` (and third-party packages), never the server.
CLIENT_SIDE = ("tangram_env", "envs", "reward_models")


def _server_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        found += [f"{where}:{node.lineno} imports {n}" for n in names if _is_server(n)]
    return found


def _is_server(name: str) -> bool:
    return name == "tangram_env.server" or name.startswith("tangram_env.server.")


@pytest.mark.parametrize("folder", CLIENT_SIDE)
def test_client_side_code_never_imports_the_server(folder: str) -> None:
    offences = [o for path in sorted((ROOT / folder).rglob("*.py")) for o in _server_imports(path)]
    assert offences == [], "\n".join(offences)


def test_the_check_sees_a_server_import(tmp_path: Path) -> None:
    bad = tmp_path / "probe.py"
    bad.write_text("from tangram_env.server.sandbox import images\nimport tangram_env.server\n")
    assert len(_server_imports(bad)) == 3


@pytest.mark.parametrize(
    "folder", ("tangram_env", "server", "envs", "reward_models", "benchmarks", "examples")
)
def test_every_project_import_names_a_module_that_exists(folder: str) -> None:
    # mypy lets a missing module pass (ignore_missing_imports), and imports inside functions run late:
    # a module moved without its callers shows here, not on a user's first call.
    import importlib.util

    missing = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                if (
                    name.split(".")[0] in ("tangram_env", "benchmarks")
                    and importlib.util.find_spec(name) is None
                ):
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert missing == [], "\n".join(missing)
