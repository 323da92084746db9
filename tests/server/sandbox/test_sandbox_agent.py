"""The local sandbox's exec agent: its failure modes, floods, leftovers, and commands that go after it."""

from __future__ import annotations

import array
import contextlib
import errno
import json
import os
import re
import shutil
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from tangram_env.sandbox import SandboxBroken
from tangram_env.server.sandbox.local import PTYS_PER_SANDBOX, LocalProvider, LocalSandbox
from tangram_env.server.sandbox.stale import sweep_stale
from tests.server.sandbox.helpers import SMALL, processes_of_uid, wait_no_processes


@pytest.fixture
def sandbox(provider: LocalProvider) -> Iterator[LocalSandbox]:
    if not provider.exec_agent:
        pytest.skip("this host gives sandboxes no exec agent (needs root, cgroups and /usr/bin/python3)")
    sb = provider.create(SMALL)
    yield sb
    sb.close()


def _version(sb: LocalSandbox) -> int:
    return sb._prot.cgroups.version


def _exec_group(sb: LocalSandbox) -> str:
    """How an exec's group ends in a command's ``/proc/self/cgroup``: ``<sandbox>.<n>`` beside the
    sandbox's group on v1; on v2 ``<n>`` in it, seen from the agent's group (the command's cgroup
    namespace is rooted there, so the path reads ``/../<n>``).
    """
    return rf"/{sb.id}\.\d+$" if _version(sb) == 1 else r"^/\.\./\d+$"


def _agent_pids(sb: LocalSandbox) -> list[int]:
    """Host pids of the agent's bubblewrap, its pid 1 and the agent (everything in the sandbox's
    group that does not run as the commands' uid), without the agent's spare child (a fork of the
    agent, replaced with each command)."""
    assert sb.group is not None
    pids = {p for p in sb.group.pids() if p not in processes_of_uid(sb.user.uid)}
    return sorted(pids - set(_spare_pids(sb, pids)))


def _spare_pids(sb: LocalSandbox, pids: set[int] | None = None) -> list[int]:
    """The agent's spare children waiting for a command: python3 processes forked by the python3 agent."""
    assert sb.group is not None
    pids = (
        pids if pids is not None else {p for p in sb.group.pids() if p not in processes_of_uid(sb.user.uid)}
    )
    return sorted(p for p in pids if _comm(p) == "python3" and _comm(_parent(p)) == "python3")


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _kill_agent(sb: LocalSandbox) -> None:
    for pid in _agent_pids(sb):
        with contextlib.suppress(ProcessLookupError):  # gone already: its namespace went with the agent
            os.kill(pid, signal.SIGKILL)


