"""Real processes for cluster tests: an orchestrator, workers (optionally inside a namespace), trainers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tangram_env.launch import ServerProcess
from tests.cluster.netns import Host
from tests.cluster.plugin import WORKER_ENV
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = "tests.cluster.plugin"


def child_env(**extra: str) -> dict[str, str]:
    """The test's environment plus the repository on the import path."""
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


class Processes:
    """Every process a test starts, so that teardown can end the ones still running."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: Sequence[str], host: Host | None = None, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = host.popen(argv, **kwargs) if host is not None else subprocess.Popen(list(argv), **kwargs)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_orchestrator(
    procs: Processes, bind: str, *extra: str, env: dict[str, str] | None = None, timeout_s: float = 60.0
) -> tuple[subprocess.Popen[bytes], str]:
    """A ``tangram-server`` that lends (almost) no cores itself, so every ``cluster.mark`` goes to a
    worker; returns the process and the address it bound."""
    server = ServerProcess(
        "--plugin",
        PLUGIN,
        "--cpus",
        "0.01",
        "--no-gpu-worker",
        *extra,
        bind=bind,
        env=env or child_env(),
        cwd=ROOT,
        timeout_s=timeout_s,
    )
    procs.procs.append(server.process)
    return server.process, server.address


def start_worker(
    procs: Processes,
    address: str,
    worker_id: str,
    *,
    cpus: float = 1.0,
    host: Host | None = None,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """A ``tangram-worker`` named ``worker_id`` (``env``: more variables); the runs it makes carry that
    name in their marks.
    """
    argv = [
        sys.executable,
        "-m",
        "tangram_env.server.worker",
        "--connect",
        address,
        "--worker-id",
        worker_id,
        "--cpus",
        str(cpus),
        "--mem-mb",
        "1024",
        "--plugin",
        PLUGIN,
        "--log-level",
        "WARNING",
        *extra,
    ]
    return procs.start(argv, host=host, env=child_env(**{WORKER_ENV: worker_id, **(env or {})}), cwd=ROOT)


def start_trainer(
    procs: Processes,
    address: str,
    tag: str,
    n: int,
    marks: Path,
    out: Path,
    *,
    window: int = 16,
    seconds: float = 0.1,
    gate: Path | None = None,
    gate_at: int = 0,
) -> subprocess.Popen[bytes]:
    """A trainer process (its own client) submitting ``n`` actions with ids ``<tag>-<i>``; with ``gate``,
    actions from ``gate_at`` on wait until that file exists."""
    argv = [
        sys.executable,
        "-m",
        "tests.cluster.trainer",
        "--address",
        address,
        "--tag",
        tag,
        "--n",
        str(n),
        "--window",
        str(window),
        "--seconds",
        str(seconds),
        "--dir",
        str(marks),
        "--out",
        str(out),
    ]
    if gate is not None:
        argv += ["--gate", str(gate), "--gate-at", str(gate_at)]
    return procs.start(argv, env=child_env(), cwd=ROOT)


class TrainerRun:
    """The scale-out scenario's run: once workers w0..w2 have joined, two trainers submit
    ``N_PER_TRAINER`` actions each; each pauses at ``GATE_AT`` until :meth:`second_half`, so that the test
    changes the cluster mid-run. :meth:`check` then asserts what every such run must give."""

    N_PER_TRAINER = 200
    GATE_AT = N_PER_TRAINER // 2

    def __init__(self, procs: Processes, client: Any, address: str, tmp_path: Path) -> None:
        self.marks = tmp_path / "marks"
        self.marks.mkdir()
        self.gate = tmp_path / "second-half"
        wait_for(lambda: {"w0", "w1", "w2"} <= set(client.stats()["workers"]), 30, "three workers to join")
        self.outs = [tmp_path / f"t{i}.json" for i in range(2)]
        self.trainers = [
            start_trainer(
                procs,
                address,
                f"t{i}",
                self.N_PER_TRAINER,
                self.marks,
                self.outs[i],
                seconds=0.2,
                gate=self.gate,
                gate_at=self.GATE_AT,
            )
            for i in range(2)
        ]

    def second_half(self) -> None:
        """Let the trainers go on past ``GATE_AT``, then wait for them to finish."""
        self.gate.touch()
        for t in self.trainers:
            assert t.wait(timeout=60) == 0

    def check(
        self, figures: dict[str, Any], faulty: set[str], workers: set[str]
    ) -> tuple[dict[str, int], Runs]:
        """Every result delivered once (:func:`check_delivery`), the orchestrator's books closed, and
        ``workers`` registered at the end; returns the delivery figures and the completion marks."""
        records = read_records(*self.outs)
        expected = {f"t{i}-{j}" for i in range(2) for j in range(self.N_PER_TRAINER)}
        started, done = read_marks(self.marks)
        seen = check_delivery(records, expected, (started, done), faulty=faulty)
        print("results per worker and requeues:", seen)
        assert figures["submitted"] == figures["finished"] == len(expected)
        assert not figures["errors"]
        assert figures["pending"] == figures["running"] == 0
        assert set(figures["workers"]) == workers
        assert seen.get("w3", 0) > 0, seen  # the worker that joined mid-run got work
        assert seen["requeued"] >= 1, seen  # actions in flight on a faulty worker ran again elsewhere
        self.records = records
        return seen, done


Runs = dict[str, list[tuple[str, float]]]


def read_marks(marks: Path) -> tuple[Runs, Runs]:
    """(started, completed): action id -> [(worker name, wall time)] for each run that began / finished."""
    started: Runs = defaultdict(list)
    done: Runs = defaultdict(list)
    for path in marks.iterdir():
        if path.name.startswith("."):
            continue  # a mark its run was killed while writing
        action_id, _pid, what = path.name.rsplit(".", 2)
        text = path.read_text().strip()
        if not text:  # killed between creating its mark and writing it (a Ray node's processes all die)
            continue
        worker, stamp = text.split("\t")
        (started if what == "start" else done)[action_id].append((worker, float(stamp)))
    return dict(started), dict(done)


def read_records(*outs: Path) -> list[dict[str, Any]]:
    """Every result the trainers recorded (each output must be complete)."""
    records: list[dict[str, Any]] = []
    for out in outs:
        data = json.loads(out.read_text())
        assert not data["unanswered"], f"{out.name}: no result for {data['unanswered'][:10]}"
        records += data["records"]
    return records


def check_delivery(
    records: list[dict[str, Any]], expected_ids: set[str], marks: tuple[Runs, Runs], faulty: set[str]
) -> dict[str, int]:
    """The checks every scale-out run must pass; returns figures about what happened.

    - every action got exactly one result, and it succeeded;
    - the worker named in the result really ran it to the end (it left a ``.done`` mark);
    - no action completed twice on healthy workers. An action that was running on a worker that died or
      was cut off may have run there too, in part or in full (its late result is dropped), so for
      those the rule is "at least once, result exactly once".

    ``requeued`` counts actions that began on a faulty worker and whose result came from another one.
    """
    started, done = marks
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), "an action got more than one result"
    assert set(ids) == expected_ids, f"missing results: {sorted(expected_ids - set(ids))[:10]}"
    failed = [r for r in records if not r["ok"]]
    assert not failed, f"{len(failed)} actions failed, e.g. {failed[:3]}"
    requeued = 0
    by_worker: dict[str, int] = defaultdict(int)
    for r in records:
        completed_on = [w for w, _ in done.get(r["id"], [])]
        assert r["worker"] in completed_on, (
            f"{r['id']}: result from {r['worker']} but completed on {completed_on}"
        )
        assert r["value"]["worker"] == r["worker"], (
            f"{r['id']}: value {r['value']} vs result worker {r['worker']}"
        )
        healthy = [w for w in completed_on if w not in faulty]
        assert len(healthy) <= 1, f"{r['id']} completed more than once on healthy workers: {completed_on}"
        began_on = {w for w, _ in started.get(r["id"], [])}
        assert set(completed_on) <= began_on
        if r["worker"] not in faulty and began_on & faulty:
            requeued += 1
        by_worker[r["worker"]] += 1
    return {"requeued": requeued, "completed_runs": sum(len(v) for v in done.values()), **by_worker}


def free_port() -> int:
    """A loopback TCP port nobody listens on right now (for a server told its port up front)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape_metrics(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Sample name -> {sorted labels: value} from a Prometheus endpoint on loopback."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def check_observability(
    metrics_port: int, address: str, finished: int, workers: set[str], capsys: Any
) -> None:
    """The orchestrator's Prometheus endpoint and ``tangram-server stats --once`` show the run's figures."""
    from tangram_env.server.stats_view import stats_main

    # The endpoint is refreshed from the loop about every 0.5 s: wait for the last results to show.
    m = wait_for(
        lambda: (
            (s := scrape_metrics(metrics_port)).get("tangram_finished_total", {}).get(()) == finished and s
        ),
        10,
        "the metrics endpoint to show every result",
    )
    assert m["tangram_action_completion_seconds_count"][(("kind", "cluster.mark"),)] == finished
    assert m["tangram_actions_finished_total"][(("kind", "cluster.mark"), ("outcome", "ok"))] == finished
    assert m["tangram_queue_length"][()] == 0
    assert {dict(k)["worker"] for k in m["tangram_worker_capacity"]} == workers
    assert m["tangram_capacity"][(("resource", "cpu"),)] > 0
    assert (("resource", "cpu"),) in m["tangram_utilisation_ratio"]
    capsys.readouterr()
    assert stats_main(["--address", address, "--once", "--interval", "100ms"]) == 0
    out = capsys.readouterr().out
    assert "cluster.mark" in out and f"workers ({len(workers)})" in out
    assert all(w in out for w in workers)
    row = next(line for line in out.splitlines() if "cluster.mark" in line and "│" in line)
    assert f" {finished} " in row
