"""The SWE-bench instance schema and loaders (JSON, JSONL, parquet files and Hugging Face data sets).

The fields are SWE-bench's own. In the published data sets ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` are
JSON-encoded strings; the model accepts those and plain lists alike. A few optional fields say how this
environment runs an instance (its sandbox image, interpreter and test command); instances loaded from
the public data sets get defaults that fit the official SWE-bench Docker images.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tangram_env.errors import TangramError, describe_validation_error

#: Data set names accepted by :func:`load_instances` (short alias -> Hugging Face name).
HF_DATASETS = {
    "swe-bench": "princeton-nlp/SWE-bench",
    "swe-bench-lite": "princeton-nlp/SWE-bench_Lite",
    "swe-bench-verified": "princeton-nlp/SWE-bench_Verified",
    "princeton-nlp/SWE-bench": "princeton-nlp/SWE-bench",
    "princeton-nlp/SWE-bench_Lite": "princeton-nlp/SWE-bench_Lite",
    "princeton-nlp/SWE-bench_Verified": "princeton-nlp/SWE-bench_Verified",
    "SWE-bench/SWE-bench": "SWE-bench/SWE-bench",
    "SWE-bench/SWE-bench_Lite": "SWE-bench/SWE-bench_Lite",
    "SWE-bench/SWE-bench_Verified": "SWE-bench/SWE-bench_Verified",
}

#: Where the official SWE-bench images keep the repository and the interpreter its tests run with.
TESTBED = "/testbed"
TESTBED_PYTHON = "/opt/miniconda3/envs/testbed/bin/python"

_INSTANCE_ID = re.compile(r"^[A-Za-z0-9_.\-]+$")
_DIFF_FILE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)


class InstanceError(TangramError, ValueError):
    """An instance or instance file that cannot be used (the message says which and why)."""


class DatasetUnavailable(TangramError, RuntimeError):
    """A Hugging Face data set that cannot be loaded here (no ``datasets`` package, or offline)."""


class SweBenchInstance(BaseModel):
    """One SWE-bench task: a repository at a commit, an issue, the fix and the tests that check it."""

    model_config = ConfigDict(extra="ignore")

    instance_id: str = Field(min_length=1, max_length=200, description="unique id, e.g. 'owner__repo-1234'")
    repo: str = Field(min_length=1, description="'owner/name' of the repository")
    base_commit: str = Field(min_length=4, description="commit the patch applies to")
    problem_statement: str = Field(min_length=1, description="the issue text the agent reads")
    hints_text: str = Field("", description="comments on the issue before the fix")
    patch: str = Field(description="the gold patch (source files only)")
    test_patch: str = Field("", description="the patch adding or changing the tests that check the fix")
    FAIL_TO_PASS: list[str] = Field(min_length=1, description="tests the fix makes pass")
    PASS_TO_PASS: list[str] = Field(default_factory=list, description="tests that pass before and after")
    version: str = Field("", description="the repository's release the instance belongs to")
    environment_setup_commit: str = Field("", description="commit whose environment the tests run in")
    created_at: str = ""

    # How this environment runs the instance (not part of the published schema; defaults fit the
    # official SWE-bench Docker images).
    image: str | None = Field(None, description="sandbox image with the repository and its environment")
    workdir: str | None = Field(None, description="repository root in the sandbox; None: the workspace")
    python: str = Field("python", description="interpreter that runs the tests, inside the sandbox")
    test_env: dict[str, str] = Field(default_factory=dict, description="environment of the test run")
    pytest_args: list[str] = Field(default_factory=list, description="extra pytest arguments")
    runner: str | None = Field(None, description="test runner by name (default: the repository's)")
    test_command: str | None = Field(None, description="shell command that runs the tests (the runner's)")
    test_directives: list[str] = Field(
        default_factory=list, description="what the runner's command names (default: the test patch's files)"
    )

    @model_validator(mode="before")
    @classmethod
    def _official_defaults(cls, data: Any) -> Any:
        # A record without an image of ours is a published one: it runs in the official image.
        if isinstance(data, dict) and not data.get("image"):
            data = dict(data)
            data.setdefault("workdir", TESTBED)
            if not data.get("python"):
                data["python"] = TESTBED_PYTHON
        return data

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _decode_test_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else []
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON list of test ids: {exc}") from None
        if hasattr(value, "tolist"):  # a numpy array from parquet
            value = value.tolist()
        return value

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS")
    @classmethod
    def _distinct_tests(cls, value: list[str]) -> list[str]:
        if any(not t.strip() for t in value):
            raise ValueError("test ids must not be empty")
        if len(set(value)) != len(value):
            raise ValueError("test ids must be distinct")
        return value

    @field_validator("instance_id")
    @classmethod
    def _id_chars(cls, value: str) -> str:
        if not _INSTANCE_ID.match(value):
            raise ValueError("only letters, digits and '_.-' are allowed")
        return value

    @field_validator("repo")
    @classmethod
    def _repo_shape(cls, value: str) -> str:
        if value.count("/") != 1 or value.startswith("/") or value.endswith("/"):
            raise ValueError("expected 'owner/name'")
        return value

    @field_validator("patch")
    @classmethod
    def _patch_is_a_diff(cls, value: str) -> str:
        if not value.strip() or "\n+++ " not in f"\n{value}" or "@@" not in value:
            raise ValueError("the gold patch must be a non-empty unified diff")
        return value

    @field_validator("test_patch")
    @classmethod
    def _test_patch_is_a_diff(cls, value: str) -> str:
        if value.strip() and ("@@" not in value or "+++ " not in value):
            raise ValueError("test_patch must be empty or a unified diff")
        return value

    @property
    def sandbox_image(self) -> str:
        """The image the instance's sandboxes start from (the official image name if none is set)."""
        return self.image or official_image_name(self.instance_id)

    def test_files(self) -> list[str]:
        """Files grading restores to ``base_commit`` before applying ``test_patch``: those the test
        patch touches, those the FAIL_TO_PASS/PASS_TO_PASS test ids live in, and those the instance's
        runner names or runs itself with.
        """
        files = {m.group(2) for m in _DIFF_FILE.finditer(self.test_patch)}
        for test in [*self.FAIL_TO_PASS, *self.PASS_TO_PASS]:
            path = test.split("::", 1)[0]
            if "::" in test and path.endswith(".py"):
                files.add(path)
        from tangram_env.envs.swe_bench.runners import UnsupportedInstance, runner_for

        try:  # the files the runner runs, and the runner itself (django's runtests.py, sympy's bin/test)
            files.update(runner_for(self).test_files(self))
        except UnsupportedInstance:
            pass
        return sorted(files)

    def patch_files(self) -> list[str]:
        """Files the gold patch changes."""
        return sorted({m.group(2) for m in _DIFF_FILE.finditer(self.patch)})