def _wait(predicate: object, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def test_commands_share_one_agent_and_namespace(sandbox: LocalSandbox) -> None:
    sandbox.exec("true")
    agent = _agent_pids(sandbox)
    assert agent, "the agent starts with the sandbox"
    started = "cut -d' ' -f22 /proc/1/stat"  # when the namespace's pid 1 started (clock ticks)
    first, second = sandbox.exec(started), sandbox.exec(started)
    assert first.ok and first.stdout.strip().isdigit() and first.stdout == second.stdout
    assert _agent_pids(sandbox) == agent  # no new bubblewrap per command


def test_agent_killed_between_commands_breaks_the_sandbox(sandbox: LocalSandbox) -> None:
    assert sandbox.exec("true").ok
    _kill_agent(sandbox)
    with pytest.raises(SandboxBroken, match="agent") as info:
        sandbox.exec("echo never")
    assert info.value.sandbox_id == sandbox.id
    assert sandbox.health() is not None
    with pytest.raises(SandboxBroken):
        sandbox.exec("true")


def test_a_dead_agent_is_seen_before_any_command(sandbox: LocalSandbox) -> None:
    assert sandbox.exec("true").ok  # the agent is up
    _kill_agent(sandbox)
    assert _wait(lambda: sandbox.health() is not None), "health() reports the agent's exit"
    assert "agent" in (sandbox.health() or "")


def test_agent_killed_mid_command(sandbox: LocalSandbox) -> None:
    outcome: list[BaseException | object] = []

    def run() -> None:
        try:
            outcome.append(sandbox.exec("sleep 300 & sleep 300; echo never"))
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    assert _wait(lambda: len(processes_of_uid(sandbox.user.uid)) >= 3)
    _kill_agent(sandbox)
    worker.join(15)
    assert not worker.is_alive()
    assert isinstance(outcome[0], SandboxBroken) and "agent" in str(outcome[0])
    assert wait_no_processes(sandbox.user.uid) == []  # the command and its children went with it


def test_processes_left_behind_are_killed_when_the_command_ends(sandbox: LocalSandbox) -> None:
    r = sandbox.exec("sleep 300 & setsid sleep 300 & (sleep 300 &) ; echo started")
    assert r.ok and r.stdout == "started\n" and r.wall_s < 5
    assert wait_no_processes(sandbox.user.uid) == []
    assert sandbox.exec("echo next").stdout == "next\n"


def test_session_end_kills_everything(provider: LocalProvider) -> None:
    if not provider.exec_agent:
        pytest.skip("no exec agent on this host")
    sb = provider.create(SMALL)
    sb.exec("true")
    agent = _agent_pids(sb)
    sb.close()
    assert wait_no_processes(sb.user.uid) == []
    assert _wait(lambda: not any(os.path.exists(f"/proc/{p}") for p in agent))


def test_the_agent_dies_with_the_server(provider: LocalProvider) -> None:
    if not provider.exec_agent:
        pytest.skip("no exec agent on this host")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # a server that makes a sandbox, runs a background command, then is killed
        try:
            os.close(read_fd)
            sb = provider.create(SMALL)
            sb.exec("true")
            os.write(write_fd, f"{sb.user.uid} {' '.join(map(str, _agent_pids(sb)))}".encode())
            time.sleep(300)
        finally:
            os._exit(1)
    os.close(write_fd)
    uid_text, *agent_text = os.read(read_fd, 4096).decode().split()
    os.close(read_fd)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    agent = [int(p) for p in agent_text]
    assert agent
    assert _wait(lambda: not any(os.path.exists(f"/proc/{p}") for p in agent)), "the lifeline ends it"
    assert wait_no_processes(int(uid_text)) == []
    assert sweep_stale(provider.state_dir) >= 1  # what the next server does with what is left


@pytest.mark.parametrize(
    "busy",
    [
        "setsid sleep 300 & (sleep 300 &); trap '' TERM HUP INT; while :; do :; done",
        "bomb() { bomb | bomb & }; bomb; while :; do :; done",  # at the pids limit: no fork left
    ],
    ids=["busy-loop", "fork-bomb"],
)
def test_running_commands_die_with_the_server(provider: LocalProvider, busy: str) -> None:
    # The agent exited with its lifeline, but bubblewrap's init waits for every process of the
    # namespace: a busy command outlived a SIGKILLed server (and its own time limit, which only the
    # server enforced), with what it left and a trusted helper, keeping the namespace alive.
    if not provider.exec_agent:
        pytest.skip("no exec agent on this host")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # a server whose sandbox runs a busy command when it is killed
        try:
            os.close(read_fd)
            sb = provider.create(SMALL)
            sb.exec("sleep 300 >/dev/null 2>&1 &", as_root=True, background=True)  # a trusted helper
            threading.Thread(target=sb.exec, args=(["bash", "-c", busy],), kwargs={"timeout_s": 60}).start()
            assert _wait(lambda: len(processes_of_uid(sb.user.uid)) >= 3)  # bash and a few more
            assert sb.group is not None
            os.write(write_fd, f"{sb.user.uid} {' '.join(map(str, sb.group.pids()))}".encode())
            time.sleep(300)
        finally:
            os._exit(1)
    os.close(write_fd)
    uid, sandbox_pids = -1, []
    try:
        uid_text, *pids_text = os.read(read_fd, 4096).decode().split() or ["-1"]
        uid, sandbox_pids = int(uid_text), [int(p) for p in pids_text]
        # Bubblewrap, its init, the agent, the helper and the command's processes.
        assert len(sandbox_pids) >= 7, sandbox_pids
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pid = 0
        assert wait_no_processes(uid, timeout_s=5.0) == [], "the command outlived its server"
        assert _wait(lambda: not any(os.path.exists(f"/proc/{p}") for p in sandbox_pids)), [
            f"{p} {_comm(p)}" for p in sandbox_pids if os.path.exists(f"/proc/{p}")
        ]
    finally:
        os.close(read_fd)
        if pid:  # it failed before it was killed
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        for p in processes_of_uid(uid) if uid >= 0 else []:  # never past this test, whatever happened
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        assert sweep_stale(provider.state_dir) >= 1  # the host's side: the next server's


def test_command_flood_on_one_session(sandbox: LocalSandbox) -> None:
    results: dict[int, object] = {}

    def run(i: int) -> None:
        results[i] = sandbox.exec(f"echo {i}; head -c {1000 * i} /dev/zero | wc -c", stdin=b"x" * i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i in range(24):
        r = results[i]
        assert getattr(r, "ok", False), r
        assert getattr(r, "stdout", "").split() == [str(i), str(1000 * i)]
    assert sandbox.health() is None
    assert wait_no_processes(sandbox.user.uid) == []


def test_huge_output_is_capped_and_the_agent_survives(sandbox: LocalSandbox) -> None:
    r = sandbox.exec("yes flood")
    assert r.killed_by == "output" and r.stdout_truncated and len(r.stdout) < SMALL.max_output_bytes + 200
    assert sandbox.exec("echo after").stdout == "after\n"


def test_fork_bomb_within_the_pids_limit(sandbox: LocalSandbox) -> None:
    r = sandbox.exec("bomb() { bomb | bomb & }; bomb; sleep 2", timeout_s=5)
    assert "pids" in r.limits_hit
    assert wait_no_processes(sandbox.user.uid) == []
    assert sandbox.health() is None and sandbox.exec("echo alive").stdout == "alive\n"


def test_commands_cannot_reach_the_agent(sandbox: LocalSandbox) -> None:
    r = sandbox.exec(
        "ls /proc | grep -c '^[0-9]' >/dev/null;"
        "kill -9 2 2>/dev/null && echo SIGNALLED;"
        "cat /proc/2/environ 2>/dev/null && echo READ-ENV;"
        "head -c 1 /proc/2/mem 2>/dev/null && echo READ-MEM;"
        "ls /proc/2/fd 2>/dev/null && echo LISTED-FDS;"
        "ls /proc/self/fd;"
        "find / -xdev -type s 2>/dev/null | head -5;"
        "python3 -c 'import ctypes; l = ctypes.CDLL(None); print(\"ptrace\", l.ptrace(16, 2, 0, 0))';"
        "echo done"
    )
    assert r.exit_code == 0, r
    lines = r.stdout.split()
    for word in ("SIGNALLED", "READ-ENV", "READ-MEM", "LISTED-FDS"):
        assert word not in lines, r.stdout
    # Its only descriptors are stdin, stdout, stderr and ls's own directory: no socket, no lifeline.
    assert lines[:4] == ["0", "1", "2", "3"] and lines[4] in ("ptrace", "done"), r.stdout
    assert "ptrace -1" in r.stdout  # PTRACE_ATTACH to the agent is refused
    assert _agent_pids(sandbox) and sandbox.exec("echo ok").stdout == "ok\n"


def test_reset_keeps_the_agent_and_kills_commands(sandbox: LocalSandbox) -> None:
    sandbox.exec("echo data > f; mkdir -p d/e; ln -s /etc/passwd link")
    agent = _agent_pids(sandbox)
    sandbox.reset()
    assert _agent_pids(sandbox) == agent
    r = sandbox.exec("ls -A /workspace")
    assert r.ok and r.stdout == "", r


#: Leaves a SysV shared memory segment (a secret in it), a message queue and a semaphore set.
LEAVE_IPC = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
shm = libc.shmget(0x7A11, 4096, 0o1600)
ctypes.memmove(libc.shmat(shm, None, 0), b"from the last session", 21)
print(shm, libc.msgget(0x7A12, 0o1600), libc.semget(0x7A13, 1, 0o1600))
"""
#: What of those the namespace still holds.
READ_IPC = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
shm = libc.shmget(0x7A11, 0, 0)
print(ctypes.string_at(libc.shmat(shm, None, 0), 21) if shm >= 0 else None)
print([len(open(f"/proc/sysvipc/{t}").readlines()) - 1 for t in ("shm", "msg", "sem")])
"""


def test_reset_removes_what_commands_left_in_the_ipc_namespace(sandbox: LocalSandbox) -> None:
    # The namespace outlives the processes: the next session read the segment, and its memory counted
    # against that session.
    made = sandbox.exec(["python3", "-c", LEAVE_IPC])
    assert made.ok and all(int(i) >= 0 for i in made.stdout.split()), made
    assert sandbox.exec(["python3", "-c", READ_IPC]).stdout.splitlines()[1] == "[1, 1, 1]"
    sandbox.reset()
    assert sandbox.exec(["python3", "-c", READ_IPC]).stdout.splitlines() == ["None", "[0, 0, 0]"]


def test_reset_restores_the_workspace_and_tmp_themselves(sandbox: LocalSandbox) -> None:
    # Emptied in place, they kept what a command set on them: chmod 000 failed every later command,
    # and an extended attribute carried a message to the next session (where the file system takes
    # user attributes: tmpfs before Linux 6.6 does not).
    mark = (
        "import errno, os\n"
        "for d in ('/workspace', '/tmp'):\n"
        "    try:\n"
        "        os.setxattr(d, 'user.note', b'secret')\n"
        "    except OSError as e:\n"
        "        if e.errno != errno.EOPNOTSUPP:\n"
        "            raise\n"
        "    os.utime(d, (978307200, 978307200))\n"
        "    os.chmod(d, 0)\n"
    )
    assert sandbox.exec(["python3", "-c", mark], cwd="/").ok
    sandbox.reset()
    look = (
        "import os\n"
        "for d in ('/workspace', '/tmp'):\n"
        "    s = os.stat(d)\n"
        "    print(oct(s.st_mode & 0o777), os.listxattr(d), s.st_mtime > 978307200)\n"
        "open('/workspace/f', 'w').write('here')\n"
    )
    after = sandbox.exec(["python3", "-c", look])
    assert after.ok and after.stdout == "0o700 [] True\n0o700 [] True\n", after


def test_reset_empties_a_tree_too_deep_to_delete_recursively(sandbox: LocalSandbox) -> None:
    # shutil.rmtree recursed past Python's limit: the reset raised, and the sandbox leaked.
    dig = (
        "import os\nfor _ in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\nopen('f', 'w').write('x')\n"
    )
    assert sandbox.exec(["python3", "-c", dig]).ok
    sandbox.reset()
    assert sandbox.exec("ls -A /workspace").stdout == ""


@pytest.mark.skipif(shutil.which("nsenter") is None, reason="needs nsenter (util-linux) to cap the ptys")
def test_a_sandbox_holds_at_most_its_share_of_pseudo_terminals(sandbox: LocalSandbox) -> None:
    # Its /dev/pts had no limit: one command took all 3,071 the host's other instances share.
    hog = (
        "import os\nheld = []\ntry:\n    while True:\n        held.append(os.openpty())\n"
        "except OSError as e:\n    print(len(held), e.errno)\n"
    )
    took = sandbox.exec(["python3", "-c", hog])
    assert took.stdout.split() == [str(PTYS_PER_SANDBOX), str(errno.ENOSPC)], took


def test_a_running_command_does_not_hold_up_the_next(sandbox: LocalSandbox) -> None:
    # The agent learns that its spare took a command from the spare's hand-over (an eventfd's ring),
    # and forks the next spare then: a second command runs while the first still does.
    first = threading.Thread(target=sandbox.exec, args=(["sleep", "4"],), kwargs={"timeout_s": 10})
    first.start()
    try:
        assert _wait(lambda: any(_comm(p) == "sleep" for p in processes_of_uid(sandbox.user.uid)))
        started = time.monotonic()
        r = sandbox.exec(["echo", "second"], timeout_s=10)
        assert (r.exit_code, r.stdout) == (0, "second\n"), r
        assert time.monotonic() - started < 3.0, "the second command waited for the first to end"
    finally:
        first.join(15)


def test_many_short_commands_in_a_row(sandbox: LocalSandbox) -> None:
    # The exit report often arrives in the same wake-up as the last output: none of it may be lost.
    for i in range(150):
        r = sandbox.exec(["sh", "-c", f"echo {i}; echo e{i} >&2"], cores=(0,) if i % 2 else ())
        assert (r.exit_code, r.stdout, r.stderr) == (0, f"{i}\n", f"e{i}\n"), r


def test_background_processes_only_when_declared(sandbox: LocalSandbox, provider: LocalProvider) -> None:
    core = (min(provider.host_cpus),)
    r = sandbox.exec("sleep 300 >/dev/null 2>&1 & echo started", background=True, cores=core)
    assert r.ok and r.stdout == "started\n"
    kept = processes_of_uid(sandbox.user.uid)
    assert len(kept) == 1, "the declared background process outlives its command"
    r = sandbox.exec("pgrep -c sleep; grep Cpus_allowed_list /proc/$(pgrep sleep)/status")
    lines = r.stdout.split()
    assert lines[0] == "1", r
    if len(provider.host_cpus) > 1:
        assert lines[-1] != str(core[0]), r  # unpinned: its command's grant is over
    assert processes_of_uid(sandbox.user.uid) == kept  # an ordinary command left it alone
    sandbox.reset()  # a session's end: nothing outlives it
    assert wait_no_processes(sandbox.user.uid) == []


def test_background_processes_end_with_the_sandbox(provider: LocalProvider) -> None:
    if not provider.exec_agent:
        pytest.skip("no exec agent on this host")
    sb = provider.create(SMALL)
    sb.exec("sleep 300 >/dev/null 2>&1 &", background=True)
    assert processes_of_uid(sb.user.uid)
    sb.close()
    assert wait_no_processes(sb.user.uid) == []


def test_commands_are_looked_up_in_their_own_path(sandbox: LocalSandbox) -> None:
    # The agent's own PATH search (no os.execvpe): entries that are files, or hold a file of the
    # command's name that cannot run, are passed over as a shell would; nothing found is exit 127.
    sandbox.write_file("bin/true", "not a program")
    sandbox.write_file("plain-file", "")
    path = "/workspace/plain-file:/workspace/bin:/usr/bin:/bin"
    r = sandbox.exec(["true"], env={"PATH": path})
    assert r.exit_code == 0, r
    r = sandbox.exec(["no-such-command"], env={"PATH": path})
    assert r.exit_code == 127 and "no-such-command" in r.stderr, r
    r = sandbox.exec(["./bin/true"])
    assert r.exit_code == 127 and "Permission denied" in r.stderr, r


def test_commands_hold_no_capabilities_and_default_signals(sandbox: LocalSandbox) -> None:
    r = sandbox.exec(["sh", "-c", "grep -E '^(Cap|NoNewPrivs|SigIgn)' /proc/self/status; id -G"])
    fields = dict(line.split(":\t") for line in r.stdout.splitlines()[:-1])
    assert {k: v for k, v in fields.items() if k.startswith("Cap")} == {
        k: "0000000000000000" for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
    }, r.stdout
    assert fields["NoNewPrivs"] == "1" and fields["SigIgn"] == "0000000000000000", r.stdout
    assert r.stdout.splitlines()[-1] == str(sandbox.user.gid), r.stdout  # no supplementary groups


def test_commands_get_default_signals_whatever_the_server_inherited(provider: LocalProvider) -> None:
    # A server started under nohup, or as a script's background job, ignores SIGHUP (and SIGINT,
    # SIGQUIT); its sandboxes' commands inherited that, and blocked signals too.
    if not provider.exec_agent:
        pytest.skip("this host gives sandboxes no exec agent (needs root, cgroups and /usr/bin/python3)")
    ignored = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGHUP, signal.SIGQUIT)}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        sb = provider.create(SMALL)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for sig, handler in ignored.items():
            signal.signal(sig, handler)
    try:
        r = sb.exec(["sh", "-c", "grep -E '^Sig(Ign|Blk)' /proc/self/status"])
        assert dict(line.split(":\t") for line in r.stdout.splitlines()) == {
            "SigBlk": "0000000000000000",
            "SigIgn": "0000000000000000",
        }, r.stdout
    finally:
        sb.close()


