"""``tangram-server``: run the orchestrator in the foreground, or manage sandbox images.

tangram-server --bind tcp://127.0.0.1:5555 --plugin mypkg.tools
tangram-server image build NAME [--from DIR] [--requirements FILE]
tangram-server stats --address tcp://127.0.0.1:5555
tangram-server keygen DIR
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from tangram_env.server.config import RaySettings, ServerSettings

log = logging.getLogger("tangram_env.server")


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tangram-server", description="Run the Tangram orchestrator.")
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
    """Flags over environment over defaults: resolved once, here."""
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
    if args.ray is not None:
        fields["ray"] = RaySettings(address=args.ray)
    return ServerSettings(**fields)


def serve(settings: ServerSettings, ready_fd: int | None = None) -> int:
    """Load plugins, start the orchestrator and serve until SIGINT/SIGTERM."""
    import os

    from tangram_env.server import builtin_tools  # noqa: F401  (registers noop, echo, sleep)
    from tangram_env.server.orchestrator import Orchestrator
    from tangram_env.server.plugins import load_plugins
    from tangram_env.server.resources import make_sandbox_pool, start_local_workers

    loaded = load_plugins(
        settings.plugins, settings.plugin_files, entry_point_plugins=settings.entry_point_plugins
    )
    log.info("plugins loaded: %s", ", ".join(loaded) or "none")
    pool = make_sandbox_pool(settings)
    orchestrator = Orchestrator(settings, sandbox_pool=pool)
    from tangram_env.server.ray_backend import attach_ray

    ray_backend = attach_ray(settings, orchestrator)  # before our signal handlers: ray.init sets its own
    orchestrator.install_signal_handlers()
    workers = start_local_workers(settings, orchestrator.address)
    if ready_fd is not None:
        os.write(ready_fd, f"{orchestrator.address}\n".encode())
        os.close(ready_fd)
    try:
        orchestrator.serve_forever()
    finally:
        if ray_backend is not None:
            ray_backend.close()
        for proc in workers:
            proc.terminate()
        for proc in workers:
            try:
                proc.wait(timeout=5)
            except Exception:
                proc.kill()
    return 0


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
    args = p.parse_args(argv)
    from tangram_env.server.security import keygen, read_public_key

    public, secret = keygen(args.directory, args.name)
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
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = settings_from_args(args)
    except Exception as exc:
        print(f"tangram-server: invalid settings: {exc}", file=sys.stderr)
        return 2
    try:
        return serve(settings, args.ready_fd)
    except (PermissionError, ImportError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return 1
