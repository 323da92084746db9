from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from rich.console import Console

from tangram_env import Action, Client
from tangram_env.server.stats_view import Rates, render, stats_main
from tests.cluster.procs import ROOT, Processes, child_env, start_orchestrator, start_worker, wait_for

# `tangram-server stats ...` as a process (the CLI hands its arguments to stats_main).
_STATS = (
    "import sys; from tangram_env.server.stats_view import stats_main; sys.exit(stats_main(sys.argv[1:]))"
)


def test_stats_once_against_a_real_cluster(
    procs: Processes, tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    _, address = start_orchestrator(procs, "tcp://127.0.0.1:0")
    start_worker(procs, address, "stats-w0", cpus=1.0)
    with Client(address) as client:
        wait_for(lambda: "stats-w0" in client.stats()["workers"], 30, "the worker to join")
        futures = client.submit(
            [Action(kind="cluster.mark", payload={"dir": str(tmp_path), "seconds": 0}) for _ in range(6)]
        )
        assert all(f.result(30).ok for f in futures)
        client.run("sleep", {"seconds": 0}, demand={"cpu": 1000.0, "mem_mb": 1})  # rejected: an error to show
    capsys.readouterr()
    assert stats_main(["--address", address, "--once", "--interval", "100ms"]) == 0
    out = capsys.readouterr().out
    assert "orchestrator" in out and "ACT per kind" in out
    assert "cluster.mark" in out and "stats-w0" in out and "local" in out
    assert "workers (2)" in out
    assert "rejected" in out  # the errors table
    # The kind's row carries its count.
    row = next(line for line in out.splitlines() if "cluster.mark" in line and "│" in line)
    assert " 6 " in row

    # Live mode refreshes until Ctrl-C, then exits cleanly with the last table on screen. (Ctrl-C as a
    # terminal sends it: a test run started as a background job ignores SIGINT, which its children
    # would inherit.)
    live = subprocess.Popen(
        [sys.executable, "-c", _STATS, "--address", address, "--interval", "200ms"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(3)
    live.send_signal(signal.SIGINT)
    stdout, stderr = live.communicate(timeout=30)
    assert live.returncode == 0, stderr
    assert "ACT per kind" in stdout and "stats-w0" in stdout


def test_stats_command_line_and_bad_input() -> None:
    # Through a process, as a user would run it (module entry: the lead wires `tangram-server stats`).
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _STATS,
            "--address",
            "tcp://127.0.0.1:9",
            "--once",
            "--timeout",
            "1s",
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 1 and "no orchestrator answered" in proc.stderr
    assert stats_main(["--address", "tcp://127.0.0.1:9", "--interval", "soon"]) == 2
    assert stats_main(["--address", "tcp://127.0.0.1:9", "--interval", "0s"]) == 2
    for bad in ("nonsense", "tcp://127.0.0.1", "tcp://:5555", "tcp://host:port", "ipc://"):
        assert stats_main(["--address", bad, "--once"]) == 2, bad


def test_render_shows_use_models_and_throughput() -> None:
    from tests.cluster.test_prometheus import FIGURES

    rates = Rates()
    rates.add({**FIGURES, "finished": 40, "submitted": 50}, 10.0)
    rates.add(FIGURES, 12.0)
    console = Console(width=200, record=True)
    console.print(render(FIGURES, rates))
    text = console.export_text()
    assert "30.0/s" in text  # (100 - 40) finished over 2 s
    assert "35.0/s" in text  # (120 - 50) submitted over 2 s
    assert "2/8 25%" in text  # cpu-1: 2 of 8 cores granted
    assert "1/8 GiB 12%" in text
    assert "39.1/156.2 GiB 25%" in text  # gpu-1's device memory
    assert "models loaded: minilm; loads 4, evictions 3" in text
    assert "sandboxes (2 images): 4 warm, 2 in use, 2 sessions" in text
    # A new server id means a restarted orchestrator: no throughput across the restart.
    rates.add({**FIGURES, "server_id": "other"}, 13.0)
    assert rates.finished_per_s is None