def test_a_spare_is_waiting_and_its_death_breaks_the_sandbox(sandbox: LocalSandbox) -> None:
    # The agent forks each command's process before the command arrives; that spare is part of the
    # agent: killed from outside, the agent exits and the sandbox is broken, never half-working.
    assert sandbox.exec("true").ok
    assert _wait(lambda: len(_spare_pids(sandbox)) == 1), "a spare waits for the next command"
    spare = _spare_pids(sandbox)[0]
    assert sandbox.exec("true").ok
    assert _wait(lambda: _spare_pids(sandbox) not in ([], [spare])), (
        "the spare became the command; a new one waits"
    )
    os.kill(_spare_pids(sandbox)[0], signal.SIGKILL)
    assert _wait(lambda: sandbox.health() is not None), "the agent exits"
    with pytest.raises(SandboxBroken, match="agent"):
        sandbox.exec("echo never")


def test_a_command_arriving_at_the_pids_limit(sandbox: LocalSandbox) -> None:
    # While the sandbox is at its pids limit the agent cannot fork the next spare: the one already
    # waiting runs the next command, and spares come back once processes are freed.
    assert sandbox.group is not None
    group = sandbox.group
    # Every pid, kept; only once the agent has forked the spare that the next command takes.
    hold = "sleep 0.3; for i in {1..100}; do sleep 30 & done 2>/dev/null; exec sleep 3"
    holder = threading.Thread(target=sandbox.exec, args=(["bash", "-c", hold],), kwargs={"timeout_s": 6})
    holder.start()
    assert _wait(lambda: int(group.read("pids", "pids.current") or 0) >= SMALL.max_pids)
    r = sandbox.exec(["sleep", "0.3"])  # no fork of its own; long enough for the agent to try one
    assert r.ok, r
    holder.join(15)
    with open(os.path.join(sandbox.dir, "agent.log")) as f:
        log = f.read()
    assert "cannot fork a spare" in log, log
    assert sandbox.exec("echo after").stdout == "after\n"
    assert sandbox.health() is None


