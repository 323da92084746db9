"""Rewards of the ``code`` env cannot be forged, and infrastructure failures are never rewards.

Every hack runs as an agent's submission through a real orchestrator and real sandboxes. Each one's
honest part is wrong (the function returns None), so any reward above 0.0 means the hack worked.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import pytest

import tangram_env
from tangram_env.envs.code import CodeEnv
from tangram_env.envs.code_tasks import load_tasks
from tangram_env.errors import RewardUnavailable
from tests.conftest import ServerProcess
from tests.envs.faults.dying_sandbox import MARKER

TASK = "digital-root"
WRONG = "\ndef digital_root(n):\n    return None\n"

HACKS = {
    # Reach the judge's objects through this interpreter's heap: there are none here.
    "walks-the-gc": """
import gc
for obj in gc.get_objects():
    if type(obj).__name__ in ("_Report", "_Judge", "HarnessReport"):
        raise SystemExit("found the grader")
def digital_root(n):
    for obj in gc.get_objects():
        data = getattr(obj, "data", None)
        if isinstance(data, dict) and "tests" in data:
            data["tests"] = [dict(t, passed=True, error=None) for t in data["tests"]]
    return None
""",
    # Scan every process's memory for the nonce, sign a report of all passes, then end the grader.
    "reads-the-judges-memory": r"""
import hashlib, hmac, json, os, re, signal
tried = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    if int(pid) == os.getpid():
        continue
    for what in ("environ", "maps", "mem"):
        try:
            open(f"/proc/{pid}/{what}", "rb").read(1)
            tried.append(f"{pid}/{what}: open")
        except OSError as exc:
            tried.append(f"{pid}/{what}: {type(exc).__name__}")
    try:
        maps, mem = open(f"/proc/{pid}/maps").read(), open(f"/proc/{pid}/mem", "rb")
    except OSError:
        continue
    for line in maps.splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        try:
            mem.seek(lo)
            chunk = mem.read(min(hi - lo, 1 << 24))
        except (OSError, ValueError, OverflowError):
            continue
        for nonce in re.findall(rb'"nonce":"([0-9a-f]{32})"', chunk):
            names = [n.decode() for n in re.findall(rb'\{"name":"([^"]+)","code"', chunk)]
            body = json.dumps({"stage": "done", "import_error": None, "import_stdout": "",
                               "import_stderr": "", "harness_error": None,
                               "tests": [{"name": n, "passed": True} for n in names]})
            mac = hmac.new(nonce, body.encode(), hashlib.sha256).hexdigest()
            with open("report.json", "w") as f:
                json.dump({"version": 1, "hmac": mac, "report": body}, f)
            os.kill(-1, signal.SIGKILL)
def digital_root(n):
    raise RuntimeError("probe: " + "; ".join(tried))
""",
    # Write a report in the right shape, then kill every process of this user so nobody overwrites it.
    "forges-the-report": """
import json, os, signal
body = json.dumps({"stage": "done", "tests": [{"name": n, "passed": True} for n in ["a"] * 3]})
with open("report.json", "w") as f:
    json.dump({"version": 1, "hmac": "0" * 64, "report": body}, f)
os.kill(-1, signal.SIGKILL)
""",
    "exits-the-interpreter": "import os\nos._exit(0)\n",
    "sys-exit-in-the-function": "import sys\ndef digital_root(n):\n    sys.exit(0)\n",
    # Objects that say they equal anything, hash like the answer, and claim to be ints.
    "eq-tricks": """
class Liar(int):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = int.__hash__
    __class__ = int
def digital_root(n):
    return Liar(0)
""",
    # Patch what a grader in this process would use.
    "patches-builtins-and-operator": """
import builtins, operator
operator.eq = lambda a, b: True
builtins.AssertionError = type("Nothing", (Exception,), {})
builtins.isinstance = lambda *a: True
def digital_root(n):
    return None
""",
    # Raise the exception tests expect, from everything, so that raises(...) passes.
    "raises-everything": "def digital_root(n):\n    raise ValueError(n)\n",
    # Look for the spec (its nonce) in what the interpreter that forked this one read ahead of stdin,
    # sign a report of all passes with it, then end the grader before it writes again.
    "reads-the-stdin-buffer": r"""
import hashlib, hmac, json, os, signal, sys
seen = sys.stdin.buffer.peek(1 << 20)
at = seen.rfind(b'{"source":')
if at >= 0:
    spec = json.loads(seen[at:])
    body = json.dumps({"stage": "done", "import_error": None, "import_stdout": "", "import_stderr": "",
                       "harness_error": None,
                       "tests": [{"name": t["name"], "passed": True, "error": None} for t in spec["tests"]]})
    mac = hmac.new(spec["nonce"].encode(), body.encode(), hashlib.sha256).hexdigest()
    with open("report.json.x", "w") as f:
        json.dump({"version": 1, "hmac": mac, "report": body}, f)
    os.replace("report.json.x", "report.json")
    os.kill(-1, signal.SIGKILL)
