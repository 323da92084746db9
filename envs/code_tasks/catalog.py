"""The code env's tasks: pydantic models and the loader of the task set shipped as package data."""

from __future__ import annotations

import functools
import json
import os
import re
from importlib import resources
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tangram_env.errors import TangramError, UnknownNameError, describe_validation_error, did_you_mean

TASKS_FILE = "tasks.json"
_PACKAGE = __name__.rpartition(".")[0]
_SLUG = r"^[a-z0-9]+(?:-[a-z0-9]+)*$"


class TaskDataError(TangramError, ValueError):
    """A task file that cannot be read or does not validate."""


class CodeTest(BaseModel):
    """One unit test: Python statements that raise (an ``AssertionError``, usually) when it fails."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=100, pattern=r"^[^\n]+$", description="unique within its task")
    code: str = Field(min_length=1, description="test statements; the entry point is bound under its name")
    error_case: bool = Field(
        False,
        description="checks that the solution refuses a bad input (raises); it counts only once one of "
        "the task's ordinary tests passes, so that raising on every call earns nothing",
    )


class CodeTask(BaseModel):
    """A programming task: what to write, how it is called, the tests that grade it, and a solution."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(pattern=_SLUG, description="slug, unique in the task set")
    title: str = Field(min_length=1)
    prompt: str = Field(min_length=1, description="the problem, as an issue would state it")
    signature: str = Field(min_length=1, description="the def or class line(s) the solution must provide")
    entry_point: str = Field(description="the function or class name the tests call")
    tests: tuple[CodeTest, ...] = Field(min_length=1)
    reference_solution: str = Field(min_length=1, description="full source that passes every test")
    difficulty: Literal["easy", "medium", "hard"]
    tags: tuple[str, ...] = Field((), description="topics: strings, lists, dicts, math, parsing, ...")

    @field_validator("entry_point")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not value.isidentifier():
            raise ValueError(f"{value!r} is not a Python identifier")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> CodeTask:
        names = [test.name for test in self.tests]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"task {self.id!r}: test names must be unique, repeated: {duplicates}")
        if all(test.error_case for test in self.tests):  # nothing would ever make its error cases count
            raise ValueError(f"task {self.id!r}: needs at least one test that is not an error_case")
        if not re.match(rf"(def|class)\s+{re.escape(self.entry_point)}\b", self.signature):
            raise ValueError(
                f"task {self.id!r}: the signature must start with 'def/class {self.entry_point}'"
            )
        return self

    @property
    def kind(self) -> Literal["function", "class"]:
        """Whether the solution is a function or a class."""
        return "class" if self.signature.startswith("class") else "function"


class _TaskFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1]
    tasks: tuple[CodeTask, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_ids(self) -> _TaskFile:
        ids = [task.id for task in self.tasks]
        duplicates = sorted({task_id for task_id in ids if ids.count(task_id) > 1})
        if duplicates:
            raise ValueError(f"task ids must be unique, repeated: {duplicates}")
        return self


def parse_tasks(text: str | bytes, source: str = "<tasks>") -> list[CodeTask]:
    """Parse the JSON text of a task file (``{"version": 1, "tasks": [...]}``)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise TaskDataError(f"{source}: not JSON: {exc}") from None
    try:
        return list(_TaskFile.model_validate(data).tasks)
    except ValidationError as exc:
        raise TaskDataError(f"{source}: {describe_validation_error(exc)}") from None


def read_tasks(path: str | os.PathLike[str]) -> list[CodeTask]:
    """Read a task file of your own, in the format of the bundled ``tasks.json``."""
    try:
        with open(path, "rb") as handle:
            text = handle.read()
    except OSError as exc:
        raise TaskDataError(f"cannot read the task file {os.fspath(path)!r}: {exc}") from None
    return parse_tasks(text, os.fspath(path))


@functools.cache
def _bundled() -> tuple[tuple[CodeTask, ...], dict[str, CodeTask]]:
    text = resources.files(_PACKAGE).joinpath(TASKS_FILE).read_bytes()
    tasks = tuple(parse_tasks(text, f"{_PACKAGE}/{TASKS_FILE}"))
    return tasks, {task.id: task for task in tasks}


def load_tasks() -> list[CodeTask]:
    """Return the bundled task set, in file order (read and validated once, then cached)."""
    return list(_bundled()[0])


def task_ids() -> list[str]:
    """Return the ids of the bundled tasks, in file order."""
    return [task.id for task in _bundled()[0]]


def get_task(task_id: str) -> CodeTask:
    """Return the bundled task ``task_id``; :class:`UnknownNameError` (a ``KeyError``) hints at ids."""
    by_id = _bundled()[1]
    try:
        return by_id[task_id]
    except (KeyError, TypeError):
        extra = did_you_mean(str(task_id), by_id)
        raise UnknownNameError(f"no code task named {task_id!r}{extra}") from None
