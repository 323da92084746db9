"""The orchestrator's loop and ZeroMQ I/O threads run ahead of the commands they dispatch (niceness)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tangram_env import Client
from tangram_env.launch import ServerProcess

PLUGIN = """
import os
import tangram_env
from pydantic import BaseModel


class Nothing(BaseModel):
    pass


@tangram_env.tool(name="own_niceness", cpu=0.1, timeout_s=10)
def own_niceness(args: Nothing) -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)
"""


def _niceness_by_thread(pid: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            comm = f.read().strip()
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            nice = int(f.read().rpartition(")")[2].split()[16])  # field 19: nice
        out.setdefault("loop" if int(tid) == pid else comm.split("_")[0], []).append(nice)
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="a niceness below 0 needs root (or CAP_SYS_NICE)")
def test_loop_and_io_threads_run_ahead_and_forked_tools_do_not(tmp_path: Path) -> None:
    plugin = tmp_path / "nice_plugin.py"
    plugin.write_text(PLUGIN)
    own = os.getpriority(os.PRIO_PROCESS, 0)  # the server's own: it inherits this process's
    srv = ServerProcess("--plugin-file", str(plugin), "--no-gpu-worker")
    try:
        with Client(srv.address) as client:
            # A forked tool (and so every command it runs) keeps the process's own niceness.
            assert client.call("own_niceness", {}) == own
            threads = _niceness_by_thread(srv.process.pid)
        assert threads["loop"] == [-10], threads
        assert threads["ZMQbg/IO/0"] == [-10], threads
        others = [n for name, ns in threads.items() if name not in ("loop", "ZMQbg/IO/0") for n in ns]
        assert others and all(n == own for n in others), threads
    finally:
        srv.stop()


def test_a_niceness_the_host_refuses_is_logged_and_left_as_is() -> None:
    # Below the process's own niceness needs root or CAP_SYS_NICE: as an unprivileged user the loop
    # keeps its niceness, and the server says why and how to silence it.
    script = (
        "import logging, os, sys, zmq\n"
        "from tangram_env.server.priority import raise_control_plane\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
        "if os.geteuid() == 0:\n"
        "    os.setresgid(65534, 65534, 65534); os.setgroups([]); os.setresuid(65534, 65534, 65534)\n"
        "ctx = zmq.Context(); sock = ctx.socket(zmq.ROUTER)  # starts the I/O thread\n"
        "print('changed', raise_control_plane(-10), os.getpriority(os.PRIO_PROCESS, 0))\n"
    )
    own = os.getpriority(os.PRIO_PROCESS, 0)  # the child's own: inherited from this process
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"changed [] {own}" in done.stdout, done.stdout
    assert "needs root or CAP_SYS_NICE" in done.stdout and f"loop_nice={own}" in done.stdout, done.stdout
