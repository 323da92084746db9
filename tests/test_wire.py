from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tangram_env import wire
from tangram_env.errors import ProtocolError
from tangram_env.protocol import PROTOCOL_VERSION, Action, Demand, Elastic, Result, Results, Submit


def test_round_trip_keeps_every_field() -> None:
    msg = Submit(
        actions=[
            Action(
                kind="bash",
                payload={"cmd": "ls", "n": [1, 2]},
                trajectory_id="t",
                demand=Demand(cpu=2, mem_mb=10),
                elastic=Elastic(min_par=1, max_par=4),
                affinity="s",
                timeout_s=3.5,
                priority=2,
            )
        ]
    )
    assert wire.decode(wire.encode(msg)) == msg


def test_result_round_trip() -> None:
    msg = Results(results=[Result(action_id="a", ok=True, value={"x": b"bytes", "y": 1.5})])
    assert wire.decode(wire.encode(msg)) == msg


def test_a_message_is_one_frame_with_a_readable_type() -> None:
    data = wire.encode(Submit(actions=[Action(id="a", kind="noop")]))
    assert data[0] == PROTOCOL_VERSION and data[2 : 2 + data[1]] == b"submit"
    assert msgpack.unpackb(data[2 + data[1] :])["actions"][0]["id"] == "a"


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"", "bad_frames"),
        (b"\x01", "bad_frames"),
        (bytes([PROTOCOL_VERSION, 40]) + b"submit", "bad_frames"),
        (wire.frame(b"submit", b"\x80", version=PROTOCOL_VERSION + 1), "bad_version"),
        (wire.frame(b"launch_missiles", b"\x80"), "unknown_type"),
        (wire.frame(b"submit", b"\xc1\xc1"), "bad_body"),
        (wire.frame(b"submit", msgpack.packb([1, 2])), "bad_body"),
        (wire.frame(b"submit", msgpack.packb({"actions": []})), "bad_schema"),
        (wire.frame(b"submit", msgpack.packb({"actions": [{"kind": 5}]})), "bad_schema"),
        (wire.frame(b"submit", msgpack.packb({"actions": [{"kind": "x", "evil": 1}]})), "bad_schema"),
    ],
)
def test_malformed_frames_name_the_problem(data: bytes, code: str) -> None:
    with pytest.raises(ProtocolError) as info:
        wire.decode(data)
    assert info.value.code == code


def test_a_message_in_several_frames_is_refused() -> None:
    with pytest.raises(ProtocolError) as info:
        wire.decode_frames([bytes([PROTOCOL_VERSION]), b"submit", msgpack.packb({"actions": []})])
    assert info.value.code == "bad_frames"


def test_size_limit_is_checked_before_decoding() -> None:
    body = b"\xc1" * 2000  # not msgpack at all: the size check must fire first
    with pytest.raises(ProtocolError) as info:
        wire.decode(wire.frame(b"submit", body), max_body=1000)
    assert info.value.code == "too_large"


@given(st.lists(st.binary(max_size=64), max_size=5))
def test_random_frames_raise_protocol_error_only(frames: list[bytes]) -> None:
    try:
        wire.decode_frames(frames)
    except ProtocolError:
        pass


@given(st.binary(max_size=256))
def test_random_bodies_raise_protocol_error_only(body: bytes) -> None:
    for kind in (b"submit", b"results", b"ack", b"register", b"dispatch"):
        try:
            wire.decode(wire.frame(kind, body))
        except ProtocolError:
            pass


def test_protocol_error_pickles() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(ProtocolError("bad_body", "nope")))
    assert (err.code, err.message) == ("bad_body", "nope")


@pytest.mark.parametrize(
    ("body", "named"),
    [(b"\xc1", "FormatError"), (b"\x91" * 5000 + b"\x90", "StackError")],  # garbage; nested too deep
)
def test_a_body_msgpack_refuses_says_why_even_when_msgpack_does_not(body: bytes, named: str) -> None:
    with pytest.raises(ProtocolError) as info:
        wire.decode(wire.frame(b"submit", body))
    assert info.value.code == "bad_body" and named in str(info.value)
