"""Settings resolved at the edge (file, environment, flags) reach the scheduler, the sandbox provider
and each image's SandboxSpec."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from tangram_env.server.cli import _serve_parser, settings_from_args
from tangram_env.server.config import ServerSettings, resolve_settings
from tangram_env.server.resources import make_configured_scheduler, make_sandbox_pool


def _settings(*argv: str) -> ServerSettings:
    return settings_from_args(_serve_parser().parse_args(list(argv)))


def test_flags_over_environment_over_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "server.toml"
    file.write_text(
        'scheduler = "fcfs"\nmax_retries = 5\nresult_ttl_s = "2m"\nsandbox_provider = "docker"\n'
        '[sandbox_spec]\nmem_mb = "512MiB"\nmax_pids = 99\n'
        '[sandbox_images.big]\nmem_mb = "4GiB"\nnetwork = true\n'
        "[scheduler_options]\nage_rate = 3.0\n"
    )
    monkeypatch.setenv("TANGRAM_SERVER_MAX_RETRIES", "7")
    settings = _settings("--config", str(file), "--scheduler", "elastic", "--sandbox-spec", "max_pids=50")
    assert settings.scheduler == "elastic"  # flag over file
    assert settings.max_retries == 7  # environment over file
    assert settings.result_ttl_s == 120.0  # file over default, in human units
    default, big = settings.spec_for_image("default"), settings.spec_for_image("big")
    assert (default.mem_mb, default.max_pids, default.network) == (
        512,
        50,
        False,
    )  # the flag merged into the table
    assert (big.mem_mb, big.network, big.image) == (4096, True, "big")
    assert make_configured_scheduler(settings).config.age_rate == 3.0  # reaches PolicyConfig


def test_network_with_the_local_provider_needs_every_peer_known(tmp_path: Path) -> None:
    # A local sandbox with network shares the host's: its code could register as a worker and answer
    # other trajectories' tests (an audit did), or submit grading actions of its own.
    with pytest.raises(
        ValidationError, match="worker_token, and curve_secret_key_file with curve_clients_dir"
    ):
        ServerSettings(sandbox_images={"swe": {"network": True}})
    with pytest.raises(ValidationError, match=r"images 'default'\)"):
        ServerSettings(sandbox_spec={"network": "true"}, worker_token="s")  # a token alone is not enough
    guarded = ServerSettings(
        sandbox_spec={"network": True},
        worker_token="s",
        curve_secret_key_file=str(tmp_path / "server.key_secret"),
        curve_clients_dir=str(tmp_path / "clients"),
    )
    assert guarded.spec_for_image("default").network
    assert (
        ServerSettings(sandbox_provider="docker", sandbox_spec={"network": True}).spec_for_image("x").network
    )


def test_the_file_can_come_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "server.json"
    file.write_text(json.dumps({"sandbox_options": {"none": {"state_dir": str(tmp_path / "boxes")}}}))
    monkeypatch.setenv("TANGRAM_SERVER_CONFIG", str(file))
    settings = resolve_settings({"sandbox_provider": "none"})
    assert settings.provider_options() == {"state_dir": str(tmp_path / "boxes")}


def test_provider_options_and_specs_reach_the_pool(tmp_path: Path) -> None:
    settings = _settings(
        "--sandbox",
        "none",
        "--sandbox-option",
        f"state_dir={tmp_path / 'boxes'}",
        "--sandbox-spec",
        "mem_mb=300",
        "--sandbox-spec",
        "max_pids=77",
    )
    pool = make_sandbox_pool(settings)
    try:
        assert pool.provider.state_dir == str(tmp_path / "boxes")
        sandbox = pool.acquire("default")
        assert (sandbox.spec.mem_mb, sandbox.spec.max_pids) == (300, 77)
    finally:
        pool.close()


def test_bad_settings_name_their_cause(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"(?s)image 'default'.*mem_mb.*greater than 0"):
        _settings("--sandbox-spec", "mem_mb=-5")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"sandbox_provder": "docker"}))
    with pytest.raises(ValueError, match=r"unknown settings \['sandbox_provder'\]"):
        _settings("--config", str(bad))
    with pytest.raises(ValueError, match="cannot read the settings file"):
        _settings("--config", str(tmp_path / "missing.toml"))
    with pytest.raises(ValueError, match="expected NAME=VALUE"):
        _settings("--scheduler-option", "age_rate")


def test_the_memory_a_live_sandbox_reserves_comes_from_its_image_settings() -> None:
    settings = ServerSettings(
        sandbox_spec={"mem_mb": "2GiB"},
        sandbox_images={"swe": {"mem_mb": "8GiB", "reserve_mb": "1GiB"}, "tiny": {"reserve_mb": 0}},
    )
    assert settings.reserve_for_image("default") == 256  # 1/8 of its mem_mb
    assert settings.reserve_for_image("swe") == 1024 and settings.spec_for_image("swe").mem_mb == 8192
    assert settings.reserve_for_image("tiny") == 0
    assert settings.reserve_for_image("never-configured") == 256
    with pytest.raises(ValueError, match="reserve_mb must be >= 0"):
        ServerSettings(sandbox_images={"x": {"reserve_mb": -1}})
    with pytest.raises(ValueError, match="reserve_mb"):
        ServerSettings(sandbox_spec={"reserve_mb": "lots"})
