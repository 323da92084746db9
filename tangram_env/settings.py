"""Client-side settings, resolved once from keyword arguments and ``TANGRAM_*`` environment variables."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tangram_env.errors import SettingsError
from tangram_env.units import Bytes, Seconds


class ClientSettings(BaseSettings):
    """How a client finds and talks to the orchestrator. Every field reads ``TANGRAM_<NAME>`` too."""

    model_config = SettingsConfigDict(env_prefix="TANGRAM_", extra="ignore")

    address: str | None = Field(
        None, description="orchestrator address (e.g. tcp://127.0.0.1:5555); unset: start an embedded one"
    )
    connect_timeout_s: Seconds = Field(
        15.0, gt=0, description="how long to wait for the orchestrator's first answer"
    )
    heartbeat_s: Seconds = Field(1.0, gt=0, description="heartbeat interval while actions are outstanding")
    server_timeout_s: Seconds = Field(
        30.0, gt=0, description="silence after which outstanding actions fail with ServerUnavailable"
    )
    max_body: Bytes = Field(
        16 * 2**20, gt=0, description="largest message body accepted from the orchestrator"
    )
    curve_server_key: str | None = Field(
        None, description="server's CurveZMQ public key (z85), if it uses one"
    )
    retries: dict[str, int] = Field(
        default_factory=lambda: {"sandbox_died": 1},
        description="failure type -> how many times an action is retried (as a new attempt) before failing; "
        'JSON in the environment, e.g. {"sandbox_died": 1}',
    )
    busy_backoff_s: Seconds = Field(
        0.05, gt=0, description="first wait before resubmitting what the server was too busy for"
    )

    @field_validator("curve_server_key")
    @classmethod
    def _a_public_key(cls, value: str | None) -> str | None:
        from tangram_env.curve import check_public_key

        return None if value is None else str(check_public_key(value))

    @field_validator("address")
    @classmethod
    def _known_transport(cls, value: str | None) -> str | None:
        # Empty is unset (TANGRAM_ADDRESS= in a shell or a container's environment).
        return None if value is None or not value.strip() else check_address(value)

    @classmethod
    def resolve(cls, **overrides: Any) -> ClientSettings:
        """The settings from ``overrides`` and the environment; a bad value is a
        :class:`~tangram_env.errors.SettingsError` that names its variable, what it takes and what was
        given, rather than pydantic's block.
        """
        try:
            return cls(**overrides)
        except ValidationError as exc:
            parts = []
            for error in exc.errors(include_url=False):
                name = str(error["loc"][0]) if error["loc"] else ""
                field = cls.model_fields.get(name)
                where = f"{name} (TANGRAM_{name.upper()})" if name not in overrides else name
                what = f" ({field.description})" if field is not None and field.description else ""
                message = error["msg"].removeprefix("Value error, ")
                got = "" if error["type"] == "value_error" else f" (got {error.get('input')!r})"
                parts.append(f"{where}{what}: {message}{got}")
            raise SettingsError("; ".join(parts)) from None


#: The ZeroMQ transports an orchestrator's address may use (the server's bind address too).
TRANSPORTS = ("tcp://", "ipc://", "inproc://")


def check_address(address: str) -> str:
    """``address`` if ZeroMQ can connect to it (a :class:`~tangram_env.errors.SettingsError` naming
    the transports otherwise).
    """
    if not address.startswith(TRANSPORTS):
        raise SettingsError(
            f"orchestrator address {address!r} must start with tcp://, ipc:// or inproc:// "
            "(tcp://HOST:PORT for a tangram-server)"
        )
    if address.startswith("tcp://"):  # ZeroMQ takes a bad port and retries it for good, silently
        host, _, port = address[len("tcp://") :].rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise SettingsError(
                f"orchestrator address {address!r} is not tcp://HOST:PORT with a port of 1-65535"
            )
    return address
