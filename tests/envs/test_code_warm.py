"""The ``code`` env's warm judge: it grades as the cold harness does, and submissions cannot reach it.

Everything runs in real local sandboxes (root, cgroups, the exec agent); without an agent the
warm judge is not used, and these tests skip.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from collections.abc import Iterator

import pytest

from tangram_env.envs.code_tasks import HarnessSpec, get_task, harness_invocation, load_tasks, read_report
from tangram_env.envs.code_tasks.grading import HarnessReport
from tangram_env.envs.code_tasks.warm import grade_warm
from tangram_env.sandbox import SandboxBroken, SandboxSpec
from tangram_env.server.sandbox.local import LocalProvider, LocalSandbox
from tests.conftest import wait_for
from tests.server.sandbox.helpers import processes_of_uid, wait_no_processes

TASK = "digital-root"
SPEC = SandboxSpec(mem_mb=512, max_pids=128)


@pytest.fixture(scope="module")
def provider() -> Iterator[LocalProvider]:
    made = LocalProvider()
    if not made.exec_agent:
        made.close()
        pytest.skip("this host gives sandboxes no exec agent (needs root, cgroups and /usr/bin/python3)")
    yield made
    made.close()


@pytest.fixture
def sandbox(provider: LocalProvider) -> Iterator[LocalSandbox]:
    made = provider.create(SPEC)
    yield made
    made.close()


def warm(sb: LocalSandbox, spec: HarnessSpec, timeout_s: float = 60.0) -> HarnessReport:
    got = grade_warm(sb, spec, (0,), timeout_s)
    assert got is not None, "the sandbox has an agent: the warm judge grades"
    return read_report(got[0], spec, got[1])


def cold(sb: LocalSandbox, spec: HarnessSpec) -> HarnessReport:
    argv, stdin = harness_invocation(spec, "report.json")
    run = sb.exec(argv, stdin=stdin, timeout_s=spec.sandbox_timeout_s(), cores=(0,))
    try:
        data: bytes | None = sb.read_file("report.json")
    except OSError:
        data = None
    return read_report(data, spec, run)


def outcome(report: HarnessReport) -> tuple[object, ...]:
    return (
        report.stage,
        report.import_error is None,
        report.problem is None,
        [(t.name, t.passed, t.timed_out, t.reported) for t in report.tests],
    )


def variants(entry_point: str) -> dict[str, str]:
    """Wrong answers of every kind, for any task."""
    return {
        "returns-none": f"def {entry_point}(*args, **kwargs):\n    return None\n",
        "raises": f"def {entry_point}(*args, **kwargs):\n    raise ValueError('no')\n",
        "fails-to-import": "raise RuntimeError('not today')\n",
        "exits": "import os\nos._exit(3)\n",
        "syntax-error": f"def {entry_point}(:\n",
    }


def test_warm_and_cold_grade_alike(sandbox: LocalSandbox) -> None:
    for task in load_tasks():
        sources = {"reference": task.reference_solution, **variants(task.entry_point)}
        for name, source in sources.items():
            spec = HarnessSpec.for_task(task, source, timeout_s=10.0)
            hot, frozen = warm(sandbox, spec), cold(sandbox, spec)
            assert outcome(hot) == outcome(frozen), (task.id, name)
            assert (hot.fraction == 1.0) == (name == "reference"), (task.id, name)


def test_timeouts_and_crashes_mid_test_grade_alike(sandbox: LocalSandbox) -> None:
    task = get_task(TASK)
    body = "    import os, time\n    if n == 0:\n        {}\n    return 0 if n == 0 else 1 + (n - 1) % 9\n"
    for what in ("time.sleep(30)", "os._exit(1)", "os.kill(os.getpid(), 9)", "os.kill(os.getpid(), 15)"):
        source = "def digital_root(n):\n" + body.format(what)
        spec = HarnessSpec.for_task(task, source, timeout_s=0.5)
        hot, frozen = warm(sandbox, spec), cold(sandbox, spec)
        assert outcome(hot) == outcome(frozen), what
        assert 0 < hot.passed < hot.total, what


PROBE = r"""
import ctypes, errno, json, os, signal, stat
libc = ctypes.CDLL(None, use_errno=True)
me, seen = os.getpid(), {}
for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
    if pid == me:
        continue
    try:
        status = open(f"/proc/{pid}/status").read()
        uid = int(status.split("\nUid:")[1].split()[0])  # the real uid (/proc/PID's owner hides it)
        name = open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        continue
    got = seen[pid] = {"uid": uid, "name": name}
    try:
        os.kill(pid, signal.SIGKILL)
        got["kill"] = "sent"
    except OSError as exc:
        got["kill"] = type(exc).__name__
    got["ptrace"] = "attached" if libc.ptrace(16, pid, 0, 0) == 0 else errno.errorcode[ctypes.get_errno()]
    for what, mode in (("mem", "r+b"), ("environ", "rb"), ("fd", None)):
        try:
            if mode:
                open(f"/proc/{pid}/{what}", mode).read(1)
            else:
                os.listdir(f"/proc/{pid}/fd")
            got[what] = "open"
        except OSError as exc:
            got[what] = type(exc).__name__
