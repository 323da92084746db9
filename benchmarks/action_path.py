"""The action path: what a short action costs through Tangram against the naive tools it replaces.

    python -m benchmarks.action_path [--json] [--rounds 60] [--code-rounds 4] [--per-client 5000]

Everything is measured side by side in one run, against one real ``tangram-server`` (local sandboxes,
the shipped plugins), the two sides of each figure interleaved so that load on a shared machine
weighs on both alike:

- ``bash_echo_ms_p50`` / ``plain_echo_ms_p50``: ``echo hi`` as a ``bash`` tool call in a warm sandbox
  session against ``bash -c 'echo hi'`` in a plain subprocess. Floor: at most plain + 3 ms.
- ``bash_python_ratio``: ``python3 -c pass`` the same two ways; the plain side runs a fresh, empty
  virtual environment of the same Python (:func:`benchmarks.common.fresh_python`: no import hooks,
  the fastest plain start-up there is). Floor: at most 1.5.
- ``code_env_vs_gym_ratio``: graded solutions per second of ``make_vec("code", 8)`` stepping every env
  with its task's reference solution, against gymnasium's ``AsyncVectorEnv`` of 8 envs that run the
  same harness in a plain subprocess (:class:`PlainHarnessEnv`, below). Floor: at least 1.3. Beside
  it, ``code_grading_wall_ms_p50`` / ``code_grading_cpu_ms_p50``: one grading's wall and CPU time in
  its sandbox (what the tool's declared demand of a core should match).
- ``noop_8_clients_vs_raw``: no-op actions per second from 8 client processes (batches of 500)
  against messages per second that 8 processes echo through a raw ZeroMQ ROUTER one at a time (each
  waits for its echo: the peer of the issue's 28k/s). Floor: at least 0.5. Beside it,
  ``noop_8_clients_vs_raw_pipelined`` holds the raw side to 500 messages in flight per client, as
  the no-op side has: the bare socket's ceiling, far above any request/response service.

``breakdown`` splits a short sandboxed action into the steps of its path, each measured on its own
in the same run: the round trip of a no-op (client, wire, orchestrator), an action in a forked child
with no sandbox (``sleep`` of 0 s), ``sandbox.exec`` of ``true`` straight on the local provider
(through the sandbox's exec agent, and with a fresh bubblewrap per command as before the agent), and
a plain ``true``. ``load_before``/``load_after`` are the machine's load averages.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any

import gymnasium
import zmq

from benchmarks.common import fresh_python, percentile, print_table, start_server
from benchmarks.overhead import _RawPeer, noop_throughput

#: Per-test limit on both sides: generous, so that a loaded machine does not fail a right answer.
PER_TEST_TIMEOUT_S = 10.0
FLOORS = {
    "bash_echo_over_plain_ms_max": 3.0,
    "bash_python_ratio_max": 1.5,
    "code_env_vs_gym_ratio_min": 1.3,
    "noop_8_clients_vs_raw_min": 0.5,
}


def _ms(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _plain(command: str, path: str) -> Callable[[], None]:
    env = {"PATH": path, "LANG": "C.UTF-8"}

    def run() -> None:
        done = subprocess.run(["bash", "-c", command], capture_output=True, env=env, check=False)
        assert done.returncode == 0, done

    return run


def tool_calls(address: str, rounds: int, plain_python: str) -> dict[str, list[float]]:
    """``echo hi`` and ``python3 -c pass`` as tool calls in one warm session, and plainly (ms)."""
    from tangram_env import Client

    plain_path = f"{os.path.dirname(plain_python)}:/usr/bin:/bin"
    out: dict[str, list[float]] = {"bash_echo": [], "plain_echo": [], "bash_python": [], "plain_python": []}
    with Client(address) as client, client.sandbox() as box:

        def call(command: str) -> Callable[[], None]:
            def run() -> None:
                result = box.bash(command)
                assert result.ok, result

            return run

        pairs = {
            "echo": (call("echo hi"), _plain("echo hi", plain_path)),
            "python": (call("python3 -c pass"), _plain("python3 -c pass", plain_path)),
        }
        for _ in range(5):  # warm-up: the session's sandbox, page cache, the scheduler's estimates
            for tangram, plain in pairs.values():
                tangram()
                plain()
        for i in range(rounds):
            for name, (tangram, plain) in pairs.items():
                first, second = (tangram, plain) if i % 2 == 0 else (plain, tangram)
                a, b = _ms(first), _ms(second)
                t, p = (a, b) if i % 2 == 0 else (b, a)
                out[f"bash_{name}"].append(t)
                out[f"plain_{name}"].append(p)
    return out


def breakdown(address: str, rounds: int) -> dict[str, float]:
    """p50 (ms) of each step of a short sandboxed action's path, measured on its own."""
    from tangram_env import Client
    from tangram_env.sandbox import SandboxSpec
    from tangram_env.server.sandbox.local import LocalProvider

    times: dict[str, list[float]] = {
        "noop": [],
        "forked": [],
        "sandbox_exec": [],
        "sandbox_exec_bwrap_per_command": [],
        "plain_true": [],
    }
    provider = LocalProvider()
    box = provider.create(SandboxSpec(mem_mb=512, max_pids=128))
    # The path before the exec agent: a fresh bubblewrap per command, in the same run.
    per_command = LocalProvider(exec_agent=False)
    old_box = per_command.create(SandboxSpec(mem_mb=512, max_pids=128))
    cores = (sorted(os.sched_getaffinity(0))[0],)
    try:
        with Client(address) as client:
            steps: dict[str, Callable[[], Any]] = {
                "noop": lambda: client.call("noop"),
                "forked": lambda: client.call("sleep", {"seconds": 0}),
                "sandbox_exec": lambda: box.exec(["true"], cores=cores),
                "sandbox_exec_bwrap_per_command": lambda: old_box.exec(["true"], cores=cores),
                "plain_true": lambda: subprocess.run(["true"], check=True),
            }
            for step in steps.values():
                step()
            for _ in range(rounds):
                for name, step in steps.items():
                    times[name].append(_ms(step))
    finally:
        box.close()
        provider.close()
        old_box.close()
        per_command.close()
    return {name: round(percentile(values, 0.5), 3) for name, values in times.items()}


