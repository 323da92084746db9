"""The state file (``--state-db``) with real servers, real SQLite files and real processes: a write that
fails stops the server rather than letting memory and file disagree, one server holds a file at a time,
files of other layouts are refused, the file stays bounded, and inline actions survive a restart.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from pydantic import BaseModel

from tangram_env import Client, wire
from tangram_env.errors import ServerUnavailable
from tangram_env.kinds import KindRegistry, tool
from tangram_env.protocol import Ack, Action, Result, Submit
from tangram_env.server import lifecycle
from tangram_env.server.scheduler import FCFSScheduler
from tangram_env.server.state import StateStore
from tests.conftest import PLUGINS, ROOT, ServerProcess, wait_for

_COLUMNS_V1 = (
    "CREATE TABLE actions (id TEXT PRIMARY KEY, owner BLOB NOT NULL, action TEXT NOT NULL, "
    "state TEXT NOT NULL, result TEXT); CREATE TABLE acked (id TEXT PRIMARY KEY);"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(port: int, db: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    """A ``tangram-server`` on ``port`` with ``db``, its output in ``log``; returns once it serves."""
    cmd = [sys.executable, "-m", "tangram_env.server", "--bind", f"tcp://127.0.0.1:{port}"]
    cmd += ["--plugin", PLUGINS, "--state-db", str(db), "--no-gpu-worker", "--sandbox", "none"]
    cmd += ["--log-level", "INFO", "--cpus", "2", *extra]
    with log.open("ab") as out:
        proc = subprocess.Popen(
            cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, stdout=out, stderr=out
        )

    def serving() -> bool:
        assert proc.poll() is None, f"the server exited ({proc.returncode}): {log.read_text()[-2000:]}"
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return True
        except OSError:
            return False

    wait_for(serving, 60, "the server to listen")
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class _Peer:
    """A bare DEALER with a fixed identity: what a client sends and hears, frame by frame."""

    def __init__(self, address: str, identity: bytes = b"state-client") -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.sock.connect(address)

    def send(self, message: BaseModel) -> None:
        self.sock.send(wire.encode(message))

    def heard(self, first_s: float, then_s: float = 0.3) -> list[Any]:
        out: list[Any] = []
        wait = first_s
        while self.sock.poll(int(wait * 1000)):
            out.append(wire.decode(self.sock.recv()))
            wait = then_s
        return out

    def results(self, *ids: str, timeout_s: float = 60) -> dict[str, Result]:
        """The results of ``ids``, waiting for them all (what else arrives is dropped)."""
        got: dict[str, Result] = {}
        deadline = time.monotonic() + timeout_s
        while set(ids) - set(got):
            left = deadline - time.monotonic()
            assert left > 0, f"no result for {sorted(set(ids) - set(got))} in {timeout_s:g} s"
            if self.sock.poll(int(left * 1000)):
                message = wire.decode(self.sock.recv())
                if message.kind == "results":  # type: ignore[attr-defined]
                    got.update((r.action_id, r) for r in message.results)  # type: ignore[attr-defined]
        return got

    def close(self) -> None:
        self.sock.close(linger=0)


def _touch(action_id: str, log: Path) -> Action:
    return Action(id=action_id, kind="test.touch", payload={"path": str(log), "line": action_id})


def _runs(log: Path) -> collections.Counter[str]:
    return collections.Counter(log.read_text().split() if log.exists() else [])


# --- a write that fails ----------------------------------------------------------------------------------
@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (needs root, or the permission to mount)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "fs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(disk: Path) -> Path:
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_stops_the_server_with_one_line_and_no_action_runs_twice(
    tiny_disk: Path, tmp_path: Path
) -> None:
    # The write failed inside the Submit's handler: the batch was dropped, the reply was `internal`,
    # and the server ran the action anyway with nothing on disk; killed and restarted, it did not know
    # the action, and the client's resubmission ran it a second time.
    db, runs, log = tiny_disk / "state.db", tmp_path / "runs.log", tmp_path / "server.log"
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    proc = _start(port, db, log)
    peer = _Peer(address)
    try:
        peer.send(Submit(actions=[_touch("warm", runs)]))
        assert peer.results("warm")["warm"].ok
        peer.send(Ack(action_ids=["warm"]))
        time.sleep(0.5)
        filler = _fill(tiny_disk)
        # The refusal of the second is sent in the Submit's own handler: the write fails there.
        peer.send(Submit(actions=[_touch("X", runs), Action(id="nope", kind="no.such.kind")]))
        peer.heard(2)
        try:
            code = proc.wait(10)  # the old server served on
        except subprocess.TimeoutExpired:
            code = None
        if code is None:  # what the old code did next: killed while it believed X ran
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        stopped = log.read_text()
        filler.unlink()
        proc = _start(port, db, log)
        peer.close()
        peer = _Peer(address)
        peer.send(Submit(actions=[_touch("X", runs)]))  # what a reconnecting client does
        assert peer.results("X")["X"].ok
        assert _runs(runs) == {"warm": 1, "X": 1}  # the old server ran X twice
        # 74 (EX_IOERR): orchestrator.EXIT_STATE_WRITE_FAILED
        assert code == 74, f"the server did not stop on a failed write (exit {code})"
        critical = [line for line in stopped.splitlines() if "CRITICAL" in line]
        assert len(critical) == 1 and str(db) in critical[0] and "full" in critical[0], critical
        assert "Traceback" not in stopped
    finally:
        peer.close()
        _stop(proc)


def test_after_a_failed_write_nothing_more_is_written_and_every_commit_says_why(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    store.added(Action(id="a", kind="test.touch"), b"c")
    store.commit()
    store._db.execute("PRAGMA query_only = ON")  # every write now fails, as on a read-only disk
    store.started("a")
    with pytest.raises(Exception, match=r"state\.db") as failed:
        store.commit()
    assert type(failed.value).__name__ == "StateWriteError"
    store._db.execute("PRAGMA query_only = OFF")
    store.finished(Result.failure("a", "error", "x"))
    with pytest.raises(Exception, match=r"state\.db"):  # not written over the gap
        store.commit()
    store.close()  # closes without trying again
    assert sqlite3.connect(tmp_path / "state.db").execute("SELECT state FROM actions").fetchall() == [
        ("queued",)
    ]


# --- one server per file ---------------------------------------------------------------------------------
def test_a_second_server_on_the_same_state_file_refuses_to_start_naming_the_first(tmp_path: Path) -> None:
    # The second server restored the first's queue and ran its actions too (each ran twice), and failed
    # the first's running action as lost.
    db, runs = tmp_path / "state.db", tmp_path / "runs.log"
    first = ServerProcess("--state-db", str(db), "--no-gpu-worker", "--sandbox", "none", "--cpus", "0.25")
    second = None
    try:
        with Client(first.address) as client:
            futures = client.submit([_touch(f"act{i}", runs) for i in range(4)])
            with pytest.raises(ServerUnavailable) as refused:
                second = ServerProcess("--state-db", str(db), "--no-gpu-worker", "--sandbox", "none")
            message = str(refused.value)
            assert str(db) in message and f"pid {first.pid}" in message and "another --state-db" in message
            assert all(f.result(30).ok for f in futures)
        assert max(_runs(runs).values()) == 1
    finally:
        for srv in (first, second):
            if srv is not None:
                srv.stop()
    # Once the first is gone, the file is free again.
    third = ServerProcess("--state-db", str(db), "--no-gpu-worker", "--sandbox", "none")
    third.stop()


def test_a_state_file_is_held_once_per_process_too_and_freed_on_close(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    with pytest.raises(Exception, match="already open in this process"):
        StateStore(tmp_path / "state.db")
    store.close()
    StateStore(tmp_path / "state.db").close()


# --- layouts ---------------------------------------------------------------------------------------------
def _sqlite(path: Path, script: str) -> Path:
    con = sqlite3.connect(path)
    con.executescript(script)
    con.commit()
    con.close()
    return path


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        (_COLUMNS_V1 + "PRAGMA user_version = 2;", "written by a newer tangram-server"),
        (_COLUMNS_V1.replace("result TEXT)", "result TEXT, attempts INTEGER)"), "has the columns"),
        (_COLUMNS_V1.replace(", result TEXT)", ")"), "has the columns"),
        ("CREATE TABLE acked (id TEXT PRIMARY KEY);", "lacks the table(s) actions"),
        ("CREATE TABLE users (name TEXT);", "not a tangram state file"),
    ],
    ids=["newer-version", "extra-column", "missing-column", "missing-table", "other-tables"],
)
def test_a_state_file_of_another_layout_is_refused_in_one_line(
    tmp_path: Path, script: str, expected: str
) -> None:
    # A newer table opened and the loop crashed at its first write; an older one raised a bare
    # OperationalError.
    db = _sqlite(tmp_path / "state.db", script)
    with pytest.raises(Exception) as refused:
        StateStore(db)
    message = str(refused.value)
    assert type(refused.value).__name__ == "StateFileError", message
    assert expected in message and str(db) in message and "--state-db" in message and "\n" not in message
    StateStore(tmp_path / "fresh.db").close()  # the lock of the refused one was let go, too
    StateStore(db.with_name("other.db")).close()


def test_a_server_given_a_file_that_is_no_database_refuses_to_start_naming_it(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    db.write_bytes(os.urandom(8192))
    with pytest.raises(ServerUnavailable, match=f"cannot open the state file {db}"):
        ServerProcess("--state-db", str(db), "--no-gpu-worker", "--sandbox", "none")


def test_a_file_from_before_layouts_were_recorded_is_adopted(tmp_path: Path) -> None:
    db = _sqlite(tmp_path / "state.db", _COLUMNS_V1)
    action = Action(id="q", kind="test.touch")
    con = sqlite3.connect(db)
    con.execute("INSERT INTO actions VALUES ('q', x'63', ?, 'queued', NULL)", (action.model_dump_json(),))
    con.commit()
    con.close()
    store = StateStore(db)
    stored, _ = store.load()
    store.close()
    assert [s.action.id for s in stored] == ["q"]
    assert sqlite3.connect(db).execute("PRAGMA user_version").fetchone()[0] == 1


def test_a_row_that_does_not_parse_is_skipped_naming_its_id_and_never_reruns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A row written by a newer Action model stopped the server's start with a bare validation error.
    db = tmp_path / "state.db"
    store = StateStore(db)
    store.added(Action(id="good", kind="test.touch"), b"c")
    store.commit()
    store.close()
    newer = '{"id": "%s", "kind": "test.touch", "payload": {}, "cost_hint": 1}'
    con = sqlite3.connect(db)
    con.execute("INSERT INTO actions VALUES ('newer-q', x'63', ?, 'queued', NULL)", (newer % "newer-q",))
    con.execute("INSERT INTO actions VALUES ('newer-r', x'63', ?, 'running', NULL)", (newer % "newer-r",))
    con.commit()
    con.close()
    store = StateStore(db)
    with caplog.at_level(logging.WARNING, "tangram_env.server.state"):
        stored, acked = store.load()
    store.close()
    assert [s.action.id for s in stored] == ["good"]
    assert acked == ["newer-r"]  # it may have run: refused as a duplicate, never run again
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "'newer-q'" in warned and "'newer-r'" in warned and "cost_hint" in warned


# --- a bounded file --------------------------------------------------------------------------------------
def test_results_that_expire_unread_leave_the_file_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # They stayed on disk for good and went out again after a restart, while the same server answered
    # `duplicate` for them.
    monkeypatch.setenv("TANGRAM_SERVER_RESULT_TTL_S", "1")
    db, runs, log = tmp_path / "state.db", tmp_path / "runs.log", tmp_path / "server.log"
    port = _free_port()
    proc = _start(port, db, log)
    peer = _Peer(f"tcp://127.0.0.1:{port}")
    try:
        peer.send(Submit(actions=[_touch(f"r{i}", runs) for i in range(3)]))
        assert len(peer.results("r0", "r1", "r2")) == 3  # never acknowledged
        count = lambda: sqlite3.connect(db).execute("SELECT count(*) FROM actions").fetchone()[0]  # noqa: E731
        wait_for(lambda: count() == 0, 10, "the expired results to leave the file")
        acked = sqlite3.connect(db).execute("SELECT id FROM acked ORDER BY rowid").fetchall()
        assert sorted(a for (a,) in acked) == ["r0", "r1", "r2"]
        _stop(proc)
        proc = _start(port, db, log)
        peer.close()
        peer = _Peer(f"tcp://127.0.0.1:{port}")
        peer.send(Submit(actions=[_touch("r0", runs)]))
        (reply,) = peer.heard(30)
        assert reply.kind == "error" and reply.code == "duplicate"
        assert _runs(runs) == {"r0": 1, "r1": 1, "r2": 1}
    finally:
        peer.close()
        _stop(proc)


def test_acknowledged_ids_are_trimmed_to_the_bound_the_server_remembers(tmp_path: Path) -> None:
    # Every acknowledged id stayed in the file for good, and all of them were loaded at start.
    db = tmp_path / "state.db"
    store = StateStore(db, acked_kept=10)
    for i in range(25):
        store.added(Action(id=f"a{i}", kind="test.touch"), b"c")
        store.acknowledged(f"a{i}")
        store.commit()
    assert sqlite3.connect(db).execute("SELECT count(*) FROM acked").fetchone()[0] == 10
    assert store.load()[1] == [f"a{i}" for i in range(15, 25)]  # the newest, oldest first
    store.close()
    with sqlite3.connect(db) as con:  # a file written before ids were trimmed: trimmed on opening
        con.executemany("INSERT INTO acked VALUES (?)", ((f"old{i}",) for i in range(100)))
    store = StateStore(db, acked_kept=10)
    assert sqlite3.connect(db).execute("SELECT count(*) FROM acked").fetchone()[0] == 10
    assert store.load()[1] == [f"old{i}" for i in range(90, 100)]
    store.close()


def test_restore_keeps_only_as_many_acknowledged_ids_as_the_server_remembers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lifecycle, "ACKED_IDS_KEPT", 5)
    core = lifecycle.Lifecycle(KindRegistry(), FCFSScheduler(), persistent=True)
    core.restore([], [f"id{i}" for i in range(12)], 0.0)
    assert list(core.acked) == [f"id{i}" for i in range(7, 12)]


# --- inline actions --------------------------------------------------------------------------------------
_INLINE_PLUGIN = """
from pydantic import BaseModel
import tangram_env

