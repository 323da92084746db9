"""The task set of the ``code`` env and the harness that grades solutions against it.

``tasks.json`` (package data) holds the tasks; ``harness.py`` runs a solution's tests inside a
sandbox and writes a JSON report; :mod:`.grading` builds its spec and reads its report.
"""

from __future__ import annotations

from tangram_env.envs.code_tasks.catalog import (
    CodeTask,
    CodeTest,
    TaskDataError,
    get_task,
    load_tasks,
    parse_tasks,
    read_tasks,
    task_ids,
)
from tangram_env.envs.code_tasks.grading import (
    HARNESS_FILE,
    HarnessReport,
    HarnessSpec,
    TestOutcome,
    harness_invocation,
    harness_source,
    read_report,
)

__all__ = [
    "HARNESS_FILE",
    "CodeTask",
    "CodeTest",
    "HarnessReport",
    "HarnessSpec",
    "TaskDataError",
    "TestOutcome",
    "get_task",
    "harness_invocation",
    "harness_source",
    "load_tasks",
    "parse_tasks",
    "read_report",
    "read_tasks",
    "task_ids",
]
