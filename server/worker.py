"""``tangram-worker``: a host that joins an orchestrator and runs the actions it is granted.

    tangram-worker --connect tcp://HOST:5555 --cpus 16 --mem-mb 64GiB --plugin mypkg.tools
    tangram-worker --connect tcp://HOST:5555 --runner gpu        # reward models on this host's GPUs

The worker announces its capacity and kinds (``Register``), sends heartbeats, runs each ``Dispatch`` on
its runner and answers with ``Results``. When the orchestrator goes silent it registers again, so a
restarted orchestrator gets its capacity back without a restart here.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import secrets
import signal
import socket
import sys
import time
import uuid
from typing import Any

import zmq
from pydantic import ValidationError

from tangram_env import wire
from tangram_env.errors import ProtocolError, TangramError
from tangram_env.protocol import Cancel, CloseSessions, Dispatch, Error, Heartbeat, Register, Result, Results
from tangram_env.server.config import describe_settings_error
from tangram_env.server.runner import Runner
from tangram_env.units import parse_size, parse_size_mb

log = logging.getLogger("tangram_env.server.worker")
#: What to check when the orchestrator has never answered this worker.
_NEVER_ANSWERED = (
    "is tangram-server running at that address, and if it uses CurveZMQ keys, is TANGRAM_CURVE_SERVER_KEY "
    "its public key?"
)

HEARTBEAT_S = 1.0
#: The exit status of a worker whose runner cannot go on (EX_TEMPFAIL): start it again.
EXIT_UNRECOVERABLE = 75
#: The exit status of a worker the orchestrator refused (EX_NOPERM): its worker token is missing or wrong.
EXIT_NOT_ADMITTED = 77
FIGURES_EVERY = 2  # heartbeats between two reports of the runner's figures
REGISTER_GAP_S = 1.0  # at most one registration per second, however many hints arrive
# A Dispatch carries one action the orchestrator accepted within its max_body, and the grant's fields.
GRANT_SLACK = 64 * 2**10


class WorkerAgent:
    """Connects one runner to an orchestrator."""

    def __init__(
        self,
        address: str,
        runner: Runner,
        *,
        worker_id: str | None = None,
        orchestrator_timeout_s: float = 5.0,
        parent_pid: int | None = None,
        curve_server_key: str | None = None,
        max_body: int = wire.DEFAULT_MAX_BODY,
        token: str | None = None,
    ) -> None:
        self.address = address
        self.max_body = max_body  # the orchestrator's (it tells its own on registering): what it accepts
        self.runner = runner
        self.worker_id = worker_id or f"{socket.gethostname()}-{runner.name}-{uuid.uuid4().hex[:6]}"
        self.orchestrator_timeout_s = orchestrator_timeout_s
        self.token = token if token is not None else os.environ.get("TANGRAM_WORKER_TOKEN", "")
        self.parent_pid = parent_pid
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Its name and a secret: the orchestrator hands a reconnecting identity over to the new peer,
        # and worker names are public (in the figures), so a name alone could be taken over.
        self._sock.setsockopt(zmq.ROUTING_ID, f"{self.worker_id[:160]}/{secrets.token_hex(16)}".encode())
        server_key = curve_server_key or os.environ.get("TANGRAM_CURVE_SERVER_KEY")
        if server_key:
            from tangram_env.curve import configure_client_curve

            configure_client_curve(self._sock, server_key)
        self._sock.connect(address)
        self._stopping = False
        self.exit_code = 0  # EXIT_UNRECOVERABLE once its runner could not go on
        self._last_heard = time.monotonic()
        self._server_id = ""
        self._registered_at = 0.0

    def stop(self) -> None:
        """Finish the loop at its next turn."""
        self._stopping = True

    def register(self, force: bool = True) -> None:
        """Announce capacity and kinds (again, after the orchestrator restarts)."""
        now = time.monotonic()
        if not force and now - self._registered_at < REGISTER_GAP_S:
            return  # one burst of "not registered" replies needs one registration
        self._registered_at = now
        cap = self.runner.capacity()
        kinds = self.runner.kinds()
        listed = sorted(kinds) if kinds is not None else []
        self._send(Register(worker_id=self.worker_id, capacity=cap, kinds=listed, token=self.token))

    def rejoin(self, why: str) -> None:
        """Register again after the orchestrator lost this worker (it restarted, went silent, or says
        this worker is not registered). Whichever orchestrator answers has given up on the actions
        running here: a restarted one reported them lost, and a re-registration makes any one requeue
        them and ignore their late results. They are killed first, so that the full capacity this
        worker announces is not granted beside them.
        """
        abandon = getattr(self.runner, "abandon", None)  # a runner that cannot (gpu) finishes them
        orphans = abandon() if abandon is not None else []
        if orphans:
            log.warning("%s; stopped %d actions the orchestrator no longer waits for", why, len(orphans))
        else:
            log.warning("%s", why)
        self.register()

    def serve_forever(self) -> None:
        """Run until stopped, then close the runner."""
        self.register()
        next_beat = time.monotonic() + HEARTBEAT_S
        beats = 0
        try:
            while not self._stopping:
                poller = zmq.Poller()
                poller.register(self._sock, zmq.POLLIN)
                for fd in self.runner.wait_fds():
                    poller.register(fd, zmq.POLLIN)
                ready = dict(poller.poll(int(max(0.0, next_beat - time.monotonic()) * 1000)))
                if self._sock in ready:
                    self._drain()
                results = self.runner.collect()
                if results:
                    self._send(Results(results=results))
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + HEARTBEAT_S
                    beats += 1
                    self.runner.maintain()
                    figures = self.runner.stats() if beats % FIGURES_EVERY == 0 else None
                    self._send(Heartbeat(server_id=self._server_id, figures=figures))
                    if now - self._last_heard > self.orchestrator_timeout_s:
                        silent_s = now - self._last_heard
                        self._last_heard = now
                        # Never answered at all: a keyed orchestrator drops a worker without its key unheard.
                        never = "" if self._server_id else f" (it never answered: {_NEVER_ANSWERED})"
                        self.rejoin(f"orchestrator silent for {silent_s:.0f}s; registering again{never}")
                    if self.parent_pid is not None and os.getppid() != self.parent_pid:
                        log.warning("parent process is gone; stopping")
                        break
                    why = self.runner.unrecoverable()
                    if why is not None:
                        # Crash-only: a fresh process gets fresh devices; the orchestrator sees this
                        # worker go and runs its actions again elsewhere, or here once it is back.
                        log.critical(
                            "%s; this worker exits (status %d) for its supervisor to start it afresh",
                            why,
                            EXIT_UNRECOVERABLE,
                        )
                        self.exit_code = EXIT_UNRECOVERABLE
                        break
        finally:
            self.runner.close()
            self._sock.close(linger=0)

    def _drain(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_heard = time.monotonic()
            try:
                message = wire.decode_frames(frames, self.max_body + GRANT_SLACK)
            except ProtocolError as exc:
                log.warning("bad message from the orchestrator: %s", exc)
                continue
            if isinstance(message, Dispatch):
                for grant in message.grants:
                    try:
                        self.runner.start(grant)
                    except Exception as exc:  # the runner refused: that action fails, the worker goes on
                        log.exception("runner could not start %s", grant.action.id)
                        self._send(
                            Results(
                                results=[
                                    Result.failure(grant.action.id, "error", str(exc), worker=self.worker_id)
                                ]
                            )
                        )
            elif isinstance(message, CloseSessions):
                self.runner.end_sessions(message.session_ids)
            elif isinstance(message, Cancel):  # their owner cancelled them while they ran
                self.runner.cancel(message.action_ids)
            elif isinstance(message, Heartbeat):
                # Only the answer to a Register carries max_body: that one acknowledges this worker's
                # registration with the orchestrator it names, which is then already rejoined.
                acknowledged = message.max_body is not None
                if self._server_id and message.server_id != self._server_id and not acknowledged:
                    self.rejoin("orchestrator restarted; registering again")
                self._server_id = message.server_id
                if message.max_body is not None and message.max_body != self.max_body:
                    log.info("the orchestrator's max_body is %d bytes; using it", message.max_body)
                    self.max_body = message.max_body
            elif isinstance(message, Error):
                log.warning("orchestrator says: %s: %s", message.code, message.message)
                if message.code == "not_registered":
                    if time.monotonic() - self._registered_at >= REGISTER_GAP_S:
                        self.rejoin("not registered with the orchestrator; registering again")
                elif message.code in ("unauthorized", "conflict"):
                    # Trying again would not help: a setting is wrong (the token, or this worker's
                    # name: the orchestrator's own, or taken by another worker since).
                    log.critical("not admitted as a worker; exiting (status %d)", EXIT_NOT_ADMITTED)
                    self.exit_code = EXIT_NOT_ADMITTED
                    self._stopping = True

    def _send(self, message: Any) -> None:
        for data in wire.frames(message, self.max_body):  # the orchestrator's limit
            try:
                self._sock.send(data, zmq.NOBLOCK)
            except zmq.Again:
                log.warning("orchestrator unreachable; dropped a %s", type(message).__name__)


def make_runner(kind: str, args: argparse.Namespace) -> Runner:
    """The runner named ``kind`` (``cpu``: forked processes and sandboxes; ``gpu``: reward models)."""
    if args.cpus is not None and not (math.isfinite(args.cpus) and args.cpus > 0):
        raise ValueError(f"--cpus must be a positive number of cores, got {args.cpus:g}")
    if args.mem_mb is not None:
        try:
            given_mb = parse_size_mb(args.mem_mb)
        except ValueError as exc:
            raise ValueError(f"--mem-mb {args.mem_mb}: {exc} (e.g. 4096 or 64GiB)") from None
        if given_mb <= 0:
            raise ValueError(f"--mem-mb must be positive, got {args.mem_mb}")
    if kind == "gpu":
        from tangram_env.server.gpu import GpuRunner
        from tangram_env.server.gpu.runner import STUCK_AFTER_S

        # "0,1" means CUDA devices 0 and 1; full names (cuda:0, cpu) pass through.
        devices = [f"cuda:{d}" if d.isdigit() else d for d in args.gpus.split(",")] if args.gpus else None
        if devices:
            _check_devices(devices)
        mem_mb = parse_size_mb(args.mem_mb) if args.mem_mb else None
        return GpuRunner(
            devices=devices,
            mem_budget_mb=args.gpu_mem_mb,
            cpu=args.cpus,
            mem_mb=mem_mb,
            worker_id=args.worker_id or socket.gethostname(),
            stuck_after_s=STUCK_AFTER_S if args.stuck_after_s is None else args.stuck_after_s,
        )
    from tangram_env.server.config import ServerSettings
    from tangram_env.server.executor import LocalRunner
    from tangram_env.server.resources import make_sandbox_pool

    given = {"cpus": args.cpus, "mem_mb": args.mem_mb, "sandbox_provider": args.sandbox}
    settings = ServerSettings(**{k: v for k, v in given.items() if v})
    return LocalRunner(
        settings.cpus,
        settings.mem_mb,
        sandbox_pool=make_sandbox_pool(settings),
        worker_id=args.worker_id or socket.gethostname(),
    )


def _check_devices(devices: list[str]) -> None:
    """Refuse CUDA devices this host lacks (torch would fail on them deep inside, with an assertion)."""
    wanted = [d for d in devices if d.startswith("cuda")]
    if not wanted:
        return
    from tangram_env.server.gpu.devices import cuda_devices

    present = cuda_devices()
    missing = [d for d in wanted if (d if ":" in d else "cuda:0") not in present]
    if missing:
        here = f"this host has {', '.join(present)}" if present else "this host has no CUDA device"
        raise ValueError(
            f"--gpus: no {', '.join(missing)} here ({here}); leave --gpus out to use every CUDA device "
            "here, or give --gpus cpu"
        )


def _load_plugins(modules: list[str], files: list[str]) -> None:
    """Entry-point plugins (one that fails is logged and skipped), then the named ones, each of which
    must import: the error names the flag that asked for it.
    """
    from tangram_env.plugins import load_plugins

    load_plugins([], [])
    for path in files:
        if not os.path.isfile(path):
            raise ValueError(f"--plugin-file {path}: no such file")
    try:
        load_plugins(modules, files, entry_point_plugins=False)
    except ImportError as exc:  # it names the flag, the plugin and why
        raise ValueError(str(exc)) from exc


def _address_problem(address: str) -> str | None:
    """Why ZeroMQ cannot connect to ``address`` (None when it can): asked before anything starts."""
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(address)
    except zmq.ZMQError as exc:
        return f"--connect {address}: {exc.strerror}; expected tcp://HOST:PORT (or ipc://PATH)"
    finally:
        sock.close(linger=0)
    return None


def _refuse(problem: str) -> int:
    """A user's mistake: one line naming it, and status 2 (as tangram-server gives its settings errors)."""
    print(f"tangram-worker: {problem}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tangram-worker``."""
    p = argparse.ArgumentParser(prog="tangram-worker", description="Join a Tangram orchestrator as a worker.")
    p.add_argument("--connect", required=True, help="the orchestrator's address")
    p.add_argument("--runner", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--cpus", type=float, help="cores to lend (cpu runner: default all; gpu: one per device)")
    p.add_argument("--mem-mb", help="host memory to lend (cpu runner: default 80%%; gpu: a quarter)")
    p.add_argument(
        "--sandbox",
        help="sandbox provider (cpu runner): local (default), e2b, docker, none, or a declared one",
    )
    p.add_argument(
        "--gpus", help="comma-separated devices, e.g. cuda:0,cuda:1 (gpu runner; default all, else cpu)"
    )
    p.add_argument("--gpu-mem-mb", type=int, help="memory budget per device (gpu runner)")
    p.add_argument(
        "--stuck-after-s",
        type=float,
        default=None,
        help="gpu runner: a device still in a model's code this long past the time limit of the last "
        f"request it serves is stuck, and the worker exits with status {EXIT_UNRECOVERABLE} for its "
        "supervisor to start it afresh (default 300)",
    )
    p.add_argument("--plugin", action="append", default=[], help="plugin module (repeatable)")
    p.add_argument("--plugin-file", action="append", default=[], help="plugin script (repeatable)")
    p.add_argument("--worker-id", help="name announced to the orchestrator")
    p.add_argument(
        "--max-body",
        type=parse_size,
        default=wire.DEFAULT_MAX_BODY,
        help="largest message body until the orchestrator tells its own max_body on registering "
        "(default 16 MiB)",
    )
    p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    args = p.parse_args(argv)
    level = logging.getLevelName(args.log_level.upper())
    if not isinstance(level, int):
        return _refuse(
            f"--log-level {args.log_level}: not a level; use DEBUG, INFO, WARNING, ERROR or CRITICAL"
        )
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tangram_env.server.sandbox.procrun import default_signals_for_children, raise_open_file_limit

    problem = _address_problem(args.connect)
    if problem is not None:
        return _refuse(problem)
    reset = default_signals_for_children()  # before any thread starts
    if reset:
        log.info("sandbox commands start with these signals at their defaults: %s", ", ".join(reset))
    log.debug("open files: up to %d", raise_open_file_limit())
    # One name for the registration and the results' ``worker`` field.
    args.worker_id = args.worker_id or f"{socket.gethostname()}-{args.runner}-{uuid.uuid4().hex[:6]}"
    try:
        _load_plugins(args.plugin, args.plugin_file)
        runner = make_runner(args.runner, args)
    except ValidationError as exc:  # from TANGRAM_SERVER_* variables, or a flag they validate
        return _refuse(f"invalid settings: {describe_settings_error(exc)}")
    except (ValueError, OSError, ImportError, TangramError) as exc:
        # A flag's value, a plugin or a sandbox provider that is not there: the user's to fix.
        return _refuse(str(exc))
    try:
        agent = WorkerAgent(
            args.connect, runner, worker_id=args.worker_id, parent_pid=args.parent_pid, max_body=args.max_body
        )
    except BaseException:
        runner.close()
        raise
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: agent.stop())
    log.info("worker %s joining %s", agent.worker_id, args.connect)
    agent.serve_forever()
    return agent.exit_code


if __name__ == "__main__":
    sys.exit(main())
