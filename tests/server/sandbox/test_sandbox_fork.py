"""Sandboxes used from forked children, as the orchestrator's executor does (one child per action)."""

from __future__ import annotations

import glob
import os
import signal
import threading
import time

from tangram_env.sandbox import ExecResult
from tangram_env.server.sandbox.local import LocalProvider, LocalSandbox
from tests.server.sandbox.helpers import SMALL, processes_of_uid, wait_no_processes


def _in_child(sandbox: LocalSandbox, cmd: str, cores: tuple[int, ...] = ()) -> tuple[int, int]:
    """Fork; the child runs ``cmd`` in ``sandbox`` and writes the result to a pipe. (pid, read fd)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: like the executor's, it never returns
        try:
            os.close(read_fd)
            result = sandbox.exec(cmd, cores=cores)
            os.write(write_fd, result.model_dump_json().encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    return pid, read_fd


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def test_exec_from_a_forked_child_of_a_threaded_parent(
    sandbox: LocalSandbox, provider: LocalProvider
) -> None:
    stop = threading.Event()
    busy = threading.Thread(target=lambda: stop.wait(30), daemon=True)
    busy.start()  # the parent has other threads, as the orchestrator does
    try:
        pid, fd = _in_child(
            sandbox, "echo from-child > out.txt; cat out.txt", cores=(min(provider.host_cpus),)
        )
        result = ExecResult.model_validate_json(_read_all(fd))
        _, status = os.waitpid(pid, 0)
    finally:
        stop.set()
        busy.join()
    assert os.waitstatus_to_exitcode(status) == 0
    assert result.ok and result.stdout == "from-child\n"
    assert sandbox.read_file("out.txt") == b"from-child\n"  # the parent sees what the child's exec wrote
    assert sandbox.exec("cat out.txt").stdout == "from-child\n"


def test_killing_the_child_kills_its_sandboxed_command(sandbox: LocalSandbox) -> None:
    pid, fd = _in_child(sandbox, "sleep 300 & setsid sleep 300 & sleep 300")
    deadline = time.monotonic() + 10
    while len(processes_of_uid(sandbox.user.uid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(processes_of_uid(sandbox.user.uid)) >= 3
    os.kill(pid, signal.SIGKILL)  # what the executor does at an action's deadline
    os.waitpid(pid, 0)
    os.close(fd)
    sandbox.reap_orphans()  # and then, for a sandbox whose agent ran the command
    assert wait_no_processes(sandbox.user.uid) == []
    assert sandbox.health() is None and sandbox.exec("echo fine").stdout == "fine\n"


def test_children_leave_no_cgroups_behind(provider: LocalProvider) -> None:
    sb = provider.create(SMALL)
    for _ in range(3):
        pid, fd = _in_child(sb, "true", cores=(min(provider.host_cpus),))
        _read_all(fd)
        os.waitpid(pid, 0)
    patterns = [os.path.join(base, f"{sb.id}*") for base in provider.protections.cgroups.bases.values()]
    assert any(glob.glob(p) for p in patterns)
    sb.close()
    assert not any(glob.glob(p) for p in patterns)
