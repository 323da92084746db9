"""``tangram-server``: run the orchestrator in the foreground, or manage sandbox images.

tangram-server --bind tcp://127.0.0.1:5555 --plugin mypkg.tools
tangram-server image build NAME [--from DIR] [--requirements FILE]   (--docker: a Docker image)
tangram-server stats --address tcp://127.0.0.1:5555
tangram-server keygen DIR
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import logging
import os
import sys
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from tangram_env.errors import TangramError
from tangram_env.launch import report_start_failure
from tangram_env.server.config import ServerSettings, describe_settings_error, resolve_settings

if TYPE_CHECKING:
    from tangram_env.kinds import KindRegistry
    from tangram_env.server.orchestrator import Orchestrator
    from tangram_env.server.scheduler.events import Scheduler

log = logging.getLogger("tangram_env.server")


_SUBCOMMANDS_HELP = """subcommands:
  tangram-server image build NAME ...    build a sandbox image (tangram-server image --help)
  tangram-server stats --address ADDR    a live table of a running orchestrator's figures
  tangram-server keygen DIR              create a CurveZMQ key pair (--curve-secret-key-file)
"""


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tangram-server",
        description="Run the Tangram orchestrator.",
        epilog=_SUBCOMMANDS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the epilog's lines as written
    )
    p.add_argument(
        "--bind", help="address to listen on (default tcp://127.0.0.1:5555; tcp://HOST:0 picks a port)"
    )
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE for its tools and reward models (repeatable)",
    )
    p.add_argument(
        "--plugin-file", action="append", default=[], metavar="PATH", help="import a script as a plugin"
    )
    p.add_argument("--no-entry-points", action="store_true", help="skip the tangram_env.plugins entry points")
    p.add_argument("--cpus", type=float, help="cores the local executor lends (default: all usable)")
    p.add_argument("--mem-mb", help="memory it lends (MiB or a size such as 8GiB; default 80%% of RAM)")
    p.add_argument("--scheduler", help="scheduling policy (default: the elastic scheduler)")
    p.add_argument(
        "--sandbox",
        dest="sandbox_provider",
        help="sandbox provider: local (default), e2b, docker, none, or a declared one",
    )
    p.add_argument("--config", help="settings file (TOML or JSON; flags and TANGRAM_SERVER_* override it)")
    for flag, what in (
        ("--sandbox-option", "an option of the selected sandbox provider (e.g. pull=true)"),
        ("--sandbox-spec", "a SandboxSpec field of every sandbox (e.g. mem_mb=2GiB)"),
        ("--scheduler-option", "an option of the scheduling policy (e.g. age_rate=2)"),
    ):
        p.add_argument(flag, action="append", default=[], metavar="NAME=VALUE", help=f"{what}; repeatable")
    p.add_argument("--no-gpu-worker", action="store_true", help="do not start a local reward-model worker")
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="accept a non-loopback bind (also needs --curve-secret-key-file)",
    )
    p.add_argument("--curve-secret-key-file", help="CurveZMQ secret key (from `tangram-server keygen`)")
    p.add_argument("--curve-clients-dir", help="accept only clients whose public keys are in this folder")
    p.add_argument("--state-db", help="SQLite file keeping the queue and results across restarts")
    p.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free port)"
    )
    p.add_argument("--max-queued-per-client", type=int, help="outstanding actions per client before 'busy'")
    p.add_argument(
        "--max-sessions-per-client",
        type=int,
        help="live sandbox sessions per client; an action opening one more is rejected (default: no limit)",
    )
    p.add_argument(
        "--quota",
        action="append",
        default=[],
        metavar="API:rate=N,burst=N,in_flight=N,keys=a+b",
        help="an API quota shared by every trainer (repeatable; see docs/quotas.md)",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        metavar="ADDRESS",
        help="take workers from a Ray cluster: auto (default), ray://HOST:PORT, HOST:PORT, or local "
        "(docs/ray.md)",
    )
    p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return p


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Flags over environment over the settings file over defaults: resolved once, here. Tables
    (``--ray``, ``--quota``, ``--sandbox-spec`` ...) are given as tables, to merge key by key with the
    lower levels' (a model would bring its defaults along and hide them).
    """
    overrides: dict[str, Any] = {
        "bind": args.bind,
        "cpus": args.cpus,
        "mem_mb": args.mem_mb,
        "scheduler": args.scheduler,
        "sandbox_provider": args.sandbox_provider,
        "parent_pid": args.parent_pid,
        "curve_secret_key_file": args.curve_secret_key_file,
        "curve_clients_dir": args.curve_clients_dir,
        "state_db": args.state_db,
        "metrics_port": args.metrics_port,
        "max_queued_per_client": args.max_queued_per_client,
        "max_sessions_per_client": args.max_sessions_per_client,
    }
    fields = {k: v for k, v in overrides.items() if v is not None}
    if args.plugin:
        fields["plugins"] = args.plugin
    if args.plugin_file:
        fields["plugin_files"] = args.plugin_file
    if args.no_entry_points:
        fields["entry_point_plugins"] = False
    if args.no_gpu_worker:
        fields["gpu_worker"] = False
    if args.allow_remote:
        fields["allow_remote"] = True
    if args.config:
        fields["config"] = args.config
    if args.sandbox_spec:
        fields["sandbox_spec"] = _assignments(args.sandbox_spec)
    if args.scheduler_option:
        fields["scheduler_options"] = _assignments(args.scheduler_option)
    if args.quota:
        from tangram_env.server.scheduler.quotas import parse_quota

        apis: dict[str, Any] = {}
        for text in args.quota:
            api, quota = parse_quota(text)
            if api in apis:
                raise ValueError(f"--quota {api}: given twice; give each API one --quota")
            apis[api] = quota.model_dump(exclude_unset=True)  # replaces that API's entry below, whole
        fields["quotas"] = {"apis": apis}
    if args.ray is not None:
        fields["ray"] = {"address": args.ray}
    settings = resolve_settings(fields)
    if args.sandbox_option:  # for whichever provider the settings chose
        options = {**settings.sandbox_options}
        options[settings.sandbox_provider] = {
            **options.get(settings.sandbox_provider, {}),
            **_assignments(args.sandbox_option),
        }
        settings = settings.model_copy(update={"sandbox_options": options})
    return settings


