"""Failure semantics with real processes: deadlines, backpressure, crashes of server and clients."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tangram_env import Action, Client, launch, wire
from tangram_env.aio import AsyncClient
from tangram_env.errors import ActionError
from tangram_env.protocol import PROTOCOL_VERSION, Error
from tests.conftest import ROOT, ServerProcess, wait_for


def test_deadline_fails_fast_instead_of_starting(tmp_path: Path) -> None:
    srv = ServerProcess("--cpus", "0.1")  # room for one sleep at a time
    try:
        with Client(srv.address) as client:
            blocker = client.submit([Action(kind="sleep", payload={"seconds": 2})])[0]
            t0 = time.monotonic()
            late = client.run("sleep", {"seconds": 0.1}, deadline_s=0.5)
            assert late.error_type == "deadline" and "deadline of 0.5s" in late.message
            assert time.monotonic() - t0 < 1.9  # it did not wait for the blocker to finish
            assert late.timing.queued_s >= 0.4
            assert blocker.result(10).ok
    finally:
        srv.stop()


def test_backpressure_defers_and_everything_completes() -> None:
    srv = ServerProcess("--max-queued-per-client", "5")
    try:
        with Client(srv.address) as client:
            futures = client.submit([Action(kind="sleep", payload={"seconds": 0.01}) for _ in range(60)])
            assert all(f.result(60).ok for f in futures)
            assert client.stats()["errors"].get("busy", 0) > 0  # the server did push back
    finally:
        srv.stop()


def test_a_client_that_leaks_sessions_is_refused_more_and_others_go_on() -> None:
    # A rollout loop that never closes its envs would hold a sandbox per episode until session_idle_s.
    srv = ServerProcess("--max-sessions-per-client", "2", "--sandbox", "none")
    try:
        with Client(srv.address) as leaky, Client(srv.address) as other:
            for session in ("e1", "e2"):
                assert leaky.run("bash", {"command": "true"}, affinity=session).ok
            refused = leaky.run("bash", {"command": "true"}, affinity="e3")
            assert refused.error_type == "rejected" and refused.message.startswith("session_limit: ")
            assert other.run("bash", {"command": "true"}, affinity="e3").ok  # another client's is fine
            leaky.close_sessions(["e1"])
            assert leaky.run("bash", {"command": "true"}, affinity="e4").ok
    finally:
        srv.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_on(port: int, db: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tangram_env.server",
            "--bind",
            f"tcp://127.0.0.1:{port}",
            "--plugin",
            "tests.plugins",
            "--state-db",
            str(db),
            "--log-level",
            "WARNING",
            "--cpus",
            "2",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )


def test_with_its_file_descriptors_gone_the_server_fails_what_it_cannot_start_and_lives() -> None:
    # os.pipe() raising EMFILE in the executor used to end the loop: every client lost its server.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))  # a common default, 1,024, is low
    try:
        srv = ServerProcess("--sandbox", "none")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    conns: list[socket.socket] = []
    try:
        assert resource.prlimit(srv.pid, resource.RLIMIT_NOFILE)[0] > 256  # it raised its own
        with Client(srv.address) as client:
            assert client.run("sleep", {"seconds": 0}).ok
            held = len(os.listdir(f"/proc/{srv.pid}/fd"))
            limit = held + 16
            resource.prlimit(srv.pid, resource.RLIMIT_NOFILE, (limit, limit))
            port = int(srv.address.rsplit(":", 1)[1])
            for _ in range(limit):  # idle connections, each a descriptor of the server's
                conns.append(socket.create_connection(("127.0.0.1", port)))
            wait_for(
                lambda: len(os.listdir(f"/proc/{srv.pid}/fd")) >= limit, 10, "the descriptors to run out"
            )
            failed = client.run("sleep", {"seconds": 0}, timeout=30)
            assert not failed.ok and failed.error_type == "error", failed
            assert "could not start it" in failed.message and "Too many open files" in failed.message
            for conn in conns:
                conn.close()
            conns.clear()
            again = wait_for(
                lambda: (r := client.run("sleep", {"seconds": 0}, timeout=30)).ok and r, 20, "a start"
            )
            assert again.ok and srv.process.poll() is None
    finally:
        for conn in conns:
            conn.close()
        srv.stop()


def test_after_a_server_restart_a_session_fails_instead_of_going_on_in_an_empty_sandbox() -> None:
    # The client resubmitted its session's next command, which ran in a fresh sandbox of the new
    # orchestrator: the agent's files were gone, and the command's result said nothing of it.
    first = launch.ServerProcess("--sandbox", "none", "--no-gpu-worker")
    second = None
    try:
        with Client(first.address) as client:
            with client.sandbox() as box:
                assert box.bash("echo work > progress.txt").exit_code == 0
                first.stop()
                second = launch.ServerProcess("--sandbox", "none", "--no-gpu-worker", bind=first.address)
                with pytest.raises(ActionError) as lost:  # at once: before or after it hears the new server
                    box.bash("cat progress.txt")
                assert lost.value.error_type == "sandbox_died" and "restarted" in str(lost.value)
                with pytest.raises(ActionError):
                    box.bash("true")  # and so on until the session is closed
            with client.sandbox() as fresh:  # a new session works
                assert fresh.bash("echo again").stdout == "again\n"
    finally:
        for srv in (first, second):
            if srv is not None:
                srv.stop()


def test_an_async_twin_resubmits_its_actions_when_the_server_restarts() -> None:
    # A twin made from a sync client learned the server's id only from its own heartbeats: one that
    # ran only short actions took the restarted server's id as the first, resubmitted nothing, and
    # its action waited forever (the new server's heartbeats kept it from timing out).
    first = launch.ServerProcess("--sandbox", "none", "--no-gpu-worker")
    second = None
    try:
        with Client(first.address, server_timeout_s=5) as client:
            twin = AsyncClient.wrap(client)

            async def main() -> Any:
                assert (await twin.call("echo", {"value": 1})) == 1
                slow = asyncio.ensure_future(twin.run("sleep", {"seconds": 1}))
                await asyncio.sleep(0.3)
                nonlocal second
                first.stop()
                second = launch.ServerProcess("--sandbox", "none", "--no-gpu-worker", bind=first.address)
                return await asyncio.wait_for(slow, 20)

            assert asyncio.run(main()).ok
    finally:
        for srv in (first, second):
            if srv is not None:
                srv.stop()


@pytest.mark.parametrize("provider", ["none", "local"])
def test_a_session_closed_while_its_command_runs_is_reset_only_after_it(provider: str) -> None:
    # The reset ran under the command: killed (yet ok, exit -9) or run against a wiped workspace.
    srv = ServerProcess("--sandbox", provider)
    try:
        with Client(srv.address) as client:
            box = client.sandbox()
            box.bash("echo mine > work.txt")
            (running,) = client.submit(
                [Action(kind="bash", payload={"command": "sleep 1; cat work.txt"}, affinity=box.session_id)]
            )
            time.sleep(0.4)
            client.close_sessions([box.session_id])
            result = running.result(30)
            assert result.ok and result.value["exit_code"] == 0 and result.value["stdout"] == "mine\n", result
            images = lambda: client.stats()["sandbox_images"]  # noqa: E731
            wait_for(lambda: images()["default"]["live"] == 0, 10, "the session to end after its command")
    finally:
        srv.stop()


def test_kill_9_the_server_mid_run_every_action_gets_one_result_none_runs_twice(tmp_path: Path) -> None:
    port, db = _free_port(), tmp_path / "state.sqlite"
    proc = _start_on(port, db)
    address = f"tcp://127.0.0.1:{port}"
    clients = [Client(address, connect_timeout_s=30, server_timeout_s=60) for _ in range(4)]
    per_client = 500
    futures = []
    for c, client in enumerate(clients):
        actions = [
            Action(
                id=f"c{c}-a{i}",
                kind="test.touch",
                payload={"path": str(tmp_path / f"client{c}.log"), "line": f"c{c}-a{i}"},
            )
            for i in range(per_client)
        ]
        futures.append((client, actions, client.submit(actions)))
    # Let part of the work finish, then kill the orchestrator without warning and start it again.
    deadline = time.monotonic() + 60
    while sum(f.done() for _, _, fs in futures for f in fs) < 300 and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc = _start_on(port, db)
    try:
        counts = collections.Counter()
        for c in range(4):
            log = tmp_path / f"client{c}.log"
            counts.update(log.read_text().split() if log.exists() else [])
        outcomes = collections.Counter()
        for _client, actions, fs in futures:
            for action, fut in zip(actions, fs, strict=True):
                result = fut.result(120)  # every action gets its result
                assert result.action_id == action.id
                outcomes["ok" if result.ok else "lost"] += 1
                if result.ok:
                    assert result.value == action.id
        counts = collections.Counter()
        for c in range(4):
            counts.update((tmp_path / f"client{c}.log").read_text().split())
        assert max(counts.values()) == 1, [k for k, v in counts.items() if v > 1][:5]  # none ran twice
        assert outcomes["ok"] + outcomes["lost"] == 4 * per_client
        # Every action that reported success did its work exactly once; lost ones at most once.
        for _, actions, fs in futures:
            for action, fut in zip(actions, fs, strict=True):
                if fut.result().ok:
                    assert counts[action.id] == 1
        assert outcomes["ok"] >= 4 * per_client - 50, outcomes  # only those running at the crash are lost
    finally:
        for client in clients:
            client.close()
        proc.terminate()
        proc.wait(15)


class _CuttableProxy:
    """A TCP proxy to the orchestrator whose connections can be cut, as a network fault does: both
    ends see a reset, and for ``pause_s`` after a cut new connections are refused while ZeroMQ retries.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.refuse_until = 0.0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            if time.monotonic() < self.refuse_until:
                down.close()
                continue
            up = socket.create_connection(("127.0.0.1", self.target_port))
            with self.lock:
                self.pairs.append((down, up))
            for src, dst in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass

    def cut(self, pause_s: float) -> None:
        self.refuse_until = time.monotonic() + pause_s
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for pair in pairs:
            for sock in pair:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def close(self) -> None:
        self.listener.close()
        self.cut(0.0)


