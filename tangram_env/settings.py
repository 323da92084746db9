"""Client-side settings, resolved once from keyword arguments and ``TANGRAM_*`` environment variables."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

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
        description="failure type -> how many times an action is retried (as a new attempt) before failing",
    )
    busy_backoff_s: Seconds = Field(
        0.05, gt=0, description="first wait before resubmitting what the server was too busy for"
    )
