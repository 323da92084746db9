"""Hostile code in a local sandbox: each test fails if the protection it names is missing.

Every attack must be contained, leave the host unharmed, and the next action in the reset sandbox
must find it clean (:func:`assert_clean`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tangram_env.server.sandbox import detect_protections
from tangram_env.server.sandbox.local import LocalProvider, LocalSandbox
from tests.server.sandbox.helpers import (
    SMALL,
    assert_clean,
    processes_of_uid,
    tmp_mount_points,
    wait_no_processes,
)

PROJECT_FILE = Path(__file__).resolve()


def test_this_host_offers_every_protection() -> None:
    # Where the project's set-up ran (root, Linux, bubblewrap installed), nothing may be missing:
    # a missing protection is a failure here, not a skip.
    found = detect_protections()
    assert os.geteuid() == 0, "the sandbox security tests run as root (as in CI)"
    wanted = ["bwrap", "pid_namespace", "net_namespace", "ipc_namespace", "uts_namespace", "uid_drop"]
    wanted += ["cgroup_memory", "cgroup_pids", "cgroup_cpuset", "cgroup_cpu", "tmpfs_workspace", "seccomp"]
    assert {name: found[name] for name in wanted} == dict.fromkeys(wanted, True)


def test_runs_unprivileged(sandbox: LocalSandbox) -> None:
    r = sandbox.exec("id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status")
    lines = r.stdout.split()
    assert int(lines[0]) == sandbox.user.uid and sandbox.user.uid >= 1000
    assert lines[1:] == ["CapEff:", "0000000000000000", "CapBnd:", "0000000000000000", "NoNewPrivs:", "1"]


def test_kernel_attack_surface_is_refused(sandbox: LocalSandbox) -> None:
    # An unprivileged process may create user namespaces and io_uring instances; the filter says no.
    code = (
        "import ctypes, errno\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for name, number, args in [('unshare', 272, (0x10000000,)), ('io_uring_setup', 425, (1, 0)),\n"
        "                           ('bpf', 321, (0, 0, 0)), ('keyctl', 250, (0, 0)),\n"
        "                           ('mq_open', 240, (b'/q', 0o102, 0o600, None))]:\n"
        "    rc = libc.syscall(number, *args)\n"
        "    print(name, rc, errno.errorcode.get(ctypes.get_errno()))\n"
    )
    r = sandbox.exec(["python3", "-c", code])
    assert r.stdout.splitlines() == [
        "unshare -1 EPERM",
        "io_uring_setup -1 EPERM",
        "bpf -1 EPERM",
        "keyctl -1 EPERM",
        "mq_open -1 EPERM",  # a POSIX message queue outlived a reset: the next trajectory read it
    ], r
    assert "Operation not permitted" in sandbox.exec("unshare --user --map-root-user id").stderr
    # What ordinary programs need still works: threads, processes (clone3 falls back to clone).
    threads = "import threading, multiprocessing as mp\n"
    threads += "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
    threads += "p = mp.Process(target=print, args=('process',)); p.start(); p.join()\n"
    assert sandbox.exec(["python3", "-c", threads]).stdout == "thread\nprocess\n"
    assert_clean(sandbox)


def test_no_network_to_the_host(sandbox: LocalSandbox) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(1.0)
    port = server.getsockname()[1]
    try:
        code = (
            f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('CONNECTED')"
        )
        r = sandbox.exec(["python3", "-c", code])
        assert r.exit_code != 0 and "CONNECTED" not in r.stdout and "ConnectionRefused" in r.stderr
        with pytest.raises(TimeoutError):
            server.accept()  # nothing ever reached the host's listener
    finally:
        server.close()
    assert_clean(sandbox)


def test_a_sandbox_with_network_starts_and_shares_the_hosts(provider: LocalProvider) -> None:
    # It used to fail to start wherever the host has /etc/resolv.conf (no mount point for it in the
    # sandbox's read-only /etc). Sharing the host's network, it reaches the host's loopback: why the
    # server admits network = true with the local provider only when it admits no unknown peer.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(5.0)
    box = provider.create(SMALL.model_copy(update={"network": True}))
    try:
        port = server.getsockname()[1]
        code = (
            f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('CONNECTED')"
        )
        r = box.exec(["python3", "-c", code])
        assert r.stdout == "CONNECTED\n", r
        server.accept()[0].close()
        if os.path.exists("/etc/resolv.conf"):
            host = Path("/etc/resolv.conf").read_text()
            assert box.exec(["cat", "/etc/resolv.conf"]).stdout == host
    finally:
        box.close()
        server.close()


def test_no_network_to_the_world(sandbox: LocalSandbox) -> None:
    code = (
        "import socket\n"
        "print(socket.if_nameindex())\n"
        "for addr in [('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
        "    try:\n        socket.create_connection(addr, timeout=2); print('CONNECTED')\n"
        "    except OSError as e:\n        print(e.errno)\n"
    )
    r = sandbox.exec(["python3", "-c", code])
    assert r.stdout.splitlines() == ["[(1, 'lo')]", "101", "101"], r  # ENETUNREACH: no route out at all
    assert_clean(sandbox)


def test_host_secrets_are_invisible(sandbox: LocalSandbox) -> None:
    r = sandbox.exec(
        f"cat /etc/shadow; cat /etc/gshadow; ls -A /root; cat /root/.bashrc; ls /home; cat {PROJECT_FILE}; "
        f"ls {PROJECT_FILE.parents[3]}; cat /etc/pip.conf; ls /etc/ssh"
    )
    assert "root:" not in r.stdout
    assert r.stdout.split() == [".pyenv"] or r.stdout.split() == [], r.stdout  # only the interpreter's path
    for missing in ("/etc/shadow", "/etc/gshadow", "/root/.bashrc", str(PROJECT_FILE), "/etc/pip.conf"):
        assert f"{missing}: No such file or directory" in r.stderr, (missing, r.stderr)
    assert_clean(sandbox)


def test_other_sandboxes_are_invisible(provider: LocalProvider, sandbox: LocalSandbox) -> None:
    other = provider.create(SMALL)
    try:
        other.write_file("secret.txt", "the other trajectory's answer")
        # (Read-only image paths bound under /tmp, such as a venv of a checkout there, are skipped:
        # they are the image's, not another sandbox's.)
        skip = " ".join(f"--exclude-dir={m}" for m in tmp_mount_points(sandbox))
        r = sandbox.exec(
            f"cat {other.host_workspace}/secret.txt; ls {provider.state_dir}; "
            f"grep -rs {skip} 'other trajectory' /workspace /tmp /etc /var /dev/shm; echo done"
        )
        assert "answer" not in r.stdout and r.stdout.strip() == "done", r
        assert other.read_file("secret.txt") == b"the other trajectory's answer"
    finally:
        other.close()
    assert_clean(sandbox)


def test_cannot_write_outside_the_workspace(sandbox: LocalSandbox) -> None:
    marker = f"tangram-escape-{os.getpid()}"
    venv = Path(sys.prefix)
    r = sandbox.exec(
        f"touch /{marker}; touch /usr/{marker}; touch /etc/{marker}; echo x >> /etc/passwd; "
        f"touch {venv}/{marker}; touch /root/{marker}; mkdir /var/{marker}; touch /dev/shm/ok; echo end"
    )
    assert r.stdout == "end\n" and r.stderr.count("Read-only file system") >= 5, r.stderr
    for path in (f"/{marker}", f"/usr/{marker}", f"/etc/{marker}", f"{venv}/{marker}", f"/root/{marker}"):
        assert not os.path.exists(path)
    assert marker not in Path("/etc/passwd").read_text()
    assert_clean(sandbox)


def test_files_never_take_the_memory_the_sandbox_runs_on(provider: LocalProvider) -> None:
    # The workspace and /tmp are a tmpfs counted against the memory limit, and files outlive the
    # OOM killer. As large as the limit, a command that filled it was killed, its file stayed, and
    # the killer then took the sandbox's own agent: the sandbox broke (a policy's way to end its
    # episode as an infrastructure failure). The files now stop short of the limit.
    sb = provider.create(SMALL.model_copy(update={"disk_mb": 2 * SMALL.mem_mb}))
    try:
        if sb.group is None or not sb.group.has("memory"):
            pytest.skip("no memory cgroup here")
        r = sb.exec(f"head -c {SMALL.mem_mb}M /dev/zero > /tmp/big")
        assert r.exit_code == 1 and "No space left" in r.stderr and r.killed_by is None, r
        assert sb.exec("echo alive").stdout == "alive\n" and sb.health() is None
        anon = sb.exec(["python3", "-c", "b = bytearray(100 << 20); print('fits')"])  # room for a command
        assert anon.stdout == "fits\n" or anon.killed_by == "memory", anon
        assert sb.exec("echo alive").stdout == "alive\n" and sb.health() is None
    finally:
        sb.close()


def test_fork_bomb_is_contained(sandbox: LocalSandbox) -> None:
    started = time.monotonic()
    r = sandbox.exec("bomb() { bomb | bomb & }; bomb; sleep 2; echo survived", timeout_s=6)
    assert "pids" in r.limits_hit, r
    assert time.monotonic() - started < 8
    assert sandbox.group is not None
    peak = int(sandbox.group.read("pids", "pids.peak") or 0)
    assert 0 < peak <= SMALL.max_pids  # never more processes than the sandbox may have
    assert subprocess.run(["true"], check=False).returncode == 0  # the host can still fork
    assert wait_no_processes(sandbox.user.uid) == []
    assert_clean(sandbox)


def test_memory_bomb_is_contained(sandbox: LocalSandbox) -> None:
    r = sandbox.exec(["python3", "-c", "x = [bytearray(1 << 20) for _ in range(4096)]; print('allocated')"])
    assert r.killed_by == "memory" and "allocated" not in r.stdout, r
    assert sandbox.group is not None
    peak = sandbox.group.read("memory", "memory.max_usage_in_bytes")  # v2: memory.peak, from Linux 5.19
    assert int(peak) <= (SMALL.mem_mb << 20) + (1 << 20) if peak else sandbox.group.version == 2
    assert sandbox.exec("echo alive").stdout == "alive\n"  # the sandbox itself goes on
    assert_clean(sandbox)


def test_infinite_loop_is_stopped(sandbox: LocalSandbox) -> None:
    r = sandbox.exec("while :; do :; done", timeout_s=1)
    assert r.killed_by == "timeout" and 1 <= r.wall_s < 3
    assert wait_no_processes(sandbox.user.uid) == []
    assert_clean(sandbox)


def test_a_gigabyte_of_output_is_cut(sandbox: LocalSandbox) -> None:
    started = time.monotonic()
    r = sandbox.exec("head -c 1G /dev/zero | tr '\\0' x", timeout_s=60)
    assert r.killed_by == "output" and r.stdout_truncated
    assert len(r.stdout) < SMALL.max_output_bytes + 100
    assert time.monotonic() - started < 15  # stopped at output_kill_bytes, not after the whole gigabyte
    assert_clean(sandbox)


def test_detached_processes_do_not_outlive_their_action(sandbox: LocalSandbox) -> None:
    double_fork = (
        "import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.execvp('sleep', ['sleep', '300'])\n"
    )
    sandbox.write_file("/tmp/detach.py", double_fork)
    r = sandbox.exec(
        "setsid sleep 300 & (sleep 300 &) & nohup sleep 300 >/dev/null 2>&1 & "
        "python3 /tmp/detach.py; echo started"
    )
    assert r.ok and r.stdout == "started\n", r
    assert wait_no_processes(sandbox.user.uid) == []
    assert "sleep" not in sandbox.exec("ps -eo comm").stdout
    assert_clean(sandbox)


def test_signals_cannot_reach_the_server(sandbox: LocalSandbox) -> None:
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        r = sandbox.exec(
            f"kill -9 {os.getpid()}; kill -9 {bystander.pid}; kill -TERM -1; kill -9 -1; kill -9 1; "
            "echo after"
        )
        assert "after" in r.stdout
        assert bystander.poll() is None  # a host process outside the sandbox is untouched
    finally:
        bystander.kill()
        bystander.wait()
    assert_clean(sandbox)


def test_proc_shows_nothing_of_the_host(sandbox: LocalSandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANGRAM_TEST_SECRET", "s3cr3t-in-the-server-env")
    r = sandbox.exec(
        f"ls /proc | grep -c '^[0-9]'; ls -d /proc/{os.getpid()} 2>&1; cat /proc/1/environ; "
        "cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c SECRET; "
        "echo 1 > /proc/sys/kernel/sysrq; echo b > /proc/sysrq-trigger; head -c 1 /proc/kcore; "
        "ls /sys/fs/cgroup; cat /proc/self/cgroup; echo end"
    )
    lines = r.stdout.splitlines()
    assert int(lines[0]) <= 6, r.stdout  # the sandbox's init, agent and spare, and this command's own
    assert "No such file or directory" in lines[1]
    assert "s3cr3t" not in r.stdout and lines[2] == "0"
    assert "Permission denied" in r.stderr  # /proc/1/environ belongs to the sandbox's root init
    assert lines[-1] == "end" and "ls: cannot access '/sys/fs/cgroup'" in r.stderr
    # The cgroup namespace shows paths from the server's own group down, never the host's above it.
    own = {line.split(":", 2)[2].strip() for line in Path("/proc/self/cgroup").read_text().splitlines()} - {
        "/"
    }
    assert not any(path in r.stdout for path in own), (own, r.stdout)
    assert "Read-only file system" in r.stderr or "Permission denied" in r.stderr
    assert_clean(sandbox)


def test_setuid_binaries_do_not_escalate(sandbox: LocalSandbox) -> None:
    helpers = [p for p in ("/usr/bin/su", "/usr/bin/passwd", "/usr/bin/newgrp") if os.path.exists(p)]
    if not helpers:
        pytest.skip("no setuid binaries installed on this host to try")
    r = sandbox.exec(
        f"{helpers[0]} --help >/dev/null 2>&1; id -u; {helpers[0]} root -c id 2>&1 </dev/null; id -u"
    )
    assert "uid=0" not in r.stdout and r.stdout.split()[0] == str(sandbox.user.uid)
    assert_clean(sandbox)


def test_an_attack_in_one_sandbox_leaves_others_untouched(provider: LocalProvider) -> None:
    attacker, bystander = provider.create(SMALL), provider.create(SMALL)
    try:
        bystander.write_file("work.txt", "in progress")
        attacker.exec("bomb() { bomb | bomb & }; bomb; sleep 1", timeout_s=3)
        attacker.exec(["python3", "-c", "x = bytearray(1 << 30)"])
        r = bystander.exec("cat work.txt; echo ok")
        assert r.ok and r.stdout == "in progressok\n"
        assert processes_of_uid(bystander.user.uid) == []
    finally:
        attacker.close()
        bystander.close()