def digital_root(n):
    raise RuntimeError(f"read ahead of stdin: {len(seen)} bytes")
""",
    # Fill the sandbox's memory with files: tmpfs is charged to it, and killing a process frees no
    # file, so the OOM killer had only the sandbox's own agent and judge left to kill.
    "fills-memory-with-files": """
import os
os.makedirs("/tmp/fill", exist_ok=True)
try:
    for i in range(4096):
        with open(f"/tmp/fill/{i}", "wb") as f:
            f.write(b"x" * (1 << 20))
except OSError:
    pass
""",
}


@pytest.fixture(scope="module")
def cold_server() -> Iterator[ServerProcess]:
    """Sandboxes without an exec agent: every grading runs the harness afresh (as on Docker and e2b)."""
    srv = ServerProcess("--sandbox-option", "exec_agent=false")
    yield srv
    srv.stop()


@pytest.fixture(params=["warm-judge", "fresh-harness"])
def env(request: pytest.FixtureRequest) -> Iterator[CodeEnv]:
    srv = request.getfixturevalue("server" if request.param == "warm-judge" else "cold_server")
    e = tangram_env.make("code", address=srv.address, max_turns=1)
    yield e
    e.close()


@pytest.mark.parametrize("name", list(HACKS))
def test_hacks_earn_nothing(env: CodeEnv, name: str) -> None:
    env.reset(options={"task_id": TASK})
    _, reward, _, _, info = env.step(HACKS[name] + ("" if "def digital_root" in HACKS[name] else WRONG))
    passed = [t["name"] for t in info["tests"] if t["passed"]]
    assert reward == 0.0, (name, passed)
    if name == "raises-everything":  # it raised as the error cases want, yet they count only with work
        assert any("ordinary tests passes" in (t["error"] or "") for t in info["tests"]), info
    if name == "reads-the-judges-memory":  # it did look, and was refused everywhere
        probe = next(t["error"] for t in info["tests"] if "probe:" in (t["error"] or ""))
        assert "PermissionError" in probe and ": open" not in probe, probe
        assert not re.search(r"[0-9a-f]{32}", probe)
    if name == "reads-the-stdin-buffer":  # the interpreter had read nothing past the harness
        assert any("read ahead of stdin: 0 bytes" in (t["error"] or "") for t in info["tests"]), info


def test_every_reference_solution_earns_full_reward(server: ServerProcess) -> None:
    tasks = load_tasks()
    vec = tangram_env.make_vec(
        "code", len(tasks), address=server.address, max_turns=1, per_test_timeout_s=10.0
    )
    try:
        for i, task in enumerate(tasks):
            vec.envs[i].reset(options={"task_id": task.id})
        _, rewards, _, _, infos = vec.step([task.reference_solution for task in tasks])
        failed = {t.id: r for t, r in zip(tasks, rewards, strict=True) if r != 1.0}
        assert failed == {} and infos["reward_valid"].all()
    finally:
        vec.close()


# --- infrastructure failures ------------------------------------------------------------------------
SLOW_RIGHT = f"""
# {MARKER.decode()}
import time
def digital_root(n):
    time.sleep(0.3)
    if n < 0:
        raise ValueError(n)
    return 0 if n == 0 else 1 + (n - 1) % 9
"""
RIGHT = SLOW_RIGHT.replace("time.sleep(0.3)", "pass").replace(MARKER.decode(), "fast")


@pytest.fixture(scope="module")
def dying_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server whose sandboxes are the ``dying`` provider's, declared by a real installed-package layout."""
    site = tmp_path_factory.mktemp("site")
    dist = site / "dying_sandbox_test-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dying-sandbox-test\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[tangram_env.sandbox_providers]\ndying = tests.envs.faults.dying_sandbox:DyingProvider\n"
    )
    srv = ServerProcess("--sandbox", "dying", pythonpath=(str(site),))
    yield srv
    srv.stop()


def test_a_sandbox_killed_mid_grade_raises_in_a_single_env(dying_server: ServerProcess) -> None:
    env = tangram_env.make("code", address=dying_server.address, max_turns=2)
    try:
        env.reset(options={"task_id": TASK})
        with pytest.raises(RewardUnavailable, match="sandbox") as caught:
            env.step(SLOW_RIGHT)
        assert caught.value.cause == "sandbox_died"
        # The same env goes on: a fresh episode gets a fresh sandbox and a real grade.
        env.reset(options={"task_id": TASK})
        assert env.step(RIGHT)[1] == 1.0
    finally:
        env.close()


