from __future__ import annotations

import json
from pathlib import Path

import pytest

from tangram_env.envs.swe_bench.instance import (
    TESTBED,
    TESTBED_PYTHON,
    DatasetUnavailable,
    InstanceError,
    SweBenchInstance,
    dump_jsonl,
    load_hf,
    load_instances,
    official_image_name,
    validate_instance,
)

PATCH = """diff --git a/pkg/mod.py b/pkg/mod.py
--- a/pkg/mod.py
+++ b/pkg/mod.py
@@ -1,2 +1,2 @@
 def f(x):
-    return x - 1
+    return x + 1
"""
TEST_PATCH = """diff --git a/tests/test_new.py b/tests/test_new.py
new file mode 100644
--- /dev/null
+++ b/tests/test_new.py
@@ -0,0 +1,2 @@
+def test_new():
+    assert True
"""


def record(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "instance_id": "owner__name-123",
        "repo": "owner/name",
        "base_commit": "0123456789abcdef",
        "problem_statement": "f(1) returns 0, expected 2",
        "hints_text": "",
        "patch": PATCH,
        "test_patch": TEST_PATCH,
        # The published data sets encode these lists as JSON strings.
        "FAIL_TO_PASS": json.dumps(["tests/test_new.py::test_new"]),
        "PASS_TO_PASS": json.dumps(["tests/test_mod.py::test_other"]),
        "version": "1.0",
        "environment_setup_commit": "0123456789abcdef",
        "created_at": "2024-01-01T00:00:00Z",
    }
    base.update(overrides)
    return base


def test_a_published_record_validates_with_official_image_defaults() -> None:
    inst = validate_instance(record())
    assert inst.FAIL_TO_PASS == ["tests/test_new.py::test_new"]
    assert inst.PASS_TO_PASS == ["tests/test_mod.py::test_other"]
    # No image of ours: it runs in the official image, at /testbed, with its conda interpreter.
    assert inst.sandbox_image == "swebench/sweb.eval.x86_64.owner_1776_name-123:latest"
    assert inst.workdir == TESTBED and inst.python == TESTBED_PYTHON
    assert inst.test_files() == ["tests/test_mod.py", "tests/test_new.py"]
    assert inst.patch_files() == ["pkg/mod.py"]


def test_lists_are_accepted_as_lists_too_and_extra_fields_are_ignored() -> None:
    inst = validate_instance(record(FAIL_TO_PASS=["a.py::t"], PASS_TO_PASS=[], model_name="x"))
    assert inst.FAIL_TO_PASS == ["a.py::t"] and inst.PASS_TO_PASS == []


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("FAIL_TO_PASS", "[]", "FAIL_TO_PASS"),
        ("FAIL_TO_PASS", "not json", "FAIL_TO_PASS"),
        ("PASS_TO_PASS", json.dumps(["a", "a"]), "distinct"),
        ("repo", "no-slash", "owner/name"),
        ("instance_id", "bad id!", "instance_id"),
        ("patch", "", "unified diff"),
        ("patch", "just text", "unified diff"),
        ("test_patch", "no diff here", "test_patch"),
        ("base_commit", "", "base_commit"),
        ("problem_statement", "", "problem_statement"),
    ],
)
def test_bad_records_get_a_typed_error_naming_the_field(field: str, value: object, needle: str) -> None:
    with pytest.raises(InstanceError) as err:
        validate_instance(record(**{field: value}))
    assert needle in str(err.value)
    assert "owner__name-123" in str(err.value) or field == "instance_id"
    assert isinstance(err.value, ValueError)


def test_missing_fields_are_named() -> None:
    rec = record()
    del rec["patch"]
    with pytest.raises(InstanceError, match="patch"):
        validate_instance(rec)


def test_json_jsonl_and_parquet_files_round_trip(tmp_path: Path) -> None:
    insts = [validate_instance(record(instance_id=f"owner__name-{i}")) for i in range(3)]
    jsonl = tmp_path / "set.jsonl"
    dump_jsonl(insts, jsonl)
    assert [i.instance_id for i in load_instances(jsonl)] == [i.instance_id for i in insts]
    as_json = tmp_path / "set.json"
    as_json.write_text(json.dumps([record(instance_id=f"owner__name-{i}") for i in range(3)]))
    assert load_instances(as_json) == load_instances(jsonl)

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([record(instance_id=f"owner__name-{i}") for i in range(3)])
    pq.write_table(table, tmp_path / "set.parquet")
    assert load_instances(tmp_path / "set.parquet") == load_instances(jsonl)


def test_file_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(InstanceError, match="does not exist"):
        load_instances(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(record()) + "\n{oops\n")
    with pytest.raises(InstanceError, match=r"bad.jsonl:2"):
        load_instances(bad)
    dup = tmp_path / "dup.json"
    dup.write_text(json.dumps([record(), record()]))
    with pytest.raises(InstanceError, match="appears twice"):
        load_instances(dup)
    other = tmp_path / "set.csv"
    other.write_text("x")
    with pytest.raises(InstanceError, match="unknown instance file type"):
        load_instances(other)
    with pytest.raises(InstanceError, match="neither an instance file nor a data set"):
        load_instances("nonsense")


def test_a_hub_data_set_offline_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # Here there is no hub (and usually no `datasets`): either way the error says what to do instead.
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DatasetUnavailable, match=r"[Oo]ffline, pass a JSON/JSONL/parquet file"):
        load_instances("swe-bench-lite")
    with pytest.raises(DatasetUnavailable):
        load_hf("princeton-nlp/SWE-bench_Verified")


def test_official_image_names() -> None:
    assert (
        official_image_name("django__django-11099")
        == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    )
    assert SweBenchInstance.model_validate(record(image="mine")).sandbox_image == "mine"