def _assignments(items: list[str]) -> dict[str, Any]:
    """``NAME=VALUE`` flags as a dict; a VALUE that is JSON (true, 2, {...}) is decoded."""
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"expected NAME=VALUE, got {item!r}")
        try:
            out[name] = json.loads(value)
        except ValueError:
            out[name] = value
    return out


def build(
    settings: ServerSettings,
    *,
    registry: KindRegistry | None = None,
    scheduler: Scheduler | None = None,
    sandbox_pool: Any = None,
    context: zmq.Context[Any] | None = None,
) -> Orchestrator:
    """Everything the orchestrator needs, made here at the edge and handed in: the socket (with CURVE),
    the metrics exporter, the local runner, the state file (and the core restored from it).
    """
    from tangram_env.kinds import kind_registry
    from tangram_env.server.executor import LocalRunner
    from tangram_env.server.lifecycle import Lifecycle, Limits
    from tangram_env.server.orchestrator import Orchestrator
    from tangram_env.server.resources import make_configured_scheduler
    from tangram_env.server.security import (
        check_bind_allowed,
        check_curve_settings,
        configure_server_curve,
        is_loopback,
    )
    from tangram_env.server.state import StateStore

    registry = kind_registry if registry is None else registry
    check_bind_allowed(
        settings.bind, curve=settings.curve_secret_key_file is not None, allow_remote=settings.allow_remote
    )
    check_curve_settings(settings.curve_secret_key_file, settings.curve_clients_dir)
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its identity
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 4 * settings.max_body)  # beyond this: drop the peer
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    on_close: list[Callable[[], None]] = []
    try:
        if settings.curve_secret_key_file:
            auth = configure_server_curve(
                sock, settings.curve_secret_key_file, settings.curve_clients_dir, ctx
            )
            if auth is not None:
                on_close.append(auth.stop)
        address = _bind(sock, settings.bind)
    except BaseException:
        for stop in on_close:  # the authenticator's thread would keep the process from exiting
            stop()
        sock.close(linger=0)
        raise
    if settings.worker_token is None and not is_loopback(settings.bind):
        log.warning(
            "any peer that reaches %s may register as a worker, receive actions and answer them: set "
            "TANGRAM_SERVER_WORKER_TOKEN (and TANGRAM_WORKER_TOKEN for the workers) to admit only yours",
            address,
        )
    elif settings.worker_token is None and address.startswith("tcp://"):
        # Loopback TCP is open to every user of this host (an ipc:// socket has file permissions). No
        # token is made up here: `tangram-worker --connect` on this host, without one, must still join.
        log.warning(
            "any process on this host, of any user, may connect to %s and register as a worker (even "
            "under a running worker's name), receive actions and answer them: set "
            "TANGRAM_SERVER_WORKER_TOKEN (and TANGRAM_WORKER_TOKEN for tangram-worker) to admit only yours",
            address,
        )
    exporter = None
    if settings.metrics_port is not None:
        from tangram_env.server.prometheus import PrometheusExporter

        exporter = PrometheusExporter()
        log.info("Prometheus metrics on http://127.0.0.1:%d/metrics", exporter.start(settings.metrics_port))
        on_close.append(exporter.stop)
    store = StateStore(settings.state_db) if settings.state_db else None
    core = Lifecycle(
        registry,
        scheduler or make_configured_scheduler(settings),
        server_id=uuid.uuid4().hex,
        limits=Limits(
            max_queued_per_client=settings.max_queued_per_client,
            max_unacked_per_client=settings.max_unacked_per_client,
            max_sessions_per_client=settings.max_sessions_per_client,
            max_retries=settings.max_retries,
            worker_timeout_s=settings.worker_timeout_s,
            client_timeout_s=settings.client_timeout_s,
            session_idle_s=settings.session_idle_s or None,
            result_ttl_s=settings.result_ttl_s,
            busy_first_s=settings.sandbox_busy_wait_s,
            busy_max_s=settings.sandbox_busy_max_wait_s,
            busy_tries=settings.sandbox_busy_tries,
            max_body=settings.max_body,
        ),
        persistent=store is not None,
        observed=exporter is not None,
        sandbox_mem_mb=_sandbox_reserve(settings, sandbox_pool),
        sandbox_provider=getattr(sandbox_pool.provider, "name", None) if sandbox_pool is not None else None,
        worker_token=settings.worker_token.get_secret_value() if settings.worker_token else None,
    )
    local = LocalRunner(settings.cpus, settings.mem_mb, registry=registry, sandbox_pool=sandbox_pool)
    core.add_runner("local", local.capacity(), local.kinds())
    orchestrator = Orchestrator(
        core,
        sock,
        address,
        runners={"local": local},
        max_body=settings.max_body,
        sandbox_pool=sandbox_pool,
        store=store,
        exporter=exporter,
        on_close=on_close,
        parent_pid=settings.parent_pid,
    )
    if store is not None:
        stored, acked = store.load()
        orchestrator.restore(stored, acked)
    return orchestrator