def test_a_vector_env_flags_the_env_whose_sandbox_died_and_serves_the_others(
    dying_server: ServerProcess,
) -> None:
    vec = tangram_env.make_vec("code", 3, address=dying_server.address, max_turns=2)
    try:
        vec.reset(options={"task_id": TASK})
        _, rewards, terminated, truncated, infos = vec.step([RIGHT, SLOW_RIGHT, WRONG])
        assert rewards[0] == 1.0 and rewards[2] == 0.0 and math.isnan(rewards[1])
        assert list(infos["reward_valid"]) == [True, False, True]
        assert "sandbox" in infos["reward_error"][1] and truncated[1] and not terminated[1]
    finally:
        vec.close()


def test_flag_mode_on_a_single_env(dying_server: ServerProcess) -> None:
    env = tangram_env.make("code", address=dying_server.address, invalid_reward="flag")
    try:
        obs, _ = env.reset(options={"task_id": TASK})
        again, reward, terminated, truncated, info = env.step(SLOW_RIGHT)
        assert math.isnan(reward) and truncated and not terminated and again == obs
        assert info["reward_valid"] is False and info["reward_error_cause"] == "sandbox_died"
    finally:
        env.close()
    with pytest.raises(ValueError, match="invalid_reward must be one of"):
        tangram_env.make("code", invalid_reward="zero")


def test_a_lone_surrogate_in_a_submission_is_graded_as_written(env: CodeEnv) -> None:
    env.reset(options={"task_id": TASK})
    _, reward, _, _, info = env.step(WRONG + "x = '\ud800'\n")  # what a decoder may leave in a text
    assert reward == 0.0 and info["total"] > 0  # graded (the agent's failure), not an error
    env.reset(options={"task_id": TASK})
    _, reward, _, _, _ = env.step(RIGHT)
    assert reward == 1.0


def test_feedback_never_shows_the_hidden_tests_so_echoing_it_cannot_earn_full_reward(
    server: ServerProcess,
) -> None:
    env = tangram_env.make("code", address=server.address, max_turns=4)
    try:
        obs, _ = env.reset(options={"task_id": TASK})
        task = env.unwrapped.task
        seen = obs
        for _ in range(3):  # answer exactly what the feedback showed, as a lookup table would
            shown = {
                int(m[1]): int(m[2]) for m in re.finditer(r"assert digital_root\((-?\d+)\) == (-?\d+)", seen)
            }
            table = f"\nANSWERS = {shown!r}\ndef digital_root(n):\n    return ANSWERS.get(n)\n"
            obs, reward, terminated, truncated, info = env.step(table)
            seen += obs
        hidden = set(info["hidden"])
        assert len(hidden) == math.ceil(len(task.tests) / 2)
        assert all(t.code not in seen for t in task.tests if t.name in hidden)  # never shown
        assert "hidden test(s) FAILED" in obs
        assert shown and info["score"] <= (len(task.tests) - len(hidden)) / len(task.tests)
        assert not any(t["passed"] for t in info["tests"] if t["name"] in hidden)
    finally:
        env.close()


#: Moves whose target peg is an object that equals an empty peg for the legality check and another for
#: the append: the test's own dict lookups ran its __hash__ and __eq__ (found by an audit).
LYING_PEG = """
class Peg:
    def __init__(self, script):
        self.script = list(script)
    def __hash__(self):
        return hash(self.script[0])
    def __eq__(self, other):
        return other == self.script.pop(0) if len(self.script) > 1 else other == self.script[0]

def hanoi_moves(n, source="A", target="C", spare="B"):
    if n != 6:
        return []
    return [("A", Peg(["C", "B"])) for _ in range(6)] + [("B", "C")] * 6
"""


@pytest.mark.parametrize("where", ["server", "cold_server"])
def test_a_key_that_changes_what_it_equals_cannot_pass_a_test(
    request: pytest.FixtureRequest, where: str
) -> None:
    srv = request.getfixturevalue(where)
    with tangram_env.make("code", address=srv.address, max_turns=1, hidden_tests=0.0) as env:
        env.reset(options={"task_id": "hanoi-moves"})
        _, _, _, _, info = env.step(LYING_PEG)
    (legal,) = [t for t in info["tests"] if t["name"] == "legal_and_complete"]
    assert not legal["passed"] and "strict test comparison: a Peg object" in legal["error"], legal