sockets = [n for n in os.listdir("/tmp") if stat.S_ISSOCK(os.lstat("/tmp/" + n).st_mode)]
try:
    os.kill(-1, signal.SIGKILL)
except OSError:
    pass
raise SystemExit("probe:" + json.dumps({"seen": seen, "sockets": sockets}))
"""


def test_a_submission_cannot_signal_trace_or_read_the_judge(sandbox: LocalSandbox) -> None:
    task = get_task(TASK)
    report = warm(sandbox, HarnessSpec.for_task(task, PROBE))
    assert report.import_error and report.fraction == 0.0
    probe = json.loads(report.import_error.split("probe:", 1)[1].splitlines()[0])
    root = {pid: got for pid, got in probe["seen"].items() if got["uid"] == 0}
    assert any(got["name"].startswith("python") for got in root.values()), probe  # the judge, zygote
    for got in root.values():  # the agent, the judge and its zygote: out of reach
        assert got["kill"] == "PermissionError" and got["ptrace"] == "EPERM", got
        assert got["mem"] == got["environ"] == got["fd"] == "PermissionError", got
    assert probe["sockets"] == []  # the judge's socket has no name left to connect to
    # The same judge (it was not replaced) goes on grading, right answers full marks.
    assert warm(sandbox, HarnessSpec.for_task(task, task.reference_solution)).fraction == 1.0


LEFTOVER = r"""
import os, signal, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        while True:  # tamper with whatever runs next: kill it, or fill /tmp with answers
            for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
                if pid != os.getpid():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            open("/tmp/leftover-was-here", "w").write(str(time.time()))
            time.sleep(0.01)
    os._exit(0)
def digital_root(n):
    return None
