"""Coverage-guided fuzzing (atheris) of the frame decoder and the orchestrator's message handlers.

    python -m tests.fuzz.fuzz_frames [-atheris_runs=N] [-max_len=4096] [corpus_dir ...]

Each input travels as one frame from a DEALER socket to a real in-process orchestrator, which is
stepped by hand. The properties checked for every input, any failure being a crash that atheris
reports with the input that caused it:

- ``wire.decode`` raises nothing but :class:`ProtocolError`;
- a frame that does not decode is answered with an ``Error`` carrying the decoder's code;
- a frame that decodes never makes a handler fail (no ``internal`` error, none counted);
- the orchestrator keeps serving: an action submitted after the input gets its result.

Without corpus directories the fuzzer starts from one valid frame of every message type, so its
mutations explore the schemas' edges as well as the framing. Installed by the ``dev`` extra where
atheris ships a wheel; ``tests/server/test_fuzz_atheris.py`` runs a bounded session in CI.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

import atheris
import zmq

with atheris.instrument_imports():
    from tangram_env import wire
    from tangram_env.errors import ProtocolError
    from tangram_env.protocol import (
        Ack,
        Action,
        Cancel,
        CloseSessions,
        Dispatch,
        Error,
        Grant,
        Heartbeat,
        ListKinds,
        Register,
        Resources,
        Result,
        Results,
        Stats,
        Submit,
    )
    from tangram_env.server import builtin_tools  # noqa: F401  (noop, echo, sleep)
    from tangram_env.server.cli import build
    from tangram_env.server.config import ServerSettings

_MAX_STEPS = 200  # loop iterations to wait for the sentinel's result (each polls at most 10 ms)


def seeds() -> list[bytes]:
    """One valid frame of every message type, the starting corpus."""
    action = Action(id="a1", kind="echo", payload={"value": [1, "x", None]}, deadline_s=5)
    messages = [
        Submit(actions=[action, Action(kind="noop")], acks=["a0"]),
        Results(results=[Result(action_id="a1", ok=True, value=3)]),
        Ack(action_ids=["a1"]),
        Cancel(action_ids=["a1"]),
        CloseSessions(session_ids=["s1"]),
        Heartbeat(server_id="x", figures={"load": 1.0}),
        Register(worker_id="w1", capacity=Resources(1, 64), kinds=["noop"]),
        Dispatch(grants=[Grant(action=action, timeout_s=1)]),
        Error(code="bad_body", message="m"),
        Stats(),
        ListKinds(),
    ]
    return [wire.encode(m) for m in messages]


class Harness:
    """An orchestrator on a loopback port and a DEALER peer that feeds it one frame at a time."""

    def __init__(self) -> None:
        settings = ServerSettings(
            bind="tcp://127.0.0.1:0", cpus=1, mem_mb=1024, entry_point_plugins=False, worker_timeout_s=1
        )
        self.orchestrator = build(settings)
        self.peer = zmq.Context.instance().socket(zmq.DEALER)
        self.peer.setsockopt(zmq.LINGER, 0)
        self.peer.connect(self.orchestrator.address)
        self.sent = 0

    def exchange(self, frame: bytes) -> list[object]:
        """Send ``frame``, then a sentinel action; the replies that arrived before the sentinel's result.

        The orchestrator handles one peer's messages in order and sends errors at once, results when
        its loop iteration ends, so whatever ``frame`` provoked arrives first.
        """
        self.sent += 1
        sentinel = f"sentinel-{self.sent}"
        acks = [f"sentinel-{self.sent - 1}"] if self.sent > 1 else []
        self.peer.send(frame)
        self.peer.send(wire.encode(Submit(actions=[Action(id=sentinel, kind="noop")], acks=acks)))
        replies: list[object] = []
        for _ in range(_MAX_STEPS):
            self.orchestrator.run_once(0.01)
            while self.peer.poll(0):
                reply = wire.decode(self.peer.recv())
                replies.append(reply)
                if isinstance(reply, Results) and any(r.action_id == sentinel for r in reply.results):
                    return replies
        raise AssertionError(f"the orchestrator stopped answering after {frame!r}")

    def check(self, frame: bytes) -> None:
        """The properties in the module's docstring, for one input."""
        try:
            wire.decode(frame)
            decode_error = None
        except ProtocolError as exc:  # anything else escapes: a crash
            decode_error = exc.code
        replies = self.exchange(frame)
        errors = [r for r in replies if isinstance(r, Error)]
        if decode_error is not None:
            assert any(e.code == decode_error for e in errors), (frame, decode_error, replies)
        internal = [e for e in errors if e.code == "internal"]
        assert not internal, (frame, internal)
        assert not self.orchestrator.metrics.protocol_errors.get("internal"), frame


def main(argv: list[str]) -> None:
    """Run atheris over :class:`Harness` with ``argv`` as its flags and corpus directories."""
    logging.basicConfig(level=logging.ERROR)  # the fuzzer's own lines, not every rejected message
    harness = Harness()
    if not any(not a.startswith("-") for a in argv[1:]):
        corpus = Path(tempfile.mkdtemp(prefix="tangram-fuzz-"))
        for i, seed in enumerate(seeds()):
            (corpus / f"seed-{i}").write_bytes(seed)
        argv = [*argv, str(corpus)]
    atheris.Setup(argv, harness.check)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
