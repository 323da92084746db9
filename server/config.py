"""Orchestrator settings: resolved once at the edge, flags over ``TANGRAM_SERVER_*`` (and
``TANGRAM_RAY_*``) variables over a settings file (TOML or JSON, ``--config``) over defaults, tables
merged key by key, then passed down: the scheduler's options
(its :class:`~tangram_env.server.scheduler.PolicyConfig`), the sandbox provider's options, and the
:class:`~tangram_env.sandbox.SandboxSpec` of each image's sandboxes.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from tangram_env.sandbox import SandboxSpec
from tangram_env.server.scheduler.quotas import QuotaConfig
from tangram_env.server.scheduler.sandbox_memory import SandboxMemory
from tangram_env.settings import TRANSPORTS
from tangram_env.units import Bytes, MiB, Seconds, parse_size_mb

log = logging.getLogger(__name__)

#: Not SandboxSpec fields: read from ``sandbox_spec`` and ``sandbox_images`` tables by the server.
_SERVER_SIDE_SPEC_FIELDS = ("reserve_mb",)


def _total_mem_mb() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20)
    except (ValueError, OSError):
        return 4096


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class RaySettings(BaseSettings):
    """Attaching to a Ray cluster (``tangram-server --ray``). Each field also reads ``TANGRAM_RAY_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="TANGRAM_RAY_", extra="forbid")

    address: str | None = Field(
        None, description="Ray cluster to attach to: auto, ray://HOST:PORT, HOST:PORT, local; unset: no Ray"
    )
    namespace: str = Field("tangram", description="Ray namespace of the worker actors")
    runtime_env: dict[str, Any] | None = Field(
        None, description="Ray runtime environment of the worker actors (pip, py_modules, env_vars ...)"
    )
    node_resource: str | None = Field(
        None, description="only nodes that declare this custom Ray resource get a worker; unset: every node"
    )
    reserve_cpu: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="cores per node left to other Ray work"
    )
    reserve_mem: MiB = Field(0, ge=0, description="memory per node left to other Ray work")
    reserve_gpu: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="GPUs per node left to other Ray work"
    )
    max_restarts: int = Field(-1, ge=-1, description="restarts Ray gives a crashed worker actor (-1: always)")
    poll_s: Seconds = Field(1.0, gt=0, description="how often Ray's node table is read")
    autoscale: bool = Field(
        True, description="ask Ray's autoscaler for nodes when the queue outgrows the pool"
    )
    scale_up_after_s: Seconds = Field(
        5.0,
        ge=0,
        description="queued demand must exceed free capacity this long before a request (0: at once)",
    )
    release_after_s: Seconds = Field(
        60.0, ge=0, description="an idle pool releases its request after this long"
    )
    max_cpus: float = Field(
        1024.0, ge=0, allow_inf_nan=False, description="most CPUs a request asks for (the pool included)"
    )
    max_gpus: float = Field(
        64.0, ge=0, allow_inf_nan=False, description="most GPUs a request asks for (the pool included)"
    )


