"""API quotas as a scheduled resource: a token bucket and an in-flight cap per API key.

Web-search and browsing APIs limit each key to a request rate (with a burst) and to a number of
requests in flight, and answer 429 with ``Retry-After`` beyond that. Limiting each trainer on its own
either collides (several trainers share a key) or leaves quota idle (a static split), so the
scheduler holds the quota for the whole cluster: an action that declares an API starts only when one
of that API's keys has a token and a free slot; the token is taken at the grant, the slot freed when
the action ends, and the key's name travels with the grant (its secret stays on the workers). A key
that still answers 429 pauses until its ``Retry-After``. Pure bookkeeping with a caller-given ``now``,
like the rest of the scheduler; an API with no quota configured is unlimited.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

_EPS = 1e-9  # a token counts as whole this close to 1 (refills add floats)


class ApiQuota(BaseModel):
    """The limits of one API, the same for each of its keys (a provider's plan is per key)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Finite: an infinite rate or burst would mean no limit, which is leaving the API out.
    rate: float = Field(gt=0, allow_inf_nan=False, description="requests per second each key may make")
    burst: float | None = Field(
        None,
        ge=1,
        allow_inf_nan=False,
        description="requests a key may make at once after idling (default: max(1, rate))",
    )
    max_in_flight: int | None = Field(
        None, ge=1, description="requests a key may have in flight at once (None: no cap)"
    )
    keys: list[str] = Field(
        default_factory=lambda: ["default"],
        min_length=1,
        description="key names (the workers map each name to its secret; names travel, secrets never)",
    )

    @model_validator(mode="after")
    def _distinct_keys(self) -> ApiQuota:
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"key names must be distinct, got {self.keys}")
        return self

    @property
    def bucket_size(self) -> float:
        """Tokens a key holds when full."""
        return self.burst if self.burst is not None else max(1.0, self.rate)


class QuotaConfig(BaseModel):
    """API name -> its quota. An API that actions declare but that is not listed here is unlimited."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    apis: dict[str, ApiQuota] = Field(default_factory=dict, description="API name -> limits and keys")


def parse_quota(text: str) -> tuple[str, ApiQuota]:
    """Read ``API:rate=20,burst=5,in_flight=4,keys=a+b`` (the ``--quota`` flag) into a quota.

    Raises ValueError naming the part it could not read, a field given twice, or the field whose value
    is out of bounds.
    """
    api, sep, rest = text.partition(":")
    if not sep or not api.strip():
        raise ValueError(f"quota {text!r}: expected API:rate=N[,burst=N][,in_flight=N][,keys=a+b]")
    fields: dict[str, Any] = {}
    names = {"rate": "rate", "burst": "burst", "in_flight": "max_in_flight", "keys": "keys"}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq or key.strip() not in names:
            raise ValueError(f"quota {text!r}: cannot read {part!r}; fields are {', '.join(names)}")
        field = names[key.strip()]
        if field in fields:  # rate=1,rate=2: which one was meant?
            raise ValueError(f"quota {text!r}: {key.strip()} is given twice")
        fields[field] = [k for k in value.split("+") if k] if field == "keys" else value
    try:
        return api.strip(), ApiQuota(**fields)
    except ValidationError as exc:
        from tangram_env.server.config import describe_settings_error  # config imports this module

        raise ValueError(f"quota {text!r}: {describe_settings_error(exc)}") from None


class _Key:
    """One API key's bucket, in-flight count, pause and counters."""

    __slots__ = (
        "burst",
        "granted",
        "in_flight",
        "max_in_flight",
        "name",
        "paused_until",
        "rate",
        "stamp",
        "throttled",
        "tokens",
    )

    def __init__(self, name: str, quota: ApiQuota, now: float) -> None:
        self.name = name
        self.rate, self.burst = quota.rate, quota.bucket_size
        self.max_in_flight = quota.max_in_flight
        self.tokens, self.stamp = self.burst, now
        self.in_flight = 0
        self.paused_until = float("-inf")
        self.granted = 0  # tokens taken (requests granted), for stats
        self.throttled = 0  # 429s the API answered anyway

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + self.rate * (now - self.stamp))
            self.stamp = now

    def ready(self, now: float) -> bool:
        return (
            now >= self.paused_until
            and self.tokens >= 1.0 - _EPS
            and (self.max_in_flight is None or self.in_flight < self.max_in_flight)
        )

    def ready_at(self) -> float | None:
        """When this key can next grant, with no other event (None: only a finishing request frees it)."""
        if self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
            return None
        token_at = self.stamp + max(0.0, 1.0 - _EPS - self.tokens) / self.rate  # as ready() counts
        return max(token_at, self.paused_until)


