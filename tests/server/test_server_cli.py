"""``tangram-server`` run as users run it: each mistake at start is one line naming it and a non-zero
status, found before anything costly is built; and what its help and its start warnings say."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tangram_env.sandbox import SandboxSpec
from tests.conftest import ROOT, run_module

BASE = ["--no-entry-points", "--no-gpu-worker", "--sandbox", "none", "--bind", "tcp://127.0.0.1:0"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANGRAM_SERVER_", "TANGRAM_RAY_"))}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _server(*args: str) -> subprocess.CompletedProcess[str]:
    return run_module("tangram_env.server", *args, env=_env())


def _refused(run: subprocess.CompletedProcess[str], said: str) -> str:
    """The one line that says why the server did not start (a log line, or the CLI's own)."""
    assert run.returncode != 0, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    why = [line for line in run.stderr.splitlines() if "cannot start" in line or line.startswith("tangram-")]
    assert len(why) == 1 and said in why[0], run.stderr
    return why[0]


def test_a_port_in_use_is_one_line_with_the_fix() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = _server(*BASE, "--bind", f"tcp://127.0.0.1:{port}", "--log-level", "WARNING")
    _refused(run, f"cannot bind tcp://127.0.0.1:{port}: Address already in use; another process")


def test_an_unknown_log_level_is_one_line_and_status_2() -> None:
    run = _server(*BASE, "--log-level", "LOUD")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "tangram-server: --log-level LOUD: not a level; use DEBUG, INFO, WARNING, ERROR or CRITICAL"
    ]


def test_an_option_the_sandbox_provider_does_not_take_is_named() -> None:
    run = _server(*BASE, "--sandbox-option", "nosuch=1", "--log-level", "WARNING")
    _refused(run, "sandbox options nosuch of provider 'none': ")


@pytest.mark.parametrize(
    ("option", "said"),
    [
        ("foo=1", "foo: Extra inputs are not permitted"),
        ("age_rate=abc", "age_rate: Input should be a valid number"),
    ],
)
def test_a_wrong_scheduler_option_is_refused_before_sandboxes_are_made(option: str, said: str) -> None:
    run = _server(*BASE, "--scheduler-option", option, "--log-level", "INFO")
    _refused(
        run, f"scheduler options of the 'elastic' scheduler (--scheduler-option, scheduler_options): {said}"
    )
    assert "sandbox protections" not in run.stderr  # the pool (and its provider) was never built


def test_the_help_names_the_subcommands() -> None:
    run = _server("--help")
    assert run.returncode == 0
    for line in (
        "tangram-server image build NAME",
        "tangram-server stats --address",
        "tangram-server keygen DIR",
    ):
        assert line in run.stdout


def test_stats_refuses_a_negative_timeout() -> None:
    run = _server("stats", "--address", "tcp://127.0.0.1:9", "--timeout", "-1")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == ["tangram-server stats: --timeout must be positive"]


# SandboxSpec: a typo of a limit would leave the default in force, unsaid.


def test_a_sandbox_spec_field_that_does_not_exist_is_refused_with_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unknown SandboxSpec field mem_md \(known: image, mem_mb, .*'mem_mb'"
    ):
        SandboxSpec(mem_md=5)  # type: ignore[call-arg]
    assert SandboxSpec(mem_mb="2GiB").mem_mb == 2048


def test_the_server_refuses_an_unknown_sandbox_spec_field(tmp_path: Path) -> None:
    run = _server(*BASE, "--sandbox-spec", "nosuch=1")
    line = _refused(run, "tangram-server: invalid settings: sandbox settings for image 'default': ")
    assert "unknown SandboxSpec field nosuch (known: image, mem_mb" in line
    config = tmp_path / "spec.toml"
    config.write_text('[sandbox_spec]\nmem_mb = "2GiB"\nmem_md = 5\n')
    run = _server(*BASE, "--config", str(config))
    assert "unknown SandboxSpec field mem_md" in _refused(run, "did you mean 'mem_mb'?")


# Who may register as a worker.


def _start_warnings(*args: str, **env: str) -> list[str]:
    """The warnings a server logs until it serves (then it is stopped)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tangram_env.server", *args, "--log-level", "INFO"],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=_env(**env),
    )
    warnings = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        for line in proc.stderr:
            if " WARNING " in line:
                warnings.append(line)
            if "serving on" in line or time.monotonic() > deadline:
                break
    finally:
        proc.terminate()
        proc.wait(30)
    return warnings


def test_a_loopback_tcp_bind_without_a_worker_token_warns_that_any_local_user_may_register(
    tmp_path: Path,
) -> None:
    said = "any process on this host, of any user, may connect to tcp://127.0.0.1:"
    assert any(said in w and "TANGRAM_SERVER_WORKER_TOKEN" in w for w in _start_warnings(*BASE))
    with_token = _start_warnings(*BASE, TANGRAM_SERVER_WORKER_TOKEN="a-long-shared-secret")
    assert not any("register as a worker" in w for w in with_token)
    ipc = [*BASE[:-2], "--bind", f"ipc://{tmp_path}/s.sock"]  # a socket file: its permissions admit
    assert not any("register as a worker" in w for w in _start_warnings(*ipc))