def test_a_connection_cut_mid_run_loses_no_action_and_runs_none_twice(tmp_path: Path) -> None:
    # ZeroMQ reconnects a broken connection by itself, and what was in flight is gone: results the
    # orchestrator sent meanwhile, submissions the client sent. The orchestrator, the same one, went
    # on answering heartbeats, so nothing failed: those actions' futures waited forever.
    srv = ServerProcess("--cpus", "1")
    proxy = _CuttableProxy(int(srv.address.rsplit(":", 1)[1]))
    log = tmp_path / "ran.log"
    try:
        with Client(f"tcp://127.0.0.1:{proxy.port}", server_timeout_s=60) as client:
            actions = [
                Action(id=f"cut-{i}", kind="test.touch", payload={"path": str(log), "line": f"cut-{i}"})
                for i in range(600)
            ]
            futures = []
            for start in range(0, len(actions), 50):  # submissions in flight at the cuts, too
                futures += client.submit(actions[start : start + 50])
                if start in (100, 300, 500):
                    proxy.cut(0.3)
                time.sleep(0.02)
            results = [f.result(60) for f in futures]
            assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
        counts = collections.Counter(log.read_text().split())
        assert set(counts) == {a.id for a in actions} and max(counts.values()) == 1
    finally:
        proxy.close()
        srv.stop()


