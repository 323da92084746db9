"""Encoding of protocol messages as one ZeroMQ frame: ``version | len(type) | type | body``.

The version is one unsigned byte, then one byte giving the length of the type (the message's ``kind``
in ASCII), the type, and the body in msgpack. One frame rather than one per part: every extra frame
costs a few microseconds on each side, and a no-op action's round trip is only a few times ZeroMQ's.
Sizes are checked before anything is decoded, so a hostile peer cannot make us parse a huge body.
"""

from __future__ import annotations

from typing import Any

import msgpack
from pydantic import BaseModel, ValidationError

from tangram_env.errors import ProtocolError, describe_validation_error
from tangram_env.protocol import MESSAGE_TYPES, PROTOCOL_VERSION

#: Default largest body accepted (bytes); the orchestrator's setting overrides it.
DEFAULT_MAX_BODY = 16 * 2**20
_MODELS = {kind.encode(): model for kind, model in MESSAGE_TYPES.items()}
_pack = msgpack.Packer(use_bin_type=True).pack
_NOT_IN_BODY = {"kind"}


def frame(kind: bytes, body: bytes, version: int = PROTOCOL_VERSION) -> bytes:
    """A frame assembled from its parts, valid or not (for tools and tests that craft frames)."""
    return bytes([version, len(kind)]) + kind + body


_HEADERS = {kind: frame(kind.encode(), b"") for kind in MESSAGE_TYPES}  # made once: encode is hot


def encode(message: BaseModel) -> bytes:
    """The frame holding ``message`` (its ``kind`` field travels in the header, not the body).

    Fields left at their defaults are not sent (the receiver's model fills them in): smaller bodies
    pack, unpack and validate faster on both sides.
    """
    kind: str = message.kind  # type: ignore[attr-defined]
    return _HEADERS[kind] + _pack(
        message.model_dump(mode="python", exclude=_NOT_IN_BODY, exclude_defaults=True)
    )


def decode(frame: bytes, max_body: int = DEFAULT_MAX_BODY) -> BaseModel:
    """The message held by ``frame``, or :class:`ProtocolError` saying what is wrong."""
    if len(frame) < 3 or len(frame) < 2 + frame[1]:
        raise ProtocolError("bad_frames", "a frame is version, type length, type and body")
    if frame[0] != PROTOCOL_VERSION:
        raise ProtocolError(
            "bad_version",
            f"protocol version {frame[0]} is not supported (this peer speaks {PROTOCOL_VERSION})",
        )
    start = 2 + frame[1]
    if len(frame) - start > max_body:
        raise ProtocolError(
            "too_large", f"body of {len(frame) - start} bytes exceeds the limit of {max_body} bytes"
        )
    kind = frame[2:start]
    model = _MODELS.get(kind)
    if model is None:
        raise ProtocolError("unknown_type", f"unknown message type {kind!r}")
    try:
        fields: Any = msgpack.unpackb(memoryview(frame)[start:], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        # Some of msgpack's errors carry no text (StackError: nested too deep; FormatError): name them.
        raise ProtocolError("bad_body", f"body is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(fields, dict):
        raise ProtocolError("bad_body", f"body must be a map, got {type(fields).__name__}")
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        raise ProtocolError(
            "bad_schema", f"invalid {model.__name__}: {describe_validation_error(exc)}"
        ) from None


def decode_frames(frames: list[bytes], max_body: int = DEFAULT_MAX_BODY) -> BaseModel:
    """Like :func:`decode`, for a multipart message as received (exactly one frame is legal)."""
    if len(frames) != 1:
        raise ProtocolError("bad_frames", f"a message is one frame, got {len(frames)}")
    return decode(frames[0], max_body)