"""


#: The kernel's flag for a task that has begun to exit (``PF_EXITING``, in ``/proc/PID/stat``).
_PF_EXITING = 0x4


def _dying(pid: int) -> bool:
    """Whether ``pid`` is gone, a zombie, exiting, or has a SIGKILL pending.

    A SIGKILL taken off the pending set is no longer shown there, while the task tears itself down
    (on a loaded host that can be read before it turns zombie): its ``PF_EXITING`` flag shows it.
    """
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        with open(f"/proc/{pid}/stat") as f:
            flags = int(f.read().rsplit(")", 1)[1].split()[6])  # after the name: state, ppid ... flags
    except (OSError, IndexError, KeyError, ValueError):
        return True  # gone (or going) while it was read
    pending = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
    return fields["State"].split()[0] in ("Z", "X") or bool(pending & (1 << 8)) or bool(flags & _PF_EXITING)


def test_nothing_a_grading_leaves_running_outlives_it(sandbox: LocalSandbox) -> None:
    task = get_task(TASK)
    assert warm(sandbox, HarnessSpec.for_task(task, LEFTOVER)).fraction == 0.0
    # Killed before the tool heard the grading's end: each leftover is dying, gone, or (a SIGKILL just
    # taken off the pending set, PF_EXITING not yet set: a window a loaded host can read in) shows it
    # within a moment; one never killed loops on for good and fails this.
    wait_for(
        lambda: all(_dying(pid) for pid in processes_of_uid(sandbox.user.uid)),
        1.0,
        "the leftovers to die",
        0.01,
    )
    assert wait_no_processes(sandbox.user.uid) == []
    beat = os.path.join(sandbox.host_tmp, "leftover-was-here")
    before = os.path.getmtime(beat)
    time.sleep(0.1)
    assert os.path.getmtime(beat) == before
    assert warm(sandbox, HarnessSpec.for_task(task, task.reference_solution)).fraction == 1.0


#: Fills the sandbox's process limit with sleepers out of the solution's process group (setsid: the
#: judge's killpg misses them), then ends its process in the first test, so that the judge needs a new
#: one that cannot be forked.
FILLS_THE_PROCESS_LIMIT = """
import os, time
while True:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        os.setsid()
        time.sleep(60)
        os._exit(0)
def digital_root(n):
    os._exit(3)