# --- the code env against gymnasium's AsyncVectorEnv --------------------------------------------------
class PlainHarnessEnv(gymnasium.Env[int, str]):
    """The ``code`` env's task and grading without Tangram: the same harness in a plain subprocess.

    Its observation is the task's index (the prompt's text plays no part in what is measured).
    """

    def __init__(self) -> None:
        from tangram_env.envs.code_tasks import load_tasks

        self.tasks = load_tasks()
        self.index = 0
        self.task = self.tasks[0]
        self.observation_space = gymnasium.spaces.Discrete(len(self.tasks))
        self.action_space = gymnasium.spaces.Text(max_length=100_000)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[int, dict[str, Any]]:
        """A task drawn with the env's generator."""
        super().reset(seed=seed)
        self.index = int(self.np_random.integers(len(self.tasks)))
        self.task = self.tasks[self.index]
        return self.index, {"task_id": self.task.id}

    def step(self, action: str) -> tuple[int, float, bool, bool, dict[str, Any]]:
        """Grade ``action`` (a solution's source) with the harness in a plain subprocess."""
        from tangram_env.envs.code_tasks import HarnessSpec
        from tangram_env.envs.code_tasks.local import run_unsandboxed

        report = run_unsandboxed(HarnessSpec.for_task(self.task, action, timeout_s=PER_TEST_TIMEOUT_S))
        reward = report.passed / max(1, report.total)
        return self.index, reward, report.passed == report.total, False, {"task_id": self.task.id}


def _graded_per_s(
    venv: Any, rounds: int, seed: int, misgraded: list[float], execs: list[tuple[float, float]] | None = None
) -> float:
    """Rounds of reset then one step of every env with its task's reference solution; solutions/s.

    A right answer that did not get full marks (a test past its limit on a loaded machine) goes to
    ``misgraded``; each grading's ``(wall_s, cpu_s)`` in its sandbox to ``execs`` (Tangram's side).
    """
    from tangram_env.envs.code_tasks import get_task

    graded = 0
    t0 = time.perf_counter()
    for r in range(rounds):
        _, infos = venv.reset(seed=seed + r)
        answers = [get_task(str(t)).reference_solution for t in infos["task_id"]]
        _, rewards, _, _, info = venv.step(answers)
        misgraded += [float(x) for x in rewards if x != 1.0]
        if execs is not None:
            execs += zip(map(float, info["wall_s"]), map(float, info["cpu_s"]), strict=True)
        graded += len(answers)
    return graded / (time.perf_counter() - t0)


def code_vs_gym(address: str, rounds: int, envs: int = 8) -> dict[str, Any]:
    """Tangram's graded solutions/s and AsyncVectorEnv's, in alternating blocks."""
    import tangram_env

    tangram = tangram_env.make_vec(
        "code", num_envs=envs, address=address, per_test_timeout_s=PER_TEST_TIMEOUT_S
    )
    gym = gymnasium.vector.AsyncVectorEnv([PlainHarnessEnv for _ in range(envs)])
    ours: list[float] = []
    theirs: list[float] = []
    misgraded: dict[str, list[float]] = {"tangram": [], "gym": []}
    execs: list[tuple[float, float]] = []
    try:
        _graded_per_s(tangram, 1, 10_000, [])  # warm-up: sandboxes, page cache
        _graded_per_s(gym, 1, 10_000, [])
        for block in range(2):
            seed = 100 * block
            ours.append(_graded_per_s(tangram, rounds, seed, misgraded["tangram"], execs))
            theirs.append(_graded_per_s(gym, rounds, seed, misgraded["gym"]))
    finally:
        tangram.close()
        gym.close()
    return {
        "tangram": sum(ours) / len(ours),
        "gym": sum(theirs) / len(theirs),
        "misgraded": {side: len(values) for side, values in misgraded.items()},
        "exec_wall_ms_p50": round(1e3 * percentile([w for w, _ in execs], 0.5), 1) if execs else None,
        "exec_cpu_ms_p50": round(1e3 * percentile([c for _, c in execs], 0.5), 1) if execs else None,
    }