class ServerSettings(BaseSettings):
    """Everything the orchestrator needs to start. Each field also reads ``TANGRAM_SERVER_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="TANGRAM_SERVER_", extra="forbid")

    bind: str = Field("tcp://127.0.0.1:5555", description="ZeroMQ address clients and workers connect to")
    plugins: list[str] = Field(
        default_factory=list, description="modules to import for tools and reward models"
    )
    plugin_files: list[str] = Field(default_factory=list, description="script files imported as plugins")
    entry_point_plugins: bool = Field(True, description="also import the `tangram_env.plugins` entry points")
    cpus: float = Field(
        default_factory=_usable_cpus, gt=0, allow_inf_nan=False, description="cores the local executor lends"
    )
    mem_mb: MiB = Field(
        default_factory=lambda: int(_total_mem_mb() * 0.8), gt=0, description="memory it lends"
    )
    scheduler: str = Field("", description="scheduling policy; empty: the default policy")
    max_body: Bytes = Field(
        16 * 2**20, gt=0, description="largest message body accepted (checked before decoding)"
    )
    result_ttl_s: Seconds = Field(600.0, gt=0, description="unacknowledged results are kept this long")
    worker_timeout_s: Seconds = Field(10.0, gt=0, description="a worker silent this long is declared lost")
    sandbox_provider: str = Field(
        "local", description="sandbox provider: local (isolated), e2b, docker, none, or a declared one"
    )
    sandbox_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="options per sandbox provider, by name (e.g. docker: {images: {...}, pull: true}); "
        "only the selected provider's are used",
    )
    sandbox_spec: dict[str, Any] = Field(
        default_factory=dict,
        description="SandboxSpec fields every sandbox gets (mem_mb, disk_mb, max_pids, network, ...), "
        "and reserve_mb: the memory the scheduler lends each live sandbox from its session's first "
        "action to its close (default: 1/8 of mem_mb; none for a remote provider such as e2b)",
    )
    sandbox_images: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="SandboxSpec fields per image name, over sandbox_spec"
    )
    sandbox_busy_wait_s: Seconds = Field(
        0.5, gt=0, description="first wait before retrying an action whose sandbox provider was at capacity"
    )
    sandbox_busy_max_wait_s: Seconds = Field(15.0, gt=0, description="longest wait between those retries")
    sandbox_busy_tries: int = Field(
        12, ge=0, description="refusals in a row before such an action fails (an infrastructure failure)"
    )
    scheduler_options: dict[str, Any] = Field(
        default_factory=dict,
        description="options of the scheduling policy: for elastic, fcfs and task_isolated the "
        "PolicyConfig fields (age_rate, elastic, cpu_headroom, ...)",
    )
    loop_nice: int = Field(
        -10,
        ge=-20,
        le=19,
        description="niceness of the orchestrator's loop and ZeroMQ I/O threads, so that they run ahead "
        "of the commands they dispatch on shared cores (below 0 needs root or CAP_SYS_NICE; else unchanged)",
    )
    config: str | None = Field(None, description="settings file (TOML or JSON) read under the flags")
    gpu_worker: bool = Field(True, description="start a local reward-model worker when reward models exist")
    gpu_stuck_after_s: Seconds = Field(
        300.0,
        gt=0,
        description="the local reward-model worker exits (and is started afresh) once a device has stayed "
        "in a model's code this long past the time limit of the last request it serves",
    )
    state_db: str | None = Field(
        None, description="SQLite file that keeps the queue and results across restarts"
    )
    max_queued_per_client: int = Field(
        20_000, ge=1, description="outstanding actions per client before 'busy'"
    )
    max_unacked_per_client: int = Field(
        100_000,
        ge=1,
        description="results one client holds unacknowledged before its new actions get 'busy' (clients "
        "acknowledge within milliseconds; one that never does would hold memory until result_ttl_s)",
    )
    max_sessions_per_client: int | None = Field(
        None,
        ge=1,
        description="live sandbox sessions one client (with the asyncio clients made from it) may hold; "
        "an action that would open one more is rejected as session_limit (None: no limit)",
    )
    max_retries: int = Field(2, ge=0, description="times an action is requeued after its worker is lost")
    client_timeout_s: Seconds = Field(
        60.0, gt=0, description="a client silent this long has its queued work cancelled"
    )
    session_idle_s: Seconds = Field(
        3600.0,
        ge=0,
        description="a sandbox session with no action queued or running for this long is ended and its "
        "sandbox freed, though its client lives; its later actions fail as sandbox_died (0: never)",
    )
    warm_idle_s: Seconds = Field(
        60.0,
        ge=0,
        description="a warm sandbox the scheduler does not size the pool for (a remote worker's) is "
        "closed after idling this long",
    )
    curve_secret_key_file: str | None = Field(
        None, description="CurveZMQ secret key file (tangram-server keygen)"
    )
    curve_clients_dir: str | None = Field(None, description="public keys of the only clients to accept")
    worker_token: SecretStr | None = Field(
        None,
        description="a secret that workers must give to register (their TANGRAM_WORKER_TOKEN); None: any "
        "peer that can connect may register as a worker, receive actions and answer them",
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="serve Prometheus metrics on this port (0: any)"
    )
    parent_pid: int | None = Field(None, gt=0, description="exit when this process dies (embedded mode)")
    allow_remote: bool = Field(
        False, description="accept a non-loopback bind (CurveZMQ keys are still required)"
    )
    quotas: QuotaConfig = Field(
        default_factory=QuotaConfig,
        description="API quotas shared by every trainer: rate, burst, in-flight cap and keys per API "
        '(TANGRAM_SERVER_QUOTAS=\'{"apis": {"web-search": {"rate": 20, "keys": ["a"]}}}\')',
    )

    @model_validator(mode="after")
    def _quotas_need_an_action_level_scheduler(self) -> ServerSettings:
        if self.quotas.apis and self.scheduler == "trajectory_bound":
            raise ValueError(
                "API quotas are scheduled by the action-level policies (elastic, fcfs, task_isolated); "
                "the trajectory_bound baseline cannot enforce them: drop --quota or pick another --scheduler"
            )
        return self

    ray: RaySettings = Field(
        default_factory=RaySettings, description="Ray cluster to take workers from (docs/ray.md)"
    )

    @field_validator("bind")
    @classmethod
    def _known_transport(cls, value: str) -> str:
        if not value.startswith(TRANSPORTS):
            raise ValueError(f"bind address {value!r} must start with tcp://, ipc:// or inproc://")
        return value

    @model_validator(mode="after")
    def _specs_are_valid(self) -> ServerSettings:
        # Checked at start, so that a bad limit fails there rather than at the first sandbox.
        for image in ["default", *self.sandbox_images]:
            self.reserve_for_image(image)
        return self

    @model_validator(mode="after")
    def _host_network_admits_only_own_peers(self) -> ServerSettings:
        # A local sandbox with network shares the host's, loopback and this orchestrator included.
        if self.sandbox_provider != "local" or (self.worker_token and self.curve_clients_dir):
            return self
        images = [i for i in ["default", *self.sandbox_images] if self.spec_for_image(i).network]
        if images:
            raise ValueError(
                f"network = true (images {', '.join(map(repr, images))}) with the local sandbox provider: "
                "a local sandbox with network shares the host's, loopback included, so code in it can "
                "connect to this orchestrator, submit actions (grading ones too) or register as a worker "
                "and answer other trajectories' tests. Admit only your own peers (worker_token, and "
                "curve_secret_key_file with curve_clients_dir: see docs/cluster.md), or use the docker "
                "provider, whose containers have a network of their own"
            )
        return self

    def _image_fields(self, image: str) -> dict[str, Any]:
        return {**self.sandbox_spec, **self.sandbox_images.get(image, {}), "image": image}

    def spec_for_image(self, image: str) -> SandboxSpec:
        """The spec sandboxes of ``image`` get: defaults, then ``sandbox_spec``, then the image's own."""
        fields = self._image_fields(image)
        for name in _SERVER_SIDE_SPEC_FIELDS:
            fields.pop(name, None)
        try:
            return SandboxSpec(**fields)
        except ValidationError as exc:
            raise ValueError(
                f"sandbox settings for image {image!r}: {describe_settings_error(exc)}"
            ) from None

    def reserve_for_image(self, image: str) -> int:
        """MiB the ledger lends a live sandbox of ``image`` from its session's first action to its close.

        Its ``reserve_mb`` if set (in ``sandbox_spec`` or the image's table), else the idle footprint of
        :class:`~tangram_env.server.scheduler.sandbox_memory.SandboxMemory` (1/8 of its ``mem_mb``): what
        a sandbox keeps between commands (its files on a tmpfs, what it left running) is usually far
        below the limit of its commands, and reserving the whole limit would admit a few dozen sessions
        per host where hundreds idle in a few GiB. Set ``reserve_mb`` to ``mem_mb`` for a hard
        guarantee, to 0 to reserve nothing.
        """
        spec = self.spec_for_image(image)
        given = self._image_fields(image).get("reserve_mb")
        if given is None:
            return int(SandboxMemory(spec.mem_mb).idle_mb)
        try:
            reserve = parse_size_mb(given)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"sandbox settings for image {image!r}: reserve_mb: {exc}") from None
        if reserve < 0:
            raise ValueError(f"sandbox settings for image {image!r}: reserve_mb must be >= 0, got {given!r}")
        return reserve

    def provider_options(self) -> dict[str, Any]:
        """The options of the selected sandbox provider."""
        return dict(self.sandbox_options.get(self.sandbox_provider, {}))