"""


def test_a_solution_that_fills_the_process_limit_fails_and_leaves_nothing(sandbox: LocalSandbox) -> None:
    task = get_task(TASK)
    report = warm(sandbox, HarnessSpec.for_task(task, FILLS_THE_PROCESS_LIMIT))
    assert report.fraction == 0.0 and report.stage == "done", report  # the judge lived through it
    assert any("could not be started again" in (t.error or "") for t in report.tests), report.tests
    # Killed before the tool heard the grading's end, though no process could be forked to do it.
    assert wait_no_processes(sandbox.user.uid) == []
    assert warm(sandbox, HarnessSpec.for_task(task, task.reference_solution)).fraction == 1.0


def test_the_judges_socket_is_root_only_and_unlinked(sandbox: LocalSandbox) -> None:
    task = get_task(TASK)
    warm(sandbox, HarnessSpec.for_task(task, task.reference_solution))
    names = os.listdir(sandbox.host_tmp)
    assert not [n for n in names if stat.S_ISSOCK(os.lstat(os.path.join(sandbox.host_tmp, n)).st_mode)]


def test_a_reset_sandbox_gets_a_new_judge(sandbox: LocalSandbox) -> None:
    task = get_task(TASK)
    spec = HarnessSpec.for_task(task, task.reference_solution)
    assert warm(sandbox, spec).fraction == 1.0
    sandbox.reset()  # kills the judge with everything else
    assert warm(sandbox, HarnessSpec.for_task(task, task.reference_solution)).fraction == 1.0


def test_past_the_tools_deadline_the_grading_is_a_timeout_and_leaves_nothing(sandbox: LocalSandbox) -> None:
    task = get_task(TASK)
    warm(sandbox, HarnessSpec.for_task(task, task.reference_solution))  # the judge is up
    slow = "import time\ndef digital_root(n):\n    time.sleep(30)\n"
    report = warm(sandbox, HarnessSpec.for_task(task, slow, timeout_s=20.0), timeout_s=1.0)
    assert report.fraction == 0.0 and "timeout" in (report.problem or ""), report.problem
    assert wait_no_processes(sandbox.user.uid) == []
    assert warm(sandbox, HarnessSpec.for_task(task, task.reference_solution)).fraction == 1.0


def test_a_sandbox_that_dies_mid_grade_is_never_a_grade(sandbox: LocalSandbox) -> None:
    task = get_task(TASK)
    warm(sandbox, HarnessSpec.for_task(task, task.reference_solution))  # the judge is up
    slow = "import time\ndef digital_root(n):\n    time.sleep(0.3)\n    return 0\n"

    def die() -> None:  # as the provider does with a sandbox it can no longer trust
        sandbox._mark_broken("killed by the test")
        sandbox._kill_everything()

    threading.Timer(0.5, die).start()
    with pytest.raises(SandboxBroken):
        warm(sandbox, HarnessSpec.for_task(task, slow, timeout_s=5.0))


def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(") ", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(") ", 1)[1].split()[1])


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_an_exec_agent_killed_from_outside_mid_grade_is_never_a_grade(sandbox: LocalSandbox) -> None:
    # Nothing marks the sandbox broken first: the judge's end was seen while the agent's bubblewrap
    # still ran, and a right answer was graded 0.0 ("ended while importing the solution").
    task = get_task(TASK)
    warm(sandbox, HarnessSpec.for_task(task, task.reference_solution))  # the judge is up
    assert sandbox.agent is not None
    tree = _descendants(sandbox.agent.proc.pid)
    judge = min(p for p in tree if b"--serve" in _cmdline(p))
    agent = _parent(judge)  # the agent that started it
    assert b"exec agent" in _cmdline(agent)
    slow_right = "import time\ntime.sleep(0.6)\n" + task.reference_solution
    threading.Timer(0.3, os.kill, (agent, 9)).start()
    with pytest.raises(SandboxBroken, match="the exec agent exited"):
        warm(sandbox, HarnessSpec.for_task(task, slow_right, timeout_s=5.0))


def test_two_gradings_of_one_sandbox_at_once_take_turns(sandbox: LocalSandbox) -> None:
    task = get_task(TASK)
    warm(sandbox, HarnessSpec.for_task(task, task.reference_solution))  # the judge is up
    slow_right = task.reference_solution + "\nimport time\ntime.sleep(0.3)\n"
    reports: list[HarnessReport] = []
    threads = [
        threading.Thread(target=lambda: reports.append(warm(sandbox, HarnessSpec.for_task(task, slow_right))))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r.fraction for r in reports] == [1.0, 1.0]  # neither one's end killed the other's processes


def test_solution_processes_run_as_the_sandboxs_user_with_nothing_more(sandbox: LocalSandbox) -> None:
    task = get_task(TASK)
    source = (
        "status = open('/proc/self/status').read()\n"
        "raise SystemExit('status:' + ';'.join(line.replace('\\t', ' ') for line in status.splitlines()\n"
        "    if line.startswith(('Cap', 'Uid', 'Gid', 'Groups', 'NoNewPrivs'))))\n"
    )
    report = warm(sandbox, HarnessSpec.for_task(task, source))
    fields = dict(
        line.split(":", 1)
        for line in (report.import_error or "").split("status:", 1)[1].split("\n")[0].split(";")
    )
    uid = str(sandbox.user.uid)
    assert fields["Uid"].split() == [uid] * 4 and fields["Groups"].strip() == "", fields
    assert all(int(fields[c], 16) == 0 for c in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")), fields
    assert fields["NoNewPrivs"].strip() == "1", fields


#: Widens its own affinity to every core and reports where it may run (and where its child may).
WIDENS_ITS_AFFINITY = """
import os
os.sched_setaffinity(0, range(os.cpu_count()))
child = os.fork()
if child == 0:
    os._exit(0 if os.sched_getaffinity(0) == {0} else 1)
_, status = os.waitpid(child, 0)
raise SystemExit(f"cores:{sorted(os.sched_getaffinity(0))}:{os.waitstatus_to_exitcode(status)}")
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to widen onto")
def test_a_solution_runs_on_its_gradings_cores_alone(sandbox: LocalSandbox) -> None:
    # A solution may widen its affinity; its cpuset it cannot. Unheld, an audit's solution took every
    # core, and honest gradings beside it failed their timed tests (a valid reward, lowered).
    task = get_task(TASK)
    for _ in range(2):  # the grading that starts the judge, then one it serves warm
        report = warm(sandbox, HarnessSpec.for_task(task, WIDENS_ITS_AFFINITY))
        assert (report.import_error or "").split("cores:", 1)[1].startswith("[0]:0"), report.import_error