def official_image_name(instance_id: str, arch: str = "x86_64") -> str:
    """The official SWE-bench evaluation image of ``instance_id`` on Docker Hub."""
    return f"swebench/sweb.eval.{arch}.{instance_id.lower().replace('__', '_1776_')}:latest"


def validate_instance(record: dict[str, Any], where: str = "") -> SweBenchInstance:
    """``record`` as an instance, or :class:`InstanceError` naming the record and its bad fields, or
    saying that no runner here can grade it (refused when loaded, never graded as 0.0).
    """
    from tangram_env.envs.swe_bench.runners import UnsupportedInstance, check_runnable

    at = f" ({where})" if where else ""
    try:
        inst = SweBenchInstance.model_validate(record)
    except ValidationError as exc:
        name = record.get("instance_id", "?") if isinstance(record, dict) else "?"
        raise InstanceError(
            f"invalid SWE-bench instance {name!r}{at}: {describe_validation_error(exc)}"
        ) from exc
    try:
        check_runnable(inst)
    except UnsupportedInstance as exc:
        raise InstanceError(f"cannot grade SWE-bench instance{at}: {exc}") from exc
    return inst


def _validated(records: Iterable[Any], where: str) -> list[SweBenchInstance]:
    from tangram_env.envs.swe_bench.formats import convert, detect_format

    out: list[SweBenchInstance] = []
    seen: set[str] = set()
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise InstanceError(f"{where}: record {i} is a {type(record).__name__}, not an object")
        if detect_format(record) != "swe-bench":  # SWE-smith and R2E-Gym rows load as they are published
            try:
                inst = convert(record)
            except InstanceError as exc:
                raise InstanceError(f"{where}, record {i}: {exc}") from exc
        else:
            inst = validate_instance(record, f"{where}, record {i}")
        if inst.instance_id in seen:
            raise InstanceError(f"{where}: instance id {inst.instance_id!r} appears twice")
        seen.add(inst.instance_id)
        out.append(inst)
    if not out:
        raise InstanceError(f"{where}: no instances")
    return out


