"""The verdict's rules on per-test statuses, the strict reading of reports, and the planted tests."""

from __future__ import annotations

import json

import pytest

from tangram_env.envs.swe_bench.canaries import check_canaries, make_canaries
from tangram_env.envs.swe_bench.verdict import ReportError, parse_run
from tangram_env.envs.swe_bench.verdict import tests_status as status_of

F2P = "t.py::test_fix"
P2P = "t.py::test_keep"


@pytest.mark.parametrize(
    ("status", "resolves", "maintains"),
    [
        ("PASSED", True, True),
        ("XFAIL", False, True),
        ("SKIPPED", False, True),
        ("XPASS", False, False),
        ("FAILED", False, False),
        ("ERROR", False, False),
        (None, False, False),  # never reported
    ],
)
def test_fail_to_pass_must_run_and_pass_pass_to_pass_follows_swe_bench(
    status: str | None, resolves: bool, maintains: bool
) -> None:
    statuses = {} if status is None else {F2P: status, P2P: status}
    out = status_of([F2P], [P2P], statuses)
    assert (out["FAIL_TO_PASS"]["success"] == [F2P]) is resolves
    assert (out["FAIL_TO_PASS"]["failure"] == [F2P]) is not resolves
    assert (out["PASS_TO_PASS"]["success"] == [P2P]) is maintains
    assert (out["PASS_TO_PASS"]["failure"] == [P2P]) is not maintains


def test_cut_short_ids_stand_for_the_tests_they_prefix_when_those_agree() -> None:
    cut = "t.py::test_grammar[log(photon"
    full = {f"{cut})-a]": "PASSED", f"{cut})-b]": "PASSED"}
    assert status_of([cut], [], full)["FAIL_TO_PASS"]["success"] == [cut]
    mixed = {**full, f"{cut})-c]": "SKIPPED"}
    assert status_of([cut], [cut], mixed)["FAIL_TO_PASS"]["failure"] == [cut]
    assert status_of([], [cut], mixed)["PASS_TO_PASS"]["success"] == [cut]  # skipped is maintained
    assert status_of([], [cut], {**mixed, f"{cut})-d]": "FAILED"})["PASS_TO_PASS"]["failure"] == [cut]
    # A complete id never matches by prefix.
    assert status_of(["t.py::test_x"], [], {"t.py::test_x2": "PASSED"})["FAIL_TO_PASS"]["failure"]


def test_the_legacy_rules_let_skips_and_xfails_through() -> None:
    out = status_of([F2P], [P2P], {F2P: "XFAIL", P2P: "SKIPPED"}, legacy=True)
    assert out["FAIL_TO_PASS"] == {"success": [F2P], "failure": []}
    assert out["PASS_TO_PASS"] == {"success": [], "failure": []}


def good_report() -> dict[str, object]:
    shard = {
        "returncode": 1,
        "timed_out": False,
        "tail": "",
        "tests": {F2P: {"status": "PASSED", "message": ""}},
    }
    return {"shards": [shard], "wall_s": 1.5}


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda r: "not json",
        lambda r: json.dumps({**r, "extra": 1}),
        lambda r: json.dumps({**r, "shards": r["shards"] * 2}),  # more shards than the run had
        lambda r: json.dumps(r).replace('"PASSED"', '"PASSED!"'),
        lambda r: json.dumps(r).replace('"returncode": 1', '"returncode": "1"'),
        lambda r: json.dumps(r).replace(F2P, "x" * 5000),
        lambda r: json.dumps(r).replace('"message": ""', '"message": "' + "m" * 5000 + '"'),
    ],
)
def test_a_report_that_is_not_the_runners_is_refused(corrupt) -> None:  # type: ignore[no-untyped-def]
    assert parse_run(json.dumps(good_report()), 1).shards[0].tests[F2P].status == "PASSED"
    with pytest.raises(ReportError):
        parse_run(corrupt(good_report()), 1)


def test_planted_tests_have_fresh_names_and_known_outcomes() -> None:
    a, b = make_canaries("tests"), make_canaries("tests")
    assert a.path != b.path and a.path.startswith("tests/test_") and not set(a.expected) & set(b.expected)
    assert sorted(a.expected.values()) == ["FAILED", "FAILED", "PASSED", "PASSED"]
    assert check_canaries(a, dict(a.expected)) == []
    all_passed = dict.fromkeys(a.expected, "PASSED")
    assert check_canaries(a, all_passed) == ["a planted test that must fail came back PASSED"]
    assert check_canaries(a, {}) == [
        "a planted test that must fail did not report",
        "a planted test that must pass did not report",
    ]