def read_settings_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The settings in a TOML (``.toml``) or JSON file, as a dict (``ValueError`` naming the file)."""
    source = Path(path)
    try:
        text = source.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the settings file {source}: {exc}") from None
    try:
        if source.suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                raise ValueError("TOML settings files need Python 3.11+; use JSON") from None
            data: Any = tomllib.loads(text)
        else:
            data = json.loads(text)
    except ValueError as exc:
        raise ValueError(
            f"settings file {source} is not valid {source.suffix[1:] or 'JSON'}: {exc}"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"settings file {source} must hold a table of settings")
    return data


def describe_settings_error(exc: BaseException) -> str:
    """An invalid setting in one line: each error's setting (``ray.reserve_mem``), what is wrong with it
    and the value given, rather than pydantic's block of lines and links.
    """
    if not isinstance(exc, ValidationError):
        return str(exc)
    parts = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        given = error.get("input")
        # Our own checks (value_error) name the value already; a secret stays unsaid.
        said = error["type"] == "value_error" or isinstance(given, dict | list) or where == "worker_token"
        if where and not said:
            message += f" (got {given!r})"
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def _known_variables() -> list[str]:
    """Every variable a setting reads, the client's included: its ``server_timeout_s`` is
    ``TANGRAM_SERVER_TIMEOUT_S``, under our prefix on purpose and not a typo of ours.
    """
    from tangram_env.settings import ClientSettings

    return sorted(
        {f"TANGRAM_SERVER_{name.upper()}" for name in ServerSettings.model_fields}
        | {f"TANGRAM_RAY_{name.upper()}" for name in RaySettings.model_fields}
        | {f"TANGRAM_{name.upper()}" for name in ClientSettings.model_fields}
    )


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each ``TANGRAM_SERVER_*`` or ``TANGRAM_RAY_*`` variable that no setting reads (a
    typo such as ``TANGRAM_SERVER_WORKER_TIMEOUT`` would otherwise leave the default in force unsaid),
    naming the closest setting.
    """
    environ = os.environ if environ is None else environ
    known = _known_variables()
    warnings = []
    for name in sorted(environ):
        upper = name.upper()  # pydantic-settings reads them whatever their case
        if upper.startswith(("TANGRAM_SERVER_", "TANGRAM_RAY_")) and upper not in known:
            close = difflib.get_close_matches(upper, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            warnings.append(f"environment variable {name} is not a setting and is ignored{hint}")
    return warnings


def _from_environment() -> dict[str, Any]:
    """The settings that ``TANGRAM_SERVER_*`` and ``TANGRAM_RAY_*`` variables give, unvalidated (a JSON
    table decoded), so that they merge with the file and the flags key by key.
    """
    values = EnvSettingsSource(ServerSettings)()
    ray = EnvSettingsSource(RaySettings)()
    if ray:  # TANGRAM_SERVER_RAY's keys over these, as ServerSettings() itself reads them
        below = values.get("ray")
        values["ray"] = _merge(ray, below) if isinstance(below, dict) else (below or ray)
    return values


def _merge(below: dict[str, Any], above: dict[str, Any], path: tuple[str, ...] = ()) -> dict[str, Any]:
    """``above`` over ``below``, tables key by key at every level; but one API's quota is replaced whole
    (its burst or keys from a lower level would not fit the rate given above).
    """
    out = dict(below)
    for key, value in above.items():
        under, where = out.get(key), (*path, key)
        whole = len(where) == 3 and where[:2] == ("quotas", "apis")
        if isinstance(under, dict) and isinstance(value, dict) and not whole:
            out[key] = _merge(under, value, where)
        else:
            out[key] = value
    return out


def resolve_settings(flags: dict[str, Any]) -> ServerSettings:
    """Flags over ``TANGRAM_SERVER_*`` (and ``TANGRAM_RAY_*``) variables over the settings file
    (``config``) over defaults; a table (``ray``, ``quotas``, ``sandbox_spec``, ``scheduler_options``
    ...) given at several levels merges key by key, one API's quota replaced whole. Warns of variables
    under those prefixes that no setting reads.
    """
    for warning in unknown_variables():
        log.warning("%s", warning)
    # A model (RaySettings(...)) would bring its defaults along and hide the lower levels' keys.
    flags = {k: v.model_dump(exclude_unset=True) if isinstance(v, BaseModel) else v for k, v in flags.items()}
    from_env = _from_environment()
    path = flags.get("config") or from_env.get("config")
    from_file: dict[str, Any] = {}
    if path:
        from_file = read_settings_file(path)
        unknown = sorted(set(from_file) - set(ServerSettings.model_fields))
        if unknown:
            raise ValueError(f"settings file {path}: unknown settings {unknown}")
    merged = _merge(_merge(from_file, from_env), flags)
    if path:
        merged["config"] = str(path)
    if isinstance(merged.get("quotas"), dict):
        # Given as a model: as a table pydantic-settings would merge TANGRAM_SERVER_QUOTAS into it once
        # more, into the API entries that a higher level replaced.
        try:
            merged["quotas"] = QuotaConfig.model_validate(merged["quotas"])
        except ValidationError as exc:
            raise ValueError(f"quotas: {describe_settings_error(exc)}") from None
    return ServerSettings(**merged)
