"""Loading plugin modules: where tools and reward models come from on the orchestrator and workers."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

from tangram_env.kinds import kind_registry

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tangram_env.plugins"


def load_plugins(modules: list[str], files: list[str] = (), *, entry_point_plugins: bool = True) -> list[str]:  # type: ignore[assignment]
    """Import the plugins; returns what was loaded.

    Named modules and files must import (an error stops the server: the user asked for them);
    entry-point plugins that fail are logged and skipped, so one broken package does not take down
    the kinds of the others.
    """
    loaded: list[str] = []
    if entry_point_plugins:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                ep.load()
                loaded.append(ep.value)
            except Exception as exc:
                log.exception(
                    "plugin entry point %s (%s) failed to import; its kinds are unavailable",
                    ep.name,
                    ep.value,
                )
                # A caller of one of its kinds is told why it is unknown (see KindRegistry.get).
                kind_registry.failed_plugins[ep.name] = f"{ep.value}: {type(exc).__name__}: {exc}"
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ImportError(f"--plugin {name}: cannot import it: {_why_not(name, exc)}") from exc
        loaded.append(name)
    for path in files:
        try:
            loaded.append(import_file(path))
        except ImportError as exc:
            raise ImportError(f"--plugin-file {path}: cannot import it: {exc}") from exc
    return loaded


#: Set, with PYTHONSAFEPATH, by the embedded launcher (tangram_env.embedded): see end_safe_path.
SAFE_PATH_MARKER = "TANGRAM_EMBEDDED_SAFE_PATH"


def end_safe_path() -> None:
    """Unset, in an action's process, what the embedded launcher set for the server's own processes.

    It starts the server with PYTHONSAFEPATH so that ``python -m`` (the server, its workers) does not
    put the working directory ahead of the parent's path, where a ``tools.py`` would shadow the
    parent's; a tool's own ``python script.py`` needs the script's folder on its path as usual.
    """
    if os.environ.pop(SAFE_PATH_MARKER, None) is not None:
        os.environ.pop("PYTHONSAFEPATH", None)


def _why_not(name: str, exc: ImportError) -> str:
    """Why the module ``name`` did not import, with the fix when it is not on the path at all."""
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    if missing is None or not (name == missing or name.startswith(f"{missing}.")):
        return str(exc)  # it was found, and something it imports is missing or broken
    return (
        f"No module named {missing!r} on this interpreter's path (the working directory is not on it): "
        "install its package, set PYTHONPATH to the folder that holds it, or give the file with --plugin-file"
    )


def import_file(path: str) -> str:
    """Import a script as a plugin module, under a name that is not ``__main__``.

    The script's ``if __name__ == "__main__":`` block does not run, exactly as with multiprocessing's
    spawn start method: a script that registers tools and then starts envs must guard the latter.
    """
    file = Path(path).resolve()
    name = f"tangram_plugin_{file.stem}"
    if name in sys.modules:
        return name
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import plugin file {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))
    _importing.append(str(file))
    try:
        spec.loader.exec_module(module)
    finally:
        _importing.pop()
    return name


#: The plugin files being imported now (innermost last).
_importing: list[str] = []


def importing_file() -> str | None:
    """The plugin file whose top level is running now, if any: an orchestrator loading its tools."""
    return _importing[-1] if _importing else None