def _sandbox_reserve(settings: ServerSettings, pool: Any) -> Callable[[str], float] | None:
    """What a live sandbox of each image holds in the ledger (None: no sandboxes, or none on this host)."""
    if pool is None or not getattr(pool.provider, "host_memory", True):
        return None  # a remote provider's sandboxes (e2b) take no memory of this host

    @functools.lru_cache(maxsize=1024)  # bounded: image names come from clients
    def reserve(image: str) -> float:
        return float(settings.reserve_for_image(image))

    return reserve


def _bind(sock: zmq.Socket[Any], address: str) -> str:
    try:
        if address.endswith(":0") and address.startswith("tcp://"):
            host = address.rsplit(":", 1)[0]
            return f"{host}:{sock.bind_to_random_port(host)}"
        sock.bind(address)
    except zmq.ZMQError as exc:  # said in one line, with the fix, like the other start failures
        hint = (
            "another process (another tangram-server?) holds it: stop it, or choose another --bind "
            "(tcp://127.0.0.1:0 picks a free port)"
            if exc.errno == errno.EADDRINUSE
            else "expected tcp://HOST:PORT, tcp://HOST:0 or ipc://PATH"
        )
        raise OSError(f"cannot bind {address}: {zmq.strerror(exc.errno or 0)}; {hint}") from None
    return address


def serve(settings: ServerSettings, ready_fd: int | None = None) -> int:
    """Load plugins, build the orchestrator and serve until SIGINT/SIGTERM."""
    from tangram_env.plugins import load_plugins
    from tangram_env.server import builtin_tools  # noqa: F401  (registers noop, echo, sleep)
    from tangram_env.server.priority import raise_control_plane
    from tangram_env.server.resources import make_sandbox_pool, start_local_workers

    loaded = load_plugins(
        settings.plugins, settings.plugin_files, entry_point_plugins=settings.entry_point_plugins
    )
    log.info("plugins loaded: %s", ", ".join(loaded) or "none")
    scheduler = _configured_scheduler(settings)  # checked before sandboxes are made for nothing
    try:
        pool = make_sandbox_pool(settings)
    except TypeError as exc:
        options = settings.provider_options()
        if not options:
            raise
        # The provider's constructor refused them: name what was given and where to read what it takes.
        raise ValueError(
            f"sandbox options {', '.join(sorted(options))} of provider {settings.sandbox_provider!r}: "
            f"{exc} (each provider's options: docs/sandboxes.md)"
        ) from None
    orchestrator = build(settings, scheduler=scheduler, sandbox_pool=pool)
    from tangram_env.server.ray_backend import attach_ray

    ray_backend = attach_ray(settings, orchestrator)  # before our signal handlers: ray.init sets its own
    orchestrator.install_signal_handlers()
    workers = start_local_workers(settings, orchestrator.address)
    if ready_fd is not None:
        os.write(ready_fd, f"{orchestrator.address}\n".encode())
        os.close(ready_fd)
    raise_control_plane(settings.loop_nice)  # on the loop's own thread, which serves below
    try:
        orchestrator.serve_forever()
    finally:
        if ray_backend is not None:
            ray_backend.close()
        for worker in workers:
            worker.stop()
    return 0