def test_a_command_taken_and_ended_while_the_agent_was_held(sandbox: LocalSandbox) -> None:
    # The agent sees the spare's hand-over and its exit in the same round: one report, no confusion.
    assert sandbox.exec("true").ok
    assert _wait(lambda: len(_spare_pids(sandbox)) == 1)
    agent = next(p for p in _agent_pids(sandbox) if _comm(p) == "python3")
    outcome: list[object] = []
    os.kill(agent, signal.SIGSTOP)
    try:
        worker = threading.Thread(
            target=lambda: outcome.append(sandbox.exec(["sh", "-c", "echo held; exit 3"]))
        )
        worker.start()
        time.sleep(0.5)  # the command ran and exited; its hand-over and its exit both wait for the agent
        assert not outcome
    finally:
        os.kill(agent, signal.SIGCONT)
    worker.join(10)
    r = outcome[0]
    assert getattr(r, "exit_code", None) == 3 and getattr(r, "stdout", "") == "held\n", r
    assert sandbox.exec("echo next").stdout == "next\n"
    assert sandbox.health() is None


def test_a_command_is_under_its_limits_from_its_first_instruction(sandbox: LocalSandbox) -> None:
    # The command's process joins its exec group (through descriptors the server opened) and takes
    # its cores, OOM score and rlimits before the exec: what the command itself reads first is that.
    core = sorted(os.sched_getaffinity(0))[-1]
    r = sandbox.exec(
        ["cat", "/proc/self/cgroup", "/proc/self/oom_score_adj", "/proc/self/status"], cores=(core,)
    )
    assert r.exit_code == 0, r
    groups = dict(
        line.split(":", 2)[1:] for line in r.stdout.splitlines() if line[:1].isdigit() and ":" in line
    )
    for controller in ("cpuacct", "cpuset") if _version(sandbox) == 1 else ("",):
        assert re.search(_exec_group(sandbox), groups[controller]), r.stdout
    assert "\n500\n" in r.stdout, r.stdout
    assert re.search(rf"^Cpus_allowed_list:\s+{core}$", r.stdout, re.M), r.stdout
    limits = sandbox.exec(["cat", "/proc/self/limits"]).stdout
    assert re.search(rf"^Max open files\s+{SMALL.max_open_files}\s+{SMALL.max_open_files}\s", limits, re.M)
    assert re.search(rf"^Max processes\s+{SMALL.max_pids}\s+{SMALL.max_pids}\s", limits, re.M), limits


