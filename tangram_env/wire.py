"""Encoding of protocol messages as ZeroMQ multipart frames: ``[version][type][body]``.

The version is one unsigned byte, the type the message's ``kind`` in ASCII, the body msgpack. Sizes are
checked before anything is decoded, so a hostile peer cannot make us parse a huge body.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
from pydantic import BaseModel, ValidationError

from tangram_env.errors import ProtocolError, describe_validation_error
from tangram_env.protocol import MESSAGE_TYPES, PROTOCOL_VERSION

#: Default largest body accepted (bytes); the orchestrator's setting overrides it.
DEFAULT_MAX_BODY = 16 * 2**20
_VERSION_FRAME = bytes([PROTOCOL_VERSION])


def encode(message: BaseModel) -> list[bytes]:
    """The frames ``[version, type, body]`` for ``message`` (the ``kind`` field travels as ``type``)."""
    body = message.model_dump(mode="python", exclude={"kind"})
    kind: str = message.kind  # type: ignore[attr-defined]
    return [_VERSION_FRAME, kind.encode(), msgpack.packb(body, use_bin_type=True)]


def decode(frames: Sequence[bytes], max_body: int = DEFAULT_MAX_BODY) -> BaseModel:
    """The message held by ``[version, type, body]``, or :class:`ProtocolError` saying what is wrong."""
    if len(frames) != 3:
        raise ProtocolError("bad_frames", f"expected 3 frames [version, type, body], got {len(frames)}")
    version, kind, body = frames
    if len(version) != 1:
        raise ProtocolError("bad_frames", "the version frame must be one byte")
    if version[0] != PROTOCOL_VERSION:
        raise ProtocolError(
            "bad_version",
            f"protocol version {version[0]} is not supported (this peer speaks {PROTOCOL_VERSION})",
        )
    if len(body) > max_body:
        raise ProtocolError("too_large", f"body of {len(body)} bytes exceeds the limit of {max_body} bytes")
    model = MESSAGE_TYPES.get(kind.decode("ascii", "replace"))
    if model is None:
        raise ProtocolError("unknown_type", f"unknown message type {kind[:64]!r}")
    try:
        fields: Any = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError("bad_body", f"body is not valid msgpack: {exc}") from None
    if not isinstance(fields, dict):
        raise ProtocolError("bad_body", f"body must be a map, got {type(fields).__name__}")
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        raise ProtocolError(
            "bad_schema", f"invalid {model.__name__}: {describe_validation_error(exc)}"
        ) from None