def test_a_crashed_client_has_its_queue_cancelled(tmp_path: Path) -> None:
    srv_env = {"TANGRAM_SERVER_CLIENT_TIMEOUT_S": "2s"}
    os.environ.update(srv_env)
    try:
        srv = ServerProcess("--cpus", "0.1")
    finally:
        for k in srv_env:
            os.environ.pop(k)
    script = (
        "import sys, time\nfrom tangram_env import Client, Action\n"
        f"c = Client({srv.address!r})\n"
        "c.submit([Action(kind='sleep', payload={'seconds': 0.5}) for _ in range(20)])\n"
        "c.ping(); print('submitted', flush=True); time.sleep(60)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"submitted"
        child.kill()
        child.wait()
        with Client(srv.address) as observer:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and observer.stats()["errors"].get("cancelled", 0) == 0:
                time.sleep(0.2)
            stats = observer.stats()
            assert stats["errors"].get("cancelled", 0) >= 10  # not 20 sleeps x 0.5 s run for nobody
            assert stats["pending"] == 0
    finally:
        srv.stop()


def test_load_32_clients_x_2000_noops_all_results_exactly_once(server: ServerProcess) -> None:
    per_client, n_clients = 2000, 32
    received: list[collections.Counter[str]] = [collections.Counter() for _ in range(n_clients)]
    latencies: list[float] = []
    errors: list[BaseException] = []

    def run(c: int) -> None:
        try:
            with Client(server.address) as client:
                for start in range(0, per_client, 200):
                    batch = [Action(id=f"load-{c}-{i}", kind="noop") for i in range(start, start + 200)]
                    t0 = time.perf_counter()
                    for action, fut in zip(batch, client.submit(batch), strict=True):
                        res = fut.result(60)
                        assert res.ok and res.action_id == action.id
                        received[c][res.action_id] += 1
                    latencies.append(time.perf_counter() - t0)
        except BaseException as exc:
            errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(c,)) for c in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    elapsed = time.perf_counter() - t0
    assert not errors, errors[:3]
    assert all(len(r) == per_client and set(r.values()) == {1} for r in received)
    latencies.sort()
    print(
        f"\n32x2000 no-ops: {n_clients * per_client / elapsed:.0f} actions/s, "
        f"p99 batch-of-200 round trip {latencies[int(0.99 * len(latencies))] * 1000:.1f} ms"
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    frames=st.lists(st.binary(max_size=40), min_size=1, max_size=4),
    mutate=st.sampled_from(["raw", "versioned", "typed"]),
)
def test_fuzzed_frames_always_get_an_error(
    raw_socket: zmq.Socket[bytes], frames: list[bytes], mutate: str
) -> None:
    if mutate == "versioned":
        frames = [bytes([PROTOCOL_VERSION]) + b"".join(frames[:2])]
    elif mutate == "typed":
        frames = [wire.frame(b"submit", frames[0])]
    try:
        msg = wire.decode_frames(frames)
    except Exception:
        msg = None
    if msg is not None:
        pytest.skip("hypothesis built a valid message")  # pragma: no cover
    raw_socket.send_multipart(frames)
    reply = wire.decode_frames(raw_socket.recv_multipart())
    assert isinstance(reply, Error) and reply.code


