"""Sandbox commands start with every signal at its default and none blocked, whatever the server or
worker process inherited: one started under ``nohup`` ignores SIGHUP, one started as a script's
background job ignores SIGINT and SIGQUIT, and an exec keeps an ignored signal ignored. (The local
sandbox's exec agent resets them itself; this is every other path: the ``none`` provider here, and
the local sandbox without the agent, as on cgroup v2 hosts.) Real processes, real commands.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tangram_env import Action, Client
from tangram_env.launch import ServerProcess
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
STATUS = "grep -E '^Sig(Ign|Blk)' /proc/self/status"
DEFAULTS = {"SigIgn": "0000000000000000", "SigBlk": "0000000000000000"}


@contextmanager
def started_like_nohup() -> Iterator[None]:
    """What this block starts inherits SIGHUP and SIGQUIT ignored and SIGUSR1 blocked."""
    ignored = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGHUP, signal.SIGQUIT)}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for sig, handler in ignored.items():
            signal.signal(sig, handler)


def _signals_of_a_command(address: str, session: str) -> dict[str, str]:
    with Client(address) as client:
        [future] = client.submit([Action(kind="bash", payload={"command": STATUS}, affinity=session)])
        value = future.result(60).value
    return dict(line.split(":\t") for line in value["stdout"].splitlines())


def test_a_servers_sandbox_commands_get_default_signals() -> None:
    with started_like_nohup():
        srv = ServerProcess("--sandbox", "none", "--no-gpu-worker")
    try:
        assert _signals_of_a_command(srv.address, "nohup-server") == DEFAULTS
        os.kill(srv.pid, signal.SIGHUP)  # the server itself still ignores what it was started ignoring
        time.sleep(0.3)
        assert srv.process.poll() is None
        assert _signals_of_a_command(srv.address, "after-hangup") == DEFAULTS
    finally:
        srv.stop()


def test_a_workers_sandbox_commands_get_default_signals() -> None:
    # The orchestrator lends no cores of its own, so the command runs on the worker.
    srv = ServerProcess("--sandbox", "none", "--cpus", "0.01", "--no-gpu-worker")
    worker = None
    try:
        argv = [sys.executable, "-m", "tangram_env.server.worker", "--connect", srv.address]
        with started_like_nohup():
            worker = subprocess.Popen(
                [*argv, "--runner", "cpu", "--sandbox", "none", "--worker-id", "w-nohup"], cwd=ROOT
            )
        with Client(srv.address) as client:
            wait_for(lambda: "w-nohup" in client.stats()["workers"], 60, "the worker to join")
        assert _signals_of_a_command(srv.address, "nohup-worker") == DEFAULTS
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(30)
        srv.stop()


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT])
def test_the_reset_keeps_the_process_ignoring_what_it_ignored(sig: signal.Signals) -> None:
    # In a child of its own (it changes process-wide state): the signal arrives and nothing happens.
    code = (
        "import os, signal, sys\n"
        "from tangram_env.server.sandbox.procrun import default_signals_for_children\n"
        f"signal.signal({int(sig)}, signal.SIG_IGN)\n"
        "changed = default_signals_for_children()\n"
        f"os.kill(os.getpid(), {int(sig)})\n"
        "print(','.join(changed))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert sig.name in out.stdout.strip().split(",")
