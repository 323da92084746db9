"""The offline set: what prepare made from the PyPI packages, checked from the outside."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tangram_env import Action, Client, Elastic
from tangram_env.envs.swe_bench.instance import SweBenchInstance
from tangram_env.envs.swe_bench.packages import PACKAGES
from tangram_env.envs.swe_bench.prepare import cache_root, instances_file, prepare_main


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def repo_of(inst: SweBenchInstance) -> Path:
    pkg = next(p for p in PACKAGES if p.repo == inst.repo)
    return cache_root() / "packages" / f"{pkg.slug}-{pkg.version}" / "repos" / inst.instance_id


def test_each_instance_is_one_commit_with_the_bug_and_a_gold_patch(
    offline_subset: list[SweBenchInstance],
) -> None:
    assert len({i.instance_id for i in offline_subset}) == len(offline_subset)
    assert {i.repo for i in offline_subset} == {"jpvanhal/inflection", "gweis/isodate"}
    for inst in offline_subset:
        repo = repo_of(inst)
        assert git(repo, "rev-parse", "HEAD").strip() == inst.base_commit
        assert git(repo, "rev-list", "--count", "HEAD").strip() == "1"  # no history that shows the fix
        assert git(repo, "status", "--porcelain") == ""
        check = subprocess.run(
            ["git", "apply", "--check", "-"], cwd=repo, input=inst.patch, text=True, capture_output=True
        )
        assert check.returncode == 0, check.stderr
        assert len(inst.patch_files()) == 1 and inst.test_patch == ""
        assert inst.FAIL_TO_PASS and not set(inst.FAIL_TO_PASS) & set(inst.PASS_TO_PASS)
        fixed = [
            ln[1:].strip()
            for ln in inst.patch.splitlines()
            if ln.startswith("+") and not ln.startswith("+++")
        ]
        assert len(fixed) == 1
        if len(fixed[0]) > 12:  # the correct line is not given away
            assert fixed[0] not in inst.problem_statement
        assert inst.FAIL_TO_PASS[0] in inst.problem_statement


def test_every_instance_has_a_sandbox_image(offline_subset: list[SweBenchInstance]) -> None:
    from tangram_env.images import get_image

    for inst in offline_subset:
        image = get_image(inst.sandbox_image)
        assert image.workspace and (Path(image.workspace) / ".git").is_dir()
        assert image.python and Path(image.python, "bin", "python").exists()


@pytest.mark.slow
def test_gold_resolves_and_empty_does_not_in_sandboxes(
    offline_subset: list[SweBenchInstance], swe_server: Any
) -> None:
    """The validation prepare does on the host, redone as elastic grading actions on the orchestrator."""
    actions = [
        Action(
            kind="swe_bench.grade",
            image=inst.sandbox_image,
            elastic=Elastic(min_par=1, max_par=2),
            payload={"instance": inst.model_dump(), "patch": patch, "timeout_s": 300},
        )
        for inst in offline_subset
        for patch in (inst.patch, None)
    ]
    with Client(swe_server.address) as client:
        results = [f.result(timeout=600) for f in client.submit(actions)]
    for action, result in zip(actions, results, strict=True):
        assert result.ok, (result.error_type, result.message)
        expect = action.payload["patch"] is not None
        assert result.value["resolved"] is expect, result.value.get("log")
        assert 1 <= result.parallelism <= 2 and result.value["parallelism"] == result.parallelism


def test_the_cli_lists_and_reports_from_the_cache(
    offline_subset: list[SweBenchInstance], capsys: pytest.CaptureFixture[str]
) -> None:
    assert prepare_main(["--list"]) == 0
    listing = capsys.readouterr().out
    assert len(PACKAGES) >= 5 and all(p.requirement in listing for p in PACKAGES)
    # Each with the runner that grades it: the repository's own, not the package's default field.
    rows = {line.split()[1]: line.split()[2] for line in listing.splitlines() if line.strip()}
    assert rows["psf/requests"] == "pytest-options" and rows["django/django"] == "django"
    assert prepare_main(["--packages", "inflection", "--limit", "2", "--no-images", "--json"]) == 0
    out = capsys.readouterr().out
    assert "validated 2 instances from 1 packages" in out and '"validated": 2' in out
    assert instances_file().exists()
    assert prepare_main(["--packages", "nosuchpkg"]) == 1
    assert "unknown package" in capsys.readouterr().err


def test_docker_images_without_an_engine_are_a_clear_error(
    offline_subset: list[SweBenchInstance],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    assert prepare_main(["--packages", "inflection", "--limit", "1", "--no-images", "--docker"]) == 1
    assert re.search(r"no Docker engine answers here.*dockerd|needs the docker SDK", capsys.readouterr().err)


def test_a_missing_set_says_how_to_prepare_it(tmp_path: Path) -> None:
    from tangram_env.envs.swe_bench.prepare import PrepareError, offline_instances

    with pytest.raises(PrepareError, match="tangram-env prepare swe-bench"):
        offline_instances(tmp_path / "empty-cache", auto_prepare=False)


def test_instances_of_swe_bench_repositories_are_served_from_the_cache(
    offline_subset: list[SweBenchInstance], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # What ``prepare swe-bench --repos requests`` leaves in a cache, made here from a prepared
    # instance (its repository and environment linked in under the requests release's names), beside
    # that instance itself (the default set) and one of a release this version does not know.
    from tangram_env.envs.swe_bench.instance import dump_jsonl
    from tangram_env.envs.swe_bench.packages import SWE_BENCH_PACKAGES
    from tangram_env.envs.swe_bench.prepare import offline_instances

    source = offline_subset[0]
    own = next(p for p in PACKAGES if p.repo == source.repo)
    pkg = next(p for p in SWE_BENCH_PACKAGES if p.repo == "psf/requests")
    served = source.model_copy(
        update={"instance_id": "psf__requests-1", "repo": pkg.repo, "version": pkg.version}
    )
    stale = served.model_copy(update={"instance_id": "psf__requests-2", "version": "0.0.1"})
    cache = tmp_path / "cache"
    for p, inst in ((own, source), (pkg, served)):
        repos = cache / "packages" / f"{p.slug}-{p.version}" / "repos"
        repos.mkdir(parents=True)
        (repos / inst.instance_id).symlink_to(repo_of(source))
        (cache / "venvs").mkdir(exist_ok=True)
        (cache / "venvs" / f"{p.slug}-{p.version}").symlink_to(
            cache_root() / "venvs" / f"{own.slug}-{own.version}"
        )
    dump_jsonl([source, served, stale], cache / "instances.jsonl")
    got = offline_instances(cache, auto_prepare=False, image_root=tmp_path / "images")
    assert [i.instance_id for i in got] == [source.instance_id, "psf__requests-1"]
    assert "1 instance(s)" in capsys.readouterr().err  # only the unknown release is left out


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--jobs", "0"], "jobs must be at least 1"),
        (["--jobs", "-2"], "jobs must be at least 1"),
        (["--repos", ""], "--repos names no package or repository"),
        (["--packages", " , "], "--packages names no package or repository"),
        (["--limit", "0"], "limit must be at least 1"),
    ],
)
def test_the_cli_refuses_arguments_that_ask_for_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], error: str
) -> None:
    # Each but --limit used to run a full default prepare; refused, nothing touches the cache (one
    # that cannot even be made: under a file).
    (tmp_path / "file").write_text("")
    assert prepare_main([*argv, "--cache-dir", str(tmp_path / "file" / "cache"), "--no-images"]) == 1
    assert capsys.readouterr().err.strip() == f"error: {error}"


def test_an_images_commit_is_read_from_a_packed_ref_too(tmp_path: Path) -> None:
    # A large repository's prepare runs `git gc`, which packs refs/heads/main: read only as a loose
    # ref, its image never matched and was rebuilt (a whole Django copy) on every make("swe-bench").
    from tangram_env.envs.swe_bench.prepare import _same_commit

    inst = SimpleNamespace(base_commit="6beea4015cff394fc35ab5ef1f9e1d7fe5789c09")
    git = tmp_path / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    assert not _same_commit(str(tmp_path), inst)  # type: ignore[arg-type]
    (git / "packed-refs").write_text(
        "# pack-refs with: peeled fully-peeled sorted \n"
        f"{inst.base_commit} refs/heads/main\n"
        "0000000000000000000000000000000000000000 refs/heads/other\n"
    )
    assert _same_commit(str(tmp_path), inst)  # type: ignore[arg-type]
    (git / "refs" / "heads" / "main").write_text("1" * 40 + "\n")  # a loose ref wins over the pack
    assert not _same_commit(str(tmp_path), inst)  # type: ignore[arg-type]