def load_json(path: str | Path) -> list[SweBenchInstance]:
    """Instances from a JSON file holding a list of records (or one record)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InstanceError(f"{path}: not valid JSON: {exc}") from None
    return _validated(data if isinstance(data, list) else [data], str(path))


def load_jsonl(path: str | Path) -> list[SweBenchInstance]:
    """Instances from a JSON Lines file, one record per line (blank lines are skipped)."""
    path = Path(path)
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise InstanceError(f"{path}:{n}: not valid JSON: {exc}") from None
    return _validated(records, str(path))


def load_parquet(path: str | Path) -> list[SweBenchInstance]:
    """Instances from a parquet file (needs ``pyarrow``)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InstanceError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    table = pq.read_table(str(path))
    return _validated(table.to_pylist(), str(path))


def load_hf(name: str, split: str = "test") -> list[SweBenchInstance]:
    """Instances of a Hugging Face data set (``princeton-nlp/SWE-bench``, ``..._Lite``, ``..._Verified``
    or their short aliases); needs the ``datasets`` package and network access to the hub.
    """
    dataset = HF_DATASETS.get(name, name)
    try:
        import datasets
    except ImportError:
        raise DatasetUnavailable(
            f"loading {dataset!r} needs the 'datasets' package (pip install datasets) and network access; "
            "offline, pass a JSON/JSONL/parquet file or use the offline set (instances=None)"
        ) from None
    try:
        rows = datasets.load_dataset(dataset, split=split)
    except Exception as exc:  # the hub's errors vary by version: connection, offline mode, missing
        raise DatasetUnavailable(
            f"could not load {dataset!r} (split {split!r}) from the Hugging Face hub: {type(exc).__name__}: "
            f"{exc}. Offline, pass a JSON/JSONL/parquet file or use the offline set (instances=None)"
        ) from exc
    return _validated((dict(r) for r in rows), dataset)


def load_instances(source: str | Path, split: str = "test") -> list[SweBenchInstance]:
    """Instances from a file (by extension: ``.json``, ``.jsonl``, ``.parquet``) or a data set name."""
    path = Path(source)
    suffix = path.suffix.lower()
    if path.exists():
        if suffix == ".json":
            return load_json(path)
        if suffix in (".jsonl", ".ndjson"):
            return load_jsonl(path)
        if suffix == ".parquet":
            return load_parquet(path)
        raise InstanceError(f"{path}: unknown instance file type {suffix!r} (use .json, .jsonl or .parquet)")
    if suffix in (".json", ".jsonl", ".ndjson", ".parquet"):
        raise InstanceError(f"instance file {path} does not exist")
    if str(source) in HF_DATASETS or "/" in str(source):
        return load_hf(str(source), split=split)
    known = ", ".join(sorted(k for k in HF_DATASETS if "/" not in k))
    raise InstanceError(f"{source!r} is neither an instance file nor a data set name (known: {known})")


def dump_jsonl(instances: Iterable[SweBenchInstance], path: str | Path) -> None:
    """Write ``instances`` as JSON Lines, test lists as JSON strings like the published data sets."""
    lines = []
    for inst in instances:
        record = inst.model_dump()
        record["FAIL_TO_PASS"] = json.dumps(record["FAIL_TO_PASS"])
        record["PASS_TO_PASS"] = json.dumps(record["PASS_TO_PASS"])
        lines.append(json.dumps(record, sort_keys=True))
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