class Mark(BaseModel):
    path: str
    line: str

@tangram_env.tool(name="state.inline_mark", cpu=0, mem_mb=0, timeout_s=5, placement="inline")
def inline_mark(args: Mark) -> str:
    with open(args.path, "a") as f:
        f.write(args.line + "\\n")
    return args.line
"""


def test_an_inline_action_is_kept_in_the_file_and_never_runs_again_after_a_restart(tmp_path: Path) -> None:
    # Inline actions never reached the file: resubmitted after a restart, they ran again.
    plugin = tmp_path / "inline_plugin.py"
    plugin.write_text(textwrap.dedent(_INLINE_PLUGIN))
    db, runs, log = tmp_path / "state.db", tmp_path / "runs.log", tmp_path / "server.log"
    port = _free_port()
    actions = [
        Action(id="inl", kind="state.inline_mark", payload={"path": str(runs), "line": "inl"}),
        _touch("proc", runs),
    ]
    proc = _start(port, db, log, "--plugin-file", str(plugin))
    peer = _Peer(f"tcp://127.0.0.1:{port}")
    try:
        peer.send(Submit(actions=actions))
        assert {k: r.ok for k, r in peer.results("inl", "proc").items()} == {"inl": True, "proc": True}
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc = _start(port, db, log, "--plugin-file", str(plugin))
        peer.close()
        peer = _Peer(f"tcp://127.0.0.1:{port}")
        peer.send(Submit(actions=actions))  # unacknowledged: both results are sent again
        again = peer.results("inl", "proc")
        assert again["inl"].ok and again["inl"].value == "inl" and again["proc"].ok
        assert _runs(runs) == {"inl": 1, "proc": 1}
    finally:
        peer.close()
        _stop(proc)


class _Nothing(BaseModel):
    pass


def test_an_inline_action_is_durable_before_it_runs() -> None:
    reg = KindRegistry()

    @tool(name="inline.noop", cpu=0, mem_mb=0, timeout_s=1, placement="inline", registry=reg)
    def noop(args: _Nothing) -> None:
        return None

    core = lifecycle.Lifecycle(reg, FCFSScheduler(), persistent=True)
    effects = core.receive(b"c", Submit(actions=[Action(id="i", kind="inline.noop")]), 0.0)
    kinds = [(type(e).__name__, getattr(e, "op", "")) for e in effects]
    assert kinds == [("Persist", "added"), ("Persist", "started"), ("RunInline", "")]
    result = Result(action_id="i", ok=True, worker=lifecycle.INLINE)
    ops = [e.op for e in core.finished(lifecycle.INLINE, [result], 0.1) if isinstance(e, lifecycle.Persist)]
    assert ops == ["finished"]