def _configured_scheduler(settings: ServerSettings) -> Scheduler:
    """The scheduling policy with its options; a wrong option is one line naming it."""
    from pydantic import ValidationError

    from tangram_env.server.resources import make_configured_scheduler
    from tangram_env.server.scheduler import DEFAULT_SCHEDULER

    name = settings.scheduler or DEFAULT_SCHEDULER
    try:
        scheduler: Scheduler = make_configured_scheduler(settings)
    except (ValidationError, TypeError) as exc:
        raise ValueError(
            f"scheduler options of the {name!r} scheduler (--scheduler-option, scheduler_options): "
            f"{describe_settings_error(exc)}"
        ) from None
    return scheduler


def _image(argv: list[str]) -> int:
    from tangram_env.server.sandbox.cli import image_main

    return image_main(argv)


def _stats(argv: list[str]) -> int:
    from tangram_env.server.stats_view import stats_main

    return stats_main(argv)


def _keygen(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="tangram-server keygen",
        description="Create a CurveZMQ key pair for the orchestrator (or a client).",
    )
    p.add_argument("directory")
    p.add_argument("--name", default="server", help="file name stem (default server)")
    p.add_argument(
        "--force", action="store_true", help="replace an existing key pair of that name (its peers then fail)"
    )
    args = p.parse_args(argv)
    from tangram_env.server.security import keygen, read_public_key

    try:
        public, secret = keygen(args.directory, args.name, force=args.force)
    except (OSError, ValueError) as exc:
        print(f"tangram-server keygen: {exc}", file=sys.stderr)
        return 1
    print(f"secret key: {secret}  (give it to tangram-server --curve-secret-key-file)")
    print(f"public key: {public}")
    print(f"clients and workers: TANGRAM_CURVE_SERVER_KEY={read_public_key(str(public))}")
    return 0


#: ``tangram-server SUBCOMMAND ...``; anything else runs the orchestrator.
_SUBCOMMANDS = {"image": _image, "stats": _stats, "keygen": _keygen}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tangram-server``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _SUBCOMMANDS:
        return _SUBCOMMANDS[argv[0]](argv[1:])
    args = _serve_parser().parse_args(argv)
    # A launcher waits on --ready-fd: whatever stops the start is told there at once (launch.py).
    pipe_inode = _inode(args.ready_fd)
    level = logging.getLevelName(args.log_level.upper())
    if not isinstance(level, int):
        problem = f"--log-level {args.log_level}: not a level; use DEBUG, INFO, WARNING, ERROR or CRITICAL"
        print(f"tangram-server: {problem}", file=sys.stderr)
        report_start_failure(args.ready_fd, pipe_inode, problem)
        return 2
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(args)  # first: a mistake is the only line a user sees
    except Exception as exc:
        problem = describe_settings_error(exc)  # one line naming the setting, not pydantic's block
        print(f"tangram-server: invalid settings: {problem}", file=sys.stderr)
        report_start_failure(args.ready_fd, pipe_inode, f"invalid settings: {problem}")
        return 2
    from tangram_env.server.sandbox.procrun import default_signals_for_children, raise_open_file_limit

    reset = default_signals_for_children()  # before any thread starts
    if reset:
        log.info("sandbox commands start with these signals at their defaults: %s", ", ".join(reset))
    log.debug("open files: up to %d", raise_open_file_limit())
    try:
        return serve(settings, args.ready_fd)
    except Exception as exc:
        log.error("cannot start: %s", describe_settings_error(exc))  # one line, even pydantic's
        report_start_failure(
            args.ready_fd, pipe_inode, f"{type(exc).__name__}: {describe_settings_error(exc)}"
        )
        if isinstance(exc, PermissionError | ImportError | OSError | ValueError | TangramError):
            return 1
        raise


def _inode(fd: int | None) -> int | None:
    try:
        return None if fd is None else os.fstat(fd).st_ino
    except OSError:
        return None
