"""Runs a Python command line while recording which functions under a directory it called.

``python trace_run.py OUT ROOT SCRIPT [ARGS...]`` (or ``-c CODE [ARGS...]``, or ``-m MODULE [ARGS...]``)
runs the command in this process, as ``python SCRIPT ARGS`` would, and writes to OUT a JSON list of
``[path under ROOT, first line, name]`` for every function called. Prepare uses it for repositories
whose tests do not run under pytest (django's ``runtests.py``, sympy's runner), to find the functions
some test calls. Standard library only: it runs with the repository's interpreter.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading
from typing import Any


def main(argv: list[str]) -> int:
    """Run the command, record the calls, write them; the command's exit status."""
    out, root, command = argv[0], os.path.realpath(argv[1]) + os.sep, argv[2:]
    codes: set[Any] = set()

    def hook(frame: Any, event: str, arg: Any) -> None:
        codes.add(frame.f_code)  # returns None: no line events, so the run stays fast

    status: Any = 0
    sys.settrace(hook)
    threading.settrace(hook)
    try:
        if command[0] == "-c":
            sys.argv = ["-c", *command[2:]]
            exec(compile(command[1], "<string>", "exec"), {"__name__": "__main__"})
        elif command[0] == "-m":
            sys.argv = [command[1], *command[2:]]
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(command)
            sys.path.insert(0, os.path.dirname(os.path.abspath(command[0])))
            runpy.run_path(command[0], run_name="__main__")
    except SystemExit as exc:
        status = exc.code
    finally:
        sys.settrace(None)
        threading.settrace(None)
        found = set()
        for code in codes:
            real = os.path.realpath(code.co_filename)
            if real.startswith(root):
                found.add((real[len(root) :], code.co_firstlineno, code.co_name))
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(sorted(found), fh)
    return status if isinstance(status, int) else (0 if status is None else 1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