def test_a_worker_announcing_a_vanishing_capacity_does_not_stop_the_loop() -> None:
    # Found by the atheris fuzzer: 5e-315 cores made the scheduler's bucket width overflow to inf.
    import msgpack

    srv = ServerProcess("--no-gpu-worker")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    try:
        sock.connect(srv.address)
        body = msgpack.packb(
            {"worker_id": "w1", "capacity": {"cpu": 5e-315, "mem_mb": 64}, "kinds": ["noop"]}
        )
        sock.send(wire.frame(b"register", body))
        assert wire.decode(sock.recv()).kind == "heartbeat"  # registered
        with Client(srv.address) as client:
            assert client.call("echo", {"value": 7}, timeout=10) == 7
        assert srv.process.poll() is None
    finally:
        sock.close(linger=0)
        srv.stop()


@pytest.mark.parametrize(
    "body",
    [
        {"worker_id": "w", "capacity": {"cpu": float("inf"), "mem_mb": 1}},
        {"worker_id": "w", "capacity": {"cpu": float("nan"), "mem_mb": 1}},
        {"worker_id": "w", "capacity": {"cpu": 1e300, "mem_mb": 1}},
    ],
)
def test_capacities_not_finite_or_not_sane_are_refused(raw_socket: zmq.Socket[bytes], body: dict) -> None:
    import msgpack

    raw_socket.send(wire.frame(b"register", msgpack.packb(body)))
    reply = wire.decode(raw_socket.recv())
    assert isinstance(reply, Error) and reply.code == "bad_schema" and "cpu" in reply.message


def test_a_demand_of_infinite_cores_is_refused() -> None:
    with pytest.raises(ValueError, match="finite"):
        Action(kind="noop", demand={"cpu": float("inf")})


def test_an_action_that_cannot_be_encoded_fails_alone_and_the_client_keeps_working(
    server: ServerProcess,
) -> None:
    with Client(server.address) as client:
        futures = client.submit(
            [
                Action(id="fine-1", kind="echo", payload={"value": "a"}),
                Action(id="surrogate", kind="echo", payload={"value": "x\ud800"}),  # not UTF-8
                Action(id="fine-2", kind="echo", payload={"value": "b"}),
            ]
        )
        fine_1, bad, fine_2 = (f.result(timeout=10) for f in futures)
        assert fine_1.ok and fine_1.value == "a" and fine_2.ok and fine_2.value == "b"
        assert not bad.ok and bad.error_type == "rejected" and "does not encode" in (bad.message or "")
        assert client.call("echo", {"value": "after"}) == "after"  # its IO thread lives on


def _local_gpu_worker(server_pid: int) -> int | None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"local-gpu" in argv and str(server_pid).encode() in argv:
            return int(entry)
    return None


def test_the_reward_model_worker_is_started_again_when_it_dies() -> None:
    # Nothing restarted it: reward actions requeued from it, and every later one, waited forever.
    srv = ServerProcess()
    try:
        with Client(srv.address) as client:
            scored = client.run("test.judge", {"items": ["good", "bad"]})
            assert scored.value == [1.0, 0.0] and scored.worker == "local-gpu"  # the name it registered
            first = _local_gpu_worker(srv.process.pid)
            assert first is not None
            os.kill(first, signal.SIGKILL)
            assert client.call("test.judge", {"items": ["good"]}, timeout=60) == [1.0]
            second = _local_gpu_worker(srv.process.pid)
            assert second is not None and second != first
    finally:
        srv.stop()
