"""What a local sandbox costs: cold start, warm acquire, reset, exec overhead, concurrent throughput;
and next to it a Docker sandbox's cold start and warm exec, where an engine with ``tangram/default`` runs.

    python -m benchmarks.sandbox [--rounds 40] [--concurrency 1,2,4,8] [--docker-rounds 10] [--json-out FILE]

Prints a table, then one JSON object (top level: ``cold_start_ms_p50``, ``create_ms_p50``,
``warm_acquire_ms_p50``, ``exec_overhead_ratio``). Cold start is ``provider.create`` through the
completion of a first ``true`` in the new sandbox: ``create`` returns before the sandbox's exec agent
is up (tmpfs workspace, cgroups, uid lease, bubblewrap started), and the first exec waits for it, so
create alone (``create_ms_p50``) is not yet ready to exec. Warm acquire is
``SandboxPool.acquire`` from a pool the scheduler has scaled up. Reset restores the image (empty
workspace, and a 200-file image). Exec overhead is ``python -c pass`` in a sandbox against a fresh,
empty virtual environment of the same Python started as a plain subprocess (sandboxes see the venv's
editable-install hooks blank, so the venv's own start-up on the host would flatter the ratio),
interleaved so both see the same load. Throughput runs
``true`` in K sandboxes from K threads at once against K plain subprocesses. Needs the local
provider's isolation (root, bubblewrap, cgroups), as the security tests do. The Docker figures
(``docker`` in the JSON; ``docker_cold_start_ms_p50``, ``docker_create_ms_p50`` and
``docker_warm_exec_ms_p50`` at the top level, beside ``local_warm_exec_ms_p50``) are the same cold
start and ``true`` on one granted core.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.common import fresh_python, percentile, print_table
from tangram_env.sandbox import SandboxSpec
from tangram_env.server.sandbox import SandboxPool, build_image, detect_protections
from tangram_env.server.sandbox.local import LocalProvider

SPEC = SandboxSpec(mem_mb=512, max_pids=128, wall_timeout_s=30)
PYTHON = os.path.join(sys.prefix, "bin", "python3")  # the interpreter the default image exposes


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _summary(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99), "n": float(len(values))}


def cold_start(provider: LocalProvider, rounds: int) -> tuple[list[float], list[float]]:
    """``create`` alone, and ``create`` through the first exec of ``true`` (the cold start), in ms."""
    created, first = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sb = provider.create(SPEC)
        t1 = time.perf_counter()
        result = sb.exec(["true"])
        t2 = time.perf_counter()
        assert result.ok, result
        created.append((t1 - t0) * 1e3)
        first.append((t2 - t0) * 1e3)
        sb.close()
    return created, first


def warm_acquire(provider: LocalProvider, rounds: int) -> tuple[list[float], list[float]]:
    """``acquire`` from a pool scaled to ``rounds`` warm sandboxes, and ``release`` (reset + back), in ms."""
    pool = SandboxPool(provider, spec_for_image=lambda image: SPEC)
    try:
        pool.scale("default", rounds)
        acquired = []
        lent = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            lent.append(pool.acquire())
            acquired.append((time.perf_counter() - t0) * 1e3)
        stats = pool.stats()
        assert stats is not None and stats["warm_hits"] == rounds
        released = [_timed(partial(pool.release, sb)) for sb in lent]
        return acquired, released
    finally:
        pool.close()


def reset_latency(provider: LocalProvider, rounds: int, image: str) -> list[float]:
    """``reset`` after each round dirtied the workspace a little (ms)."""
    sb = provider.create(SPEC.model_copy(update={"image": image}))
    try:
        out = []
        for i in range(rounds):
            sb.write_file(f"scratch/{i}.txt", "x" * 1000)
            out.append(_timed(sb.reset))
        return out
    finally:
        sb.close()


def exec_overhead(provider: LocalProvider, rounds: int) -> tuple[list[float], list[float], list[float]]:
    """``python -c pass`` sandboxed and plain, interleaved; and sandboxed ``true`` (ms)."""
    sb = provider.create(SPEC)
    cores = (min(provider.host_cpus),)
    boxed: list[float] = []
    plain: list[float] = []
    true: list[float] = []
    try:
        with fresh_python() as plain_python:
            for i in range(rounds + 3):
                a = _timed(lambda: sb.exec([PYTHON, "-c", "pass"], cores=cores))
                b = _timed(lambda: subprocess.run([plain_python, "-c", "pass"], check=True))
                c = _timed(lambda: sb.exec(["true"], cores=cores))
                if i >= 3:  # the first few warm the page cache
                    boxed.append(a)
                    plain.append(b)
                    true.append(c)
        return boxed, plain, true
    finally:
        sb.close()


def throughput(provider: LocalProvider, concurrency: int, seconds: float) -> tuple[float, float]:
    """Commands per second with ``concurrency`` threads: ``true`` in own sandboxes, and plain."""
    sandboxes = [provider.create(SPEC) for _ in range(concurrency)]

    def run(work: Callable[[int], None]) -> float:
        count = [0] * concurrency
        stop = time.monotonic() + seconds

        def loop(k: int) -> None:
            while time.monotonic() < stop:
                work(k)
                count[k] += 1

        threads = [threading.Thread(target=loop, args=(k,)) for k in range(concurrency)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(count) / (time.monotonic() - t0)

    def boxed_true(k: int) -> None:
        sandboxes[k].exec(["true"])

    def plain_true(k: int) -> None:
        subprocess.run(["true"], check=True)

    try:
        return run(boxed_true), run(plain_true)
    finally:
        for sb in sandboxes:
            sb.close()


def docker_figures(rounds: int) -> dict[str, Any] | None:
    """Docker cold start (create, and create + first exec) and warm exec of ``true`` on one core (ms);
    None where no engine with the base image answers.
    """
    try:
        from tangram_env.server.sandbox.docker import DockerProvider

        provider = DockerProvider()
        provider.client().images.get("tangram/default:latest")
    except Exception as exc:  # no SDK, no engine, or no base image: nothing to measure
        print(f"(no Docker figures: {type(exc).__name__}: {exc})", file=sys.stderr)
        return None
    try:
        created, first = cold_start(provider, rounds)  # type: ignore[arg-type]
        sb = provider.create(SPEC)
        cores = (min(provider.host_cpus),)
        warm = [_timed(lambda: sb.exec(["true"], cores=cores)) for _ in range(rounds * 3)]
        sb.close()
    finally:
        provider.close()
    return {
        "cold_start_ms": _summary(first),
        "create_ms": _summary(created),
        "warm_exec_ms": _summary(warm),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every measurement, print the table and the JSON, and return the JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--concurrency", default="1,2,4,8", help="comma-separated thread counts")
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of each throughput run")
    parser.add_argument("--docker-rounds", type=int, default=10, help="Docker cold starts (0: none)")
    parser.add_argument("--json-out", help="also write the JSON here")
    args = parser.parse_args(argv)
    load_at_start = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="tangram-bench-"))
    images = Path.home() / ".cache" / "tangram" / f"bench-images-{os.getpid()}"
    try:
        provider = LocalProvider(state_dir=str(work / "sandboxes"), image_dir=str(images))
        source = work / "repo"
        for i in range(200):
            (source / f"pkg{i % 10}").mkdir(parents=True, exist_ok=True)
            (source / f"pkg{i % 10}" / f"mod{i}.py").write_text(f"VALUE = {i}\n" * 100)
        build_image("bench-200", from_dir=source, root=images)
        try:
            created, first = cold_start(provider, args.rounds)
            acquired, released = warm_acquire(provider, args.rounds)
            reset_empty = reset_latency(provider, args.rounds, "default")
            reset_image = reset_latency(provider, args.rounds, "bench-200")
            boxed, plain, true = exec_overhead(provider, args.rounds)
            rates = {k: throughput(provider, k, args.seconds) for k in map(int, args.concurrency.split(","))}
        finally:
            provider.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(images, ignore_errors=True)
    docker = docker_figures(args.docker_rounds) if args.docker_rounds > 0 else None
    ratio = percentile(boxed, 0.5) / percentile(plain, 0.5)
    figures: dict[str, Any] = {
        # Ready to exec means a command has run: create returns before the exec agent is up.
        "cold_start_ms_p50": percentile(first, 0.5),
        "create_ms_p50": percentile(created, 0.5),
        "warm_acquire_ms_p50": percentile(acquired, 0.5),
        "exec_overhead_ratio": ratio,
        "local_warm_exec_ms_p50": percentile(true, 0.5),
        "docker_cold_start_ms_p50": docker["cold_start_ms"]["p50"] if docker else None,
        "docker_create_ms_p50": docker["create_ms"]["p50"] if docker else None,
        "docker_warm_exec_ms_p50": docker["warm_exec_ms"]["p50"] if docker else None,
        "docker": docker,
        "cold_start_ms": _summary(first),
        "create_ms": _summary(created),
        "warm_acquire_ms": _summary(acquired),
        "release_ms": _summary(released),
        "reset_ms": _summary(reset_empty),
        "reset_200_files_ms": _summary(reset_image),
        "exec_python_pass_sandboxed_ms": _summary(boxed),
        "exec_python_pass_plain_ms": _summary(plain),
        "exec_true_sandboxed_ms": _summary(true),
        "throughput_true_per_s": {str(k): {"sandboxed": b, "plain": p} for k, (b, p) in rates.items()},
        "floors": {"warm_acquire_ms_p50": 5.0, "cold_start_ms_p50": 100.0, "exec_overhead_ratio": 2.0},
        "host": {
            "cpus": os.cpu_count(),
            "loadavg_1m": os.getloadavg()[0],
            "loadavg_1m_at_start": load_at_start,
            "protections": detect_protections(),
        },
    }
    rows: list[tuple[str, Any]] = [
        (
            "cold start (create + first exec) p50 / p99 ms",
            f"{percentile(first, 0.5):.2f} / {percentile(first, 0.99):.2f}",
        ),
        (
            "create alone (agent not yet up) p50 / p99 ms",
            f"{percentile(created, 0.5):.2f} / {percentile(created, 0.99):.2f}",
        ),
        ("warm acquire p50 / p99 ms", f"{percentile(acquired, 0.5):.4f} / {percentile(acquired, 0.99):.4f}"),
        (
            "release (reset + pool) p50 / p99 ms",
            f"{percentile(released, 0.5):.2f} / {percentile(released, 0.99):.2f}",
        ),
        (
            "reset, empty image p50 / p99 ms",
            f"{percentile(reset_empty, 0.5):.2f} / {percentile(reset_empty, 0.99):.2f}",
        ),
        (
            "reset, 200-file image p50 / p99 ms",
            f"{percentile(reset_image, 0.5):.2f} / {percentile(reset_image, 0.99):.2f}",
        ),
        ("python -c pass: plain p50 ms", f"{percentile(plain, 0.5):.1f}"),
        ("python -c pass: sandboxed p50 ms", f"{percentile(boxed, 0.5):.1f}"),
        ("exec overhead ratio (sandboxed / plain)", f"{ratio:.2f}"),
        ("true: sandboxed p50 / p99 ms", f"{percentile(true, 0.5):.1f} / {percentile(true, 0.99):.1f}"),
    ]
    for k, (b, p) in rates.items():
        rows.append((f"throughput, {k} at once: sandboxed / plain per s", f"{b:.0f} / {p:.0f}"))
    if docker:
        for label, key in (
            ("Docker cold start (create + first exec)", "cold_start_ms"),
            ("Docker create alone", "create_ms"),
            ("Docker warm exec of true, one core", "warm_exec_ms"),
        ):
            rows.append((f"{label} p50 / p99 ms", f"{docker[key]['p50']:.1f} / {docker[key]['p99']:.1f}"))
    load = f"load {load_at_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
    print_table(f"local and Docker sandboxes ({os.cpu_count()} CPUs, {load})", rows)
    text = json.dumps(figures, indent=2, sort_keys=False)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return figures


if __name__ == "__main__":
    main()