def test_a_command_that_cannot_be_placed_never_runs(
    sandbox: LocalSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Placing fails (an OOM score the kernel refuses): the process exits before the command, and
    # the failure is the sandbox's, not a result of the command.
    monkeypatch.setattr("tangram_env.server.sandbox.local._COMMAND_OOM_SCORE_ADJ", 5000)
    with pytest.raises(SandboxBroken, match="could not be placed"):
        sandbox.exec("touch ran")
    assert not os.path.exists(os.path.join(sandbox.host_workspace, "ran"))


def test_output_beyond_a_pipe_and_after_a_pause_is_read_whole(sandbox: LocalSandbox) -> None:
    # A short command's output is read on its exit report; a longer or larger one as it comes.
    big = sandbox.exec("head -c 300000 /dev/zero | tr '\\0' a; echo done >&2")
    assert big.ok and big.stdout_truncated and big.stdout.startswith("a" * SMALL.max_output_bytes), big
    assert f"{300000 - SMALL.max_output_bytes} more bytes" in big.stdout and big.stderr == "done\n", big
    r = sandbox.exec("echo first; sleep 0.05; echo second >&2; sleep 0.05; echo third")
    assert (r.stdout, r.stderr) == ("first\nthird\n", "second\n"), r


def test_every_thread_of_a_command_is_in_its_exec_group(sandbox: LocalSandbox) -> None:
    # The command's process joins with its one thread (the v1 tasks file; v2 moves it whole);
    # threads and processes it starts afterwards are born in the group.
    key = "cpuacct:" if _version(sandbox) == 1 else "0::"
    script = (
        "import os, threading, subprocess\n"
        "ts = [threading.Thread(target=threading.Event().wait, args=(0.2,)) for _ in range(3)]\n"
        "[t.start() for t in ts]\n"
        "for tid in os.listdir('/proc/self/task'):\n"
        f"    print(open(f'/proc/self/task/{{tid}}/cgroup').read().split({key!r})[1].split()[0])\n"
        "print(subprocess.run(['cat', '/proc/self/cgroup'], capture_output=True, text=True)"
        f".stdout.split({key!r})[1].split()[0])\n"
    )
    core = sorted(os.sched_getaffinity(0))[-1]
    r = sandbox.exec(["python3", "-c", script], cores=(core,))
    assert r.exit_code == 0, r
    lines = r.stdout.split()
    assert len(lines) == 5, r.stdout  # the main thread, three more, and a child process
    assert all(re.search(_exec_group(sandbox), line) for line in lines), r.stdout
    assert len(set(lines)) == 1, r.stdout


def test_a_command_whose_server_gave_up_never_runs(sandbox: LocalSandbox) -> None:
    # The server closed the connection (it gave up on the command) before the spare took it: the
    # spare reads the request, places itself, sees the connection closed and exits unrun.
    assert sandbox.agent is not None and sandbox.exec("true").ok
    assert _wait(lambda: len(_spare_pids(sandbox)) == 1)
    spare = _spare_pids(sandbox)[0]
    claim = sandbox.slots.claim()
    assert claim is not None
    os.kill(spare, signal.SIGSTOP)  # held, so that the connection is closed before it is taken
    passed: list[int] = []
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(sandbox.agent.socket_path)
        passed.append(os.open(os.devnull, os.O_RDONLY))
        for _ in range(2):
            r, w = os.pipe()
            os.close(r)
            passed.append(w)
        passed += [os.open(f, os.O_WRONLY) for f in claim.group.join_files(("cpuacct",))]
        request = {
            "argv": ["touch", "ran"],
            "env": {"PATH": "/usr/bin:/bin"},
            "cwd": sandbox.workspace,
            "join": len(passed) - 3,
            "cores": [],
            "rlimits": [],
            "oom_score_adj": 500,
        }
        body = json.dumps(request).encode()
        fds = array.array("i", passed)
        conn.sendmsg([struct.pack("<I", len(body)) + body], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        conn.close()
    finally:
        for fd in passed:
            os.close(fd)
        os.kill(spare, signal.SIGCONT)
    assert _wait(lambda: spare not in _spare_pids(sandbox) and len(_spare_pids(sandbox)) == 1)
    sandbox.slots.release(claim)
    assert sandbox.exec("echo after").stdout == "after\n" and sandbox.health() is None
    assert not os.path.exists(os.path.join(sandbox.host_workspace, "ran"))


def test_a_command_that_times_out_before_it_is_placed_never_runs(sandbox: LocalSandbox) -> None:
    # The deadline passed while the command's process was still placing itself (held here; on cgroup
    # v2 a move can wait for an RCU grace period): its exec group was still empty when the server
    # killed it. Placed later, it ran unbounded, and the sandbox broke when no exit came in time.
    assert sandbox.agent is not None and sandbox.exec("true").ok
    assert _wait(lambda: len(_spare_pids(sandbox)) == 1)
    spare = _spare_pids(sandbox)[0]
    os.kill(spare, signal.SIGSTOP)
    resume = threading.Timer(1.0, os.kill, (spare, signal.SIGCONT))
    resume.start()
    try:
        r = sandbox.exec("touch ran; sleep 30", timeout_s=0.3)
    finally:
        resume.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.kill(spare, signal.SIGCONT)
    assert r.killed_by == "timeout" and r.wall_s < 5, r
    assert sandbox.health() is None and sandbox.exec("echo after").stdout == "after\n"
    assert not os.path.exists(os.path.join(sandbox.host_workspace, "ran"))
    assert wait_no_processes(sandbox.user.uid) == []


def test_closing_a_sandbox_under_a_command_fails_the_command_without_a_warning(
    sandbox: LocalSandbox, caplog: pytest.LogCaptureFixture
) -> None:
    # Every Ctrl-C of a trainer with a command running logged "sandbox ... is broken: the exec agent
    # died during the command" as a WARNING: the sandbox died as asked.
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            sandbox.exec("sleep 30", timeout_s=60)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(0.5)
    with caplog.at_level("DEBUG", logger="tangram_env.server.sandbox.local"):
        sandbox.close()
        worker.join(30)
    assert outcome and isinstance(outcome[0], SandboxBroken), outcome
    said = [r for r in caplog.records if "is broken" in r.getMessage()]
    assert said and all(r.levelname == "DEBUG" for r in said), [(r.levelname, r.getMessage()) for r in said]
