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
from tangram_env.protocol import MESSAGE_TYPES, PROTOCOL_VERSION, Result, Results

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


def body_size(frame: bytes) -> int:
    """The length of ``frame``'s body (what ``max_body`` limits)."""
    return len(frame) - 2 - frame[1]


def encode_within(message: BaseModel, field: str, max_body: int) -> tuple[list[bytes], list[tuple[Any, str]]]:
    """``message`` as frames whose bodies fit ``max_body``, and the items of its list ``field``
    (actions, results) that cannot travel, each with why.

    The receiver drops a body over its limit whole, ids and all, so one huge item would take every
    item packed with it. Usually the message fits and this costs one encode; otherwise its items are
    halved until each part fits, in order, and an item that does not fit alone (or does not encode:
    a lone surrogate in a string) is refused, never the others.
    """
    try:
        data = encode(message)
        if body_size(data) <= max_body:
            return [data], []
    except (ValueError, TypeError, OverflowError):  # msgpack's refusals: found again below, item by item
        pass
    frames: list[bytes] = []
    refused: list[tuple[Any, str]] = []

    def place(part: list[Any]) -> None:
        try:
            packed = encode(message.model_copy(update={field: part}))
        except (ValueError, TypeError, OverflowError) as exc:
            why = f"it does not encode ({type(exc).__name__}: {exc})"
        else:
            if body_size(packed) <= max_body:
                frames.append(packed)
                return
            why = f"it packs to {body_size(packed)} bytes, over a message's limit of {max_body} (max_body)"
        if len(part) == 1:
            refused.append((part[0], why))
            return
        place(part[: len(part) // 2])
        place(part[len(part) // 2 :])

    items = getattr(message, field)
    if len(items) > 1:
        place(items[: len(items) // 2])
        place(items[len(items) // 2 :])
    else:
        place(items)
    return frames, refused


def frames(message: BaseModel, max_body: int) -> list[bytes]:
    """``message`` as the frames to send: Results split to fit ``max_body`` (the receiver drops a body
    over its limit whole, every id in it), any other message as one frame.
    """
    return results_frames(message, max_body) if type(message) is Results else [encode(message)]


def results_frames(message: Results, max_body: int) -> list[bytes]:
    """``message`` as Results messages within ``max_body``; a result too large to send goes as a
    failure that says so (the action's caller waits for nothing that cannot arrive).
    """
    frames, refused = encode_within(message, "results", max_body)
    if refused:
        failures = [
            Result.failure(
                r.action_id,
                "error",
                f"the action's result cannot be sent: {why}; return less, or leave bulk data in the "
                "sandbox's files (or shared storage) and return where it is",
                timing=r.timing,
                parallelism=r.parallelism,
                worker=r.worker,
            )
            for r, why in refused
        ]
        frames += encode_within(Results(results=failures), "results", max_body)[0]
    return frames
