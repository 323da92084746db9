"""Settings values and their levels: tables merge key by key (flags over environment over the settings
file over defaults), out-of-range values fail naming the setting, and a variable no setting reads is
reported with the setting it most resembles."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tangram_env.server.cli import _serve_parser, settings_from_args
from tangram_env.server.config import ServerSettings, resolve_settings
from tangram_env.server.scheduler.quotas import ApiQuota, parse_quota
from tangram_env.settings import ClientSettings


def _settings(*argv: str) -> ServerSettings:
    return settings_from_args(_serve_parser().parse_args(list(argv)))


def _file(tmp_path: Path, text: str, name: str = "server.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# Tables: key by key at every level.


def test_the_ray_flag_keeps_the_files_ray_table(tmp_path: Path) -> None:
    file = _file(
        tmp_path,
        '[ray]\naddress = "ray://head:10001"\nnode_resource = "tangram"\nreserve_cpu = 2\n'
        '[ray.runtime_env]\npip = ["sympy"]\n',
    )
    ray = _settings("--config", file, "--ray", "auto").ray
    assert (ray.address, ray.node_resource, ray.reserve_cpu) == ("auto", "tangram", 2.0)
    assert ray.runtime_env == {"pip": ["sympy"]}


def test_ray_variables_are_over_the_file_and_under_the_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = _file(tmp_path, '[ray]\nreserve_cpu = 2\nnamespace = "from-file"\n')
    monkeypatch.setenv("TANGRAM_RAY_RESERVE_CPU", "1")
    monkeypatch.setenv("TANGRAM_RAY_ADDRESS", "auto")
    ray = _settings("--config", file).ray
    assert (ray.reserve_cpu, ray.namespace, ray.address) == (1.0, "from-file", "auto")
    assert _settings("--config", file, "--ray", "local").ray.address == "local"
    # A RaySettings model given to resolve_settings counts only the fields it was given.
    from tangram_env.server.config import RaySettings

    ray = resolve_settings({"config": file, "ray": RaySettings(address="local")}).ray
    assert (ray.address, ray.reserve_cpu, ray.namespace) == ("local", 1.0, "from-file")


def test_a_quota_flag_replaces_its_apis_entry_and_keeps_the_other_apis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = _file(
        tmp_path,
        '[quotas.apis.judge]\nrate = 5\n[quotas.apis.web-search]\nrate = 9\nburst = 4\nkeys = ["a", "b"]\n',
    )
    apis = _settings("--config", file, "--quota", "web-search:rate=1").quotas.apis
    assert sorted(apis) == ["judge", "web-search"]
    assert apis["judge"].rate == 5.0
    # Replaced whole: the file's burst and keys belonged to its rate, not to the flag's.
    assert apis["web-search"] == ApiQuota(rate=1.0)
    monkeypatch.setenv(
        "TANGRAM_SERVER_QUOTAS", json.dumps({"apis": {"judge": {"rate": 2}, "ocr": {"rate": 3}}})
    )
    apis = _settings("--config", file, "--quota", "web-search:rate=1").quotas.apis
    assert {name: q.rate for name, q in apis.items()} == {"judge": 2.0, "ocr": 3.0, "web-search": 1.0}
    monkeypatch.setenv("TANGRAM_SERVER_QUOTAS", json.dumps({"apis": {"judge": {"rate": 2, "burst": 7}}}))
    assert _settings("--quota", "judge:rate=1").quotas.apis["judge"] == ApiQuota(rate=1.0)
    with pytest.raises(ValueError, match="--quota judge: given twice"):
        _settings("--quota", "judge:rate=1", "--quota", "judge:rate=2")


# Bounds: each setting refuses what it cannot mean, naming itself.


@pytest.mark.parametrize(
    ("name", "text", "setting"),
    [
        ("a.toml", "worker_timeout_s = 0\n", "worker_timeout_s"),
        ("a.json", '{"client_timeout_s": -1}', "client_timeout_s"),
        ("a.json", '{"result_ttl_s": NaN}', "result_ttl_s"),
        ("a.toml", "session_idle_s = inf\n", "session_idle_s"),
        ("a.json", '{"mem_mb": -100}', "mem_mb"),
        ("a.toml", "mem_mb = inf\n", "mem_mb"),
        ("a.toml", "cpus = inf\n", "cpus"),
        ("a.toml", "max_body = 0\n", "max_body"),
        ("a.toml", "metrics_port = 70000\n", "metrics_port"),
        ("a.toml", "[ray]\nreserve_mem = -4096\n", "ray.reserve_mem"),
        ("a.toml", "[ray]\nscale_up_after_s = -1\n", "ray.scale_up_after_s"),
        ("a.toml", "[ray]\nrelease_after_s = -10\n", "ray.release_after_s"),
        ("a.toml", "[ray]\npoll_s = inf\n", "ray.poll_s"),
        ("a.toml", "[ray]\nreserve_cpu = nan\n", "ray.reserve_cpu"),
        ("a.toml", "[ray]\nmax_gpus = inf\n", "ray.max_gpus"),
    ],
)
def test_out_of_range_values_fail_naming_the_setting(
    tmp_path: Path, name: str, text: str, setting: str
) -> None:
    file = _file(tmp_path, text, name)
    with pytest.raises(ValueError, match=rf"(?m)^{setting}$"):
        _settings("--config", file)


def test_zero_where_it_means_something_is_accepted(tmp_path: Path) -> None:
    file = _file(
        tmp_path, "session_idle_s = 0\nwarm_idle_s = 0\n[ray]\nreserve_mem = 0\nscale_up_after_s = 0\n"
    )
    settings = _settings("--config", file)
    assert (settings.session_idle_s, settings.ray.scale_up_after_s, settings.ray.reserve_mem) == (0, 0, 0)


def test_a_negative_variable_meets_the_settings_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANGRAM_SERVER_WORKER_TIMEOUT_S", "-5")
    with pytest.raises(ValueError, match=r"(?s)worker_timeout_s.*greater than 0"):
        _settings()
    monkeypatch.setenv("TANGRAM_SERVER_WORKER_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match=r"(?s)worker_timeout_s.*greater than 0"):
        _settings()


def test_client_settings_refuse_non_positive_periods() -> None:
    for name in ("connect_timeout_s", "heartbeat_s", "server_timeout_s", "busy_backoff_s", "max_body"):
        with pytest.raises(ValueError, match=rf"(?s){name}.*greater than 0"):
            ClientSettings(**{name: 0})


def test_the_cli_says_what_is_wrong_in_one_line(tmp_path: Path) -> None:
    file = _file(tmp_path, "worker_timeout_s = 0\n[ray]\nreserve_mem = -4096\npoll_s = inf\n")
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            # SIGINT ignored, as in a script's background job: the server says it resets that for
            # its commands, but only once the settings are sound; a mistake stays the only line.
            "import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "from tangram_env.server.cli import main; sys.exit(main(sys.argv[1:]))",
            "--no-entry-points",
            "--config",
            file,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith(("TANGRAM_SERVER_", "TANGRAM_RAY_"))},
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "tangram-server: invalid settings: worker_timeout_s: Input should be greater than 0 (got 0.0); "
        "ray.reserve_mem: Input should be greater than or equal to 0 (got -4096); "
        "ray.poll_s: a duration must be a finite number, got inf"
    ]


# Typos.


def test_a_variable_no_setting_reads_is_reported_with_the_closest_setting(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in [n for n in os.environ if n.startswith(("TANGRAM_SERVER_", "TANGRAM_RAY_"))]:
        monkeypatch.delenv(name)  # only this test's variables
    monkeypatch.setenv("TANGRAM_SERVER_WORKER_TIMEOUT", "5")
    monkeypatch.setenv("TANGRAM_RAY_NODE_RESOURCES", "tangram")
    monkeypatch.setenv("TANGRAM_SERVER_TIMEOUT_S", "9")  # the client's server_timeout_s: not a typo
    monkeypatch.setenv("TANGRAM_SERVER_WORKER_TOKEN", "s3cret")
    monkeypatch.setenv("TANGRAM_SERVER_GPU_STUCK_AFTER_S", "60")
    with caplog.at_level(logging.WARNING, logger="tangram_env.server.config"):
        _settings()
    said = [r.getMessage() for r in caplog.records if r.name == "tangram_env.server.config"]
    assert said == [
        "environment variable TANGRAM_RAY_NODE_RESOURCES is not a setting and is ignored; "
        "did you mean TANGRAM_RAY_NODE_RESOURCE?",
        "environment variable TANGRAM_SERVER_WORKER_TIMEOUT is not a setting and is ignored; "
        "did you mean TANGRAM_SERVER_WORKER_TIMEOUT_S?",
    ]
    from tangram_env.server.config import unknown_variables

    assert unknown_variables({"TANGRAM_SERVER_QUOTA": "{}", "TANGRAM_SANDBOX_DIR": "/x"}) == [
        "environment variable TANGRAM_SERVER_QUOTA is not a setting and is ignored; "
        "did you mean TANGRAM_SERVER_QUOTAS?"
    ]


@pytest.mark.parametrize(
    ("text", "setting"),
    [
        ('sandbox_provder = "docker"\n', "sandbox_provder"),
        ('[ray]\nnode_resources = "tangram"\n', "ray.node_resources"),
        ("[quotas.apis.judge]\nrate = 1\nin_flight = 2\n", "apis.judge.in_flight"),
    ],
)
def test_an_unknown_key_in_the_settings_file_is_an_error(tmp_path: Path, text: str, setting: str) -> None:
    with pytest.raises(ValueError, match=setting):
        _settings("--config", _file(tmp_path, text))


# Quota values.


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("s:rate=inf", "rate: Input should be a finite number"),
        ("s:rate=nan", "rate: Input should be a finite number"),
        ("s:rate=1,burst=inf", "burst: Input should be a finite number"),
        ("s:rate=1,rate=2", "rate is given twice"),
        ("s:rate=1,keys=a,keys=b", "keys is given twice"),
    ],
)
def test_a_quota_is_finite_and_each_field_given_once(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=f"quota '{text}': {problem}"):
        parse_quota(text)
    with pytest.raises(ValueError, match="finite"):
        ServerSettings(quotas={"apis": {"s": {"rate": float("inf")}}})
