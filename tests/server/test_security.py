"""Binding rules and CurveZMQ: remote binds need keys; peers without them are never heard."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from tangram_env import Client, ServerUnavailable, SettingsError, wire
from tangram_env.protocol import Heartbeat
from tangram_env.server.security import check_bind_allowed, keygen, read_public_key
from tests.conftest import ROOT, ServerProcess


def test_loopback_is_allowed_and_remote_needs_keys() -> None:
    for bind in ("tcp://127.0.0.1:5555", "tcp://localhost:1", "ipc:///tmp/x.sock", "tcp://[::1]:5"):
        check_bind_allowed(bind, curve=False, allow_remote=False)
    with pytest.raises(PermissionError, match="CurveZMQ"):
        check_bind_allowed("tcp://0.0.0.0:5555", curve=False, allow_remote=True)
    with pytest.raises(PermissionError, match="--allow-remote"):
        check_bind_allowed("tcp://10.1.2.3:5555", curve=True, allow_remote=False)
    check_bind_allowed("tcp://0.0.0.0:5555", curve=True, allow_remote=True)


def test_server_refuses_a_public_bind_without_keys() -> None:
    # The launcher says why at once: the server's own cause, and the fix.
    with pytest.raises(RuntimeError, match=r"non-loopback address needs CurveZMQ keys.*keygen"):
        ServerProcess("--bind", "tcp://0.0.0.0:0", timeout_s=20)


def test_curve_server_serves_keyed_clients_and_drops_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    public, secret = keygen(str(tmp_path))
    srv = ServerProcess("--curve-secret-key-file", str(secret))
    try:
        key = read_public_key(str(public))
        with Client(srv.address, curve_server_key=key) as client:
            assert client.call("echo", {"value": "secret"}) == "secret"
        # A peer without the handshake is dropped by ZeroMQ: no reply ever comes.
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(srv.address)
        sock.send(wire.encode(Heartbeat()))
        assert sock.poll(1500) == 0
        sock.close(linger=0)
        # What to check is said: the key (the client cannot tell a keyed orchestrator from none).
        with pytest.raises(
            ServerUnavailable,
            match=r"within 1.5s \(is tangram-server running there\? .*"
            r"set TANGRAM_CURVE_SERVER_KEY to its public key\)",
        ):
            Client(srv.address, connect_timeout_s=1.5)
        with pytest.raises(ServerUnavailable, match=r"is TANGRAM_CURVE_SERVER_KEY its public key\?"):
            Client(
                srv.address,
                connect_timeout_s=1.5,
                curve_server_key=read_public_key(str(keygen(str(tmp_path / "other"))[0])),
            )
        with pytest.raises(
            SettingsError, match=r"key 'nonsense' \(TANGRAM_CURVE_SERVER_KEY\) is not a CurveZMQ public key"
        ):
            Client(srv.address, curve_server_key="nonsense")
        time.sleep(0.1)
    finally:
        assert srv.stop() == 0


# Mistakes in the CurveZMQ setup: said at start, in one line, rather than a server that refuses everyone.


def _tangram_server(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANGRAM_SERVER_")}
    return subprocess.run(
        [sys.executable, "-m", "tangram_env.server", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
    )


def _one_line(run: subprocess.CompletedProcess[str], said: str) -> None:
    assert run.returncode != 0, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    why = [line for line in run.stderr.splitlines() if "cannot start" in line or line.startswith("tangram-")]
    assert len(why) == 1 and said in why[0], run.stderr


SERVE = ["--no-entry-points", "--no-gpu-worker", "--sandbox", "none", "--log-level", "WARNING"]


def test_a_clients_dir_that_is_missing_or_without_a_secret_key_stops_the_start(tmp_path: Path) -> None:
    _, secret = keygen(str(tmp_path / "keys"))
    missing = tmp_path / "nope"
    run = _tangram_server(*SERVE, "--curve-secret-key-file", str(secret), "--curve-clients-dir", str(missing))
    _one_line(run, f"--curve-clients-dir {missing}: no such folder (create it and copy")
    run = _tangram_server(*SERVE, "--curve-clients-dir", str(tmp_path / "keys"))
    _one_line(run, f"--curve-clients-dir {tmp_path / 'keys'} needs --curve-secret-key-file")
    run = _tangram_server(*SERVE, "--curve-secret-key-file", str(tmp_path / "none.key_secret"))
    _one_line(run, f"--curve-secret-key-file {tmp_path / 'none.key_secret'}: no such file")


def test_a_secret_key_others_can_read_is_warned_of(tmp_path: Path) -> None:
    _, secret = keygen(str(tmp_path))
    secret.chmod(0o644)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tangram_env.server",
            *SERVE,
            "--log-level",
            "INFO",
            "--curve-secret-key-file",
            str(secret),
        ],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    said = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # up to the line that says it serves: the key was loaded before
            said.append(line)
            if "serving on" in line:
                break
    finally:
        proc.terminate()
        proc.wait(30)
    warning = f"the secret key {secret} is open to other users (mode 0644): chmod 600 {secret}"
    assert any(warning in line for line in said), said


def test_keygen_never_replaces_a_key_pair_unasked_and_keeps_the_secret_private(tmp_path: Path) -> None:
    first = _tangram_server("keygen", str(tmp_path))
    assert first.returncode == 0, first.stderr
    secret, public = tmp_path / "server.key_secret", tmp_path / "server.key"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644  # the half handed out
    before = secret.read_text()
    again = _tangram_server("keygen", str(tmp_path))
    assert again.returncode == 1
    assert again.stderr.strip().splitlines() == [
        f"tangram-server keygen: {public} and {secret} already exist: replacing them locks out every peer "
        "given the public key; pass --force to replace them, or choose another --name or folder"
    ]
    assert secret.read_text() == before
    secret.chmod(0o644)
    forced = _tangram_server("keygen", str(tmp_path), "--force")
    assert forced.returncode == 0, forced.stderr
    assert secret.read_text() != before and stat.S_IMODE(secret.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("where", "said"),
    [("file", "is a file: give keygen a folder to write the key pair into"), ("/proc/nope", "cannot create")],
)
def test_keygen_where_no_folder_can_be_is_one_line(tmp_path: Path, where: str, said: str) -> None:
    target = tmp_path / "file" if where == "file" else Path(where)
    if where == "file":
        target.write_text("x")
    run = _tangram_server("keygen", str(target))
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tangram-server keygen: ") and said in lines[0], run.stderr


@pytest.mark.parametrize("only_known_clients", [False, True], ids=["any-client", "clients-dir"])
def test_a_keyed_orchestrator_serves_its_reward_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, only_known_clients: bool
) -> None:
    # Its local reward-model worker was not given the key: it never joined, and every score waited
    # forever with nothing said to the client.
    public, secret = keygen(str(tmp_path / "server"))
    extra = ["--curve-secret-key-file", str(secret)]
    if only_known_clients:
        keygen(str(tmp_path / "clients"), "trainer")
        (tmp_path / "clients" / "trainer.key_secret").rename(tmp_path / "trainer.key_secret")
        monkeypatch.setenv("TANGRAM_CURVE_CLIENT_KEY_FILE", str(tmp_path / "trainer.key_secret"))
        extra += ["--curve-clients-dir", str(tmp_path / "clients")]
    srv = ServerProcess(*extra)
    try:
        with Client(srv.address, curve_server_key=read_public_key(str(public))) as client:
            assert client.score("test.judge", ["good", "bad"], timeout=120) == [1.0, 0.0]
    finally:
        assert srv.stop() == 0


def test_a_worker_a_keyed_orchestrator_never_answers_is_told_what_to_check(tmp_path: Path) -> None:
    # It logged "orchestrator silent; registering again" every 5 s, forever, with no word of the key.
    _, secret = keygen(str(tmp_path))
    srv = ServerProcess("--curve-secret-key-file", str(secret))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANGRAM_CURVE")}
    worker = subprocess.Popen(
        [sys.executable, "-m", "tangram_env.server.worker", "--connect", srv.address, "--cpus", "1"],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert worker.stderr is not None
        deadline = time.monotonic() + 30
        line = ""
        while time.monotonic() < deadline and "registering again" not in line:
            line = worker.stderr.readline()
        assert "it never answered: is tangram-server running at that address" in line, line
        assert "is TANGRAM_CURVE_SERVER_KEY its public key?" in line
    finally:
        worker.kill()
        worker.wait(30)
        assert srv.stop() == 0