class ApiQuotas:
    """Every configured API's keys, as the scheduler books them."""

    def __init__(self, config: QuotaConfig | None = None) -> None:
        self.config = config or QuotaConfig()
        self._keys: dict[str, dict[str, _Key]] = {}
        self.starved: set[str] = set()  # APIs whose actions found no ready key this round

    def limited(self, api: str | None) -> bool:
        """Whether actions of ``api`` pass through a quota (an unlisted API is unlimited)."""
        return api is not None and api in self.config.apis

    def _api(self, api: str, now: float) -> dict[str, _Key]:
        keys = self._keys.get(api)
        if keys is None:
            quota = self.config.apis[api]
            keys = self._keys[api] = {name: _Key(name, quota, now) for name in quota.keys}
        for k in keys.values():
            k.refill(now)
        return keys

    def pick(self, api: str, now: float) -> str | None:
        """The key an action of ``api`` would use now (most tokens, then fewest in flight), or None."""
        best: _Key | None = None
        for k in self._api(api, now).values():
            if k.ready(now) and (best is None or (k.tokens, -k.in_flight) > (best.tokens, -best.in_flight)):
                best = k
        if best is None:
            self.starved.add(api)
            return None
        return best.name

    def grants_now(self, api: str, now: float) -> int:
        """How many actions of ``api`` its keys could start now (tokens, within their in-flight caps)."""
        total = 0
        for k in self._api(api, now).values():
            if now >= k.paused_until:
                room = int(k.tokens + _EPS)
                if k.max_in_flight is not None:
                    room = min(room, k.max_in_flight - k.in_flight)
                total += max(0, room)
        return total

    def take(self, api: str, key: str, now: float) -> None:
        """Book a request granted on ``key``: one token taken, one slot held."""
        k = self._api(api, now)[key]
        k.tokens -= 1.0
        k.in_flight += 1
        k.granted += 1

    def release(self, api: str, key: str) -> None:
        """The request on ``key`` ended (any outcome): its slot is free. Its token stays spent."""
        k = self._keys[api][key]
        k.in_flight = max(0, k.in_flight - 1)

    def throttled(self, api: str, key: str, until: float, now: float) -> None:
        """The API answered 429 on ``key``: no grant on it before ``until`` (its ``Retry-After``)."""
        k = self._api(api, now)[key]
        k.throttled += 1
        k.paused_until = max(k.paused_until, until)
        k.tokens = min(k.tokens, 0.0)  # the provider's window says we are at its limit

    def new_round(self) -> bool:
        """Forget which APIs starved (dispatch asks again); True when some did since the last round."""
        had = bool(self.starved)
        self.starved.clear()
        return had

    def next_wakeup(self) -> float | None:
        """When a starved API's key can next grant (None: none starves, or only a finish frees one)."""
        times = [k.ready_at() for api in self.starved for k in self._keys.get(api, {}).values()]
        known = [t for t in times if t is not None]
        return min(known) if known else None

    def validate(self) -> None:
        """Assert that no key holds more tokens than its burst or more requests than its cap."""
        for api, keys in self._keys.items():
            for k in keys.values():
                assert k.tokens <= k.burst + 1e-9, f"{api}/{k.name}: {k.tokens} tokens over burst {k.burst}"
                assert k.in_flight >= 0, f"{api}/{k.name}: negative in-flight count"
                assert k.max_in_flight is None or k.in_flight <= k.max_in_flight, (
                    f"{api}/{k.name}: {k.in_flight} in flight over its cap {k.max_in_flight}"
                )

    def in_flight(self, api: str) -> dict[str, int]:
        """Requests in flight per key of ``api``."""
        return {name: k.in_flight for name, k in self._keys.get(api, {}).items()}

    def snapshot(self, now: float, waiting: dict[str, int] | None = None) -> dict[str, Any]:
        """Per API: each key's tokens, in flight, granted, 429s and pause; and actions waiting."""
        out: dict[str, Any] = {}
        for api in self.config.apis:
            keys = self._api(api, now)
            out[api] = {
                "waiting": (waiting or {}).get(api, 0),
                "in_flight": sum(k.in_flight for k in keys.values()),
                "granted": sum(k.granted for k in keys.values()),
                "throttled": sum(k.throttled for k in keys.values()),
                "keys": {
                    k.name: {
                        "tokens": round(k.tokens, 3),
                        "in_flight": k.in_flight,
                        "granted": k.granted,
                        "throttled": k.throttled,
                        "paused_s": round(max(0.0, k.paused_until - now), 3),
                    }
                    for k in keys.values()
                },
            }
        return out