# --- throughput with 8 clients ------------------------------------------------------------------------
def _raw_client(port: int, n: int, window: int, start: Any, out: Any) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    start.wait()
    t0 = time.perf_counter()
    for first in range(0, n, window):
        count = min(window, n - first)
        for _ in range(count):
            sock.send(b"x" * 64)
        for _ in range(count):
            sock.recv()
    out.put((n, time.perf_counter() - t0))
    sock.close(linger=0)


def raw_throughput(clients: int, per_client: int, window: int = 500) -> float:
    """Messages per second that ``clients`` processes echo through one raw ZeroMQ ROUTER."""
    peer = _RawPeer()
    port = int(peer.sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
    start, out = mp.Event(), mp.Queue()
    procs = [
        mp.Process(target=_raw_client, args=(port, per_client, window, start, out)) for _ in range(clients)
    ]
    for p in procs:
        p.start()
    time.sleep(1.0)
    t0 = time.perf_counter()
    start.set()
    done = [out.get(timeout=300) for _ in procs]
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join(10)
    peer.close()
    return sum(n for n, _ in done) / elapsed


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print its table and JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.add_argument("--rounds", type=int, default=60, help="tool calls of each kind (default 60)")
    p.add_argument("--code-rounds", type=int, default=4, help="rounds of 8 gradings per block (default 4)")
    p.add_argument("--per-client", type=int, default=5000, help="no-ops per client (default 5,000)")
    p.add_argument("--skip-code", action="store_true", help="leave out the code env comparison")
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    with start_server() as server, fresh_python() as plain_python:
        calls = tool_calls(server.address, args.rounds, plain_python)
        steps = breakdown(server.address, args.rounds)
        code = (
            {"tangram": 0.0, "gym": 0.0, "misgraded": {}, "exec_wall_ms_p50": None, "exec_cpu_ms_p50": None}
            if args.skip_code
            else code_vs_gym(server.address, args.code_rounds)
        )
        noop = noop_throughput(server.address, 8, args.per_client)
    raw = raw_throughput(8, args.per_client // 5, window=1)
    raw_pipelined = raw_throughput(8, args.per_client)
    p50 = {name: percentile(values, 0.5) for name, values in calls.items()}
    figures: dict[str, Any] = {
        "bash_echo_ms_p50": round(p50["bash_echo"], 3),
        "plain_echo_ms_p50": round(p50["plain_echo"], 3),
        "bash_echo_over_plain_ms": round(p50["bash_echo"] - p50["plain_echo"], 3),
        "bash_python_ms_p50": round(p50["bash_python"], 3),
        "plain_python_ms_p50": round(p50["plain_python"], 3),
        "bash_python_ratio": round(p50["bash_python"] / p50["plain_python"], 3),
        "code_graded_per_s": round(code["tangram"], 2),
        "gym_graded_per_s": round(code["gym"], 2),
        "code_env_vs_gym_ratio": round(code["tangram"] / code["gym"], 3) if code["gym"] else None,
        "code_misgraded": code["misgraded"],
        "code_grading_wall_ms_p50": code["exec_wall_ms_p50"],
        "code_grading_cpu_ms_p50": code["exec_cpu_ms_p50"],
        "noop_8_clients_per_s": round(noop),
        "raw_8_clients_per_s": round(raw),
        "noop_8_clients_vs_raw": round(noop / raw, 3),
        "raw_8_clients_pipelined_per_s": round(raw_pipelined),
        "noop_8_clients_vs_raw_pipelined": round(noop / raw_pipelined, 3),
        "breakdown_ms_p50": steps,
        "floors": FLOORS,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }
    if not args.json:
        print_table(
            "The action path (p50, ms; rates per second)",
            [
                ("echo hi: bash tool call in a warm session", figures["bash_echo_ms_p50"]),
                ("echo hi: plain subprocess", figures["plain_echo_ms_p50"]),
                ("python3 -c pass: bash tool call", figures["bash_python_ms_p50"]),
                ("python3 -c pass: plain subprocess", figures["plain_python_ms_p50"]),
                ("python ratio (tool call / plain)", figures["bash_python_ratio"]),
                ("code env, 8 envs: graded/s", figures["code_graded_per_s"]),
                ("AsyncVectorEnv, same harness: graded/s", figures["gym_graded_per_s"]),
                (
                    "code env: one grading's wall / CPU in its sandbox (ms)",
                    f"{figures['code_grading_wall_ms_p50']} / {figures['code_grading_cpu_ms_p50']}",
                ),
                ("no-ops/s, 8 clients", float(figures["noop_8_clients_per_s"])),
                ("raw ZeroMQ echoes/s, 8 clients, one at a time", float(figures["raw_8_clients_per_s"])),
                ("raw ZeroMQ echoes/s, 8 clients, 500 each", float(figures["raw_8_clients_pipelined_per_s"])),
                *((f"path: {name}", value) for name, value in steps.items()),
                ("load average before / after", f"{figures['load_before']} / {figures['load_after']}"),
            ],
        )
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
