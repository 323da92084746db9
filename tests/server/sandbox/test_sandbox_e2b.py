"""The e2b provider: configuration, errors and result mapping, and the real SDK against a local fake of
e2b's API (fake_e2b.py) from forked children; the cloud itself where a key is set."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import select
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tangram_env.errors import UnknownNameError
from tangram_env.sandbox import (
    SandboxBroken,
    SandboxBusy,
    SandboxError,
    SandboxFileTooLarge,
    SandboxRequestError,
    SandboxSpec,
    SandboxUnavailable,
    truncation_marker,
)
from tangram_env.server.sandbox import SandboxPool, make_provider
from tangram_env.server.sandbox.e2b_provider import E2BProvider, map_outcome
from tangram_env.server.sandbox.procrun import OutputCapture
from tests.server.sandbox.fake_e2b import FakeE2B, fake_e2b

e2b = pytest.importorskip("e2b", reason="the e2b extra is not installed")
needs_bwrap = shutil.which("bwrap") is not None
cloud = pytest.mark.skipif(not os.environ.get("E2B_API_KEY"), reason="E2B_API_KEY is not set")


def test_needs_an_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(SandboxUnavailable, match="E2B_API_KEY"):
        make_provider("e2b")


def test_needs_the_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "e2b", None)  # as if the extra were not installed
    with pytest.raises(SandboxUnavailable, match=r"pip install 'tangram-env\[e2b\]'"):
        make_provider("e2b", api_key="e2b_x")


def test_key_from_the_environment_and_templates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("E2B_API_KEY", "e2b_from_env")
    provider = make_provider("e2b", template="base-py", templates={"swe": "swe-template"})
    assert isinstance(provider, E2BProvider) and provider.connection["api_key"] == "e2b_from_env"
    assert provider.template_for("default") == "base-py"
    assert provider.template_for("swe") == "swe-template"
    assert provider.template_for("custom") == "custom"
    with pytest.raises(SandboxRequestError):
        E2BProvider(api_key="k", lifetime_s=0)


def test_unknown_provider_name() -> None:
    with pytest.raises(UnknownNameError, match="did you mean 'e2b'"):
        make_provider("e2c")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_api_is_a_sandbox_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("E2B_CONNECTION_RETRIES", "0")
    port = _free_port()  # nothing listens there
    provider = make_provider(
        "e2b",
        api_key="e2b_x",
        api_url=f"http://127.0.0.1:{port}",
        domain=f"127.0.0.1:{port}",
        request_timeout_s=5,
    )
    started = time.monotonic()
    with pytest.raises(SandboxError, match="could not create an e2b sandbox"):
        provider.create(SandboxSpec())
    assert time.monotonic() - started < 30


@pytest.fixture
def refusing_api() -> Iterator[str]:
    """An HTTP endpoint that answers every request as e2b's API does for a bad key (401)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.dumps({"code": 401, "message": "Invalid API key"}).encode()
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_refused_key_is_unavailable(refusing_api: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("E2B_CONNECTION_RETRIES", "0")
    provider = make_provider("e2b", api_key="e2b_bad", api_url=refusing_api, request_timeout_s=5)
    with pytest.raises(SandboxUnavailable, match="refused the API key"):
        provider.create(SandboxSpec())


def _capture(data: bytes, limit: int) -> OutputCapture:
    capture = OutputCapture(limit)
    capture.add(data)
    return capture


def test_outcomes_map_like_the_local_providers() -> None:
    spec = SandboxSpec(max_output_bytes=4)
    ok = map_outcome(spec, exit_code=0, stdout=_capture(b"hi\n", 4), stderr=_capture(b"", 4), wall_s=0.5)
    assert ok.ok and ok.stdout == "hi\n" and ok.wall_s == 0.5 and ok.killed_by is None
    cut = map_outcome(spec, exit_code=2, stdout=_capture(b"abcdefgh", 4), stderr=_capture(b"e", 4), wall_s=1)
    assert cut.stdout == "abcd" + truncation_marker(4) and cut.stdout_truncated and cut.exit_code == 2
    late = map_outcome(
        spec, exit_code=-9, stdout=_capture(b"", 4), stderr=_capture(b"", 4), wall_s=3, timed_out=True
    )
    assert late.killed_by == "timeout" and not late.ok
    flood = map_outcome(
        spec,
        exit_code=-9,
        stdout=_capture(b"x" * 100, 4),
        stderr=_capture(b"", 4),
        wall_s=1,
        output_exceeded=True,
    )
    assert flood.killed_by == "output" and flood.limits_hit == ["output"]


def test_sdk_results_carry_what_we_map() -> None:
    # The SDK's own result types (what exec reads exit codes from) have the fields we rely on.
    exited = e2b.CommandExitException(stdout="", stderr="boom", exit_code=3, error=None)
    assert isinstance(exited, e2b.SandboxException) and exited.exit_code == 3
    assert issubclass(e2b.SandboxNotRunningException, e2b.TimeoutException)
    assert issubclass(e2b.FileNotFoundException, e2b.SandboxException)


@cloud
def test_cloud_round_trip() -> None:
    provider = make_provider("e2b")
    sb = provider.create(SandboxSpec(wall_timeout_s=30, max_output_bytes=1000))
    try:
        r = sb.exec("echo $TANGRAM_CORES; pwd; echo err >&2; exit 3", cores=(0, 1))
        assert (r.exit_code, r.stdout, r.stderr) == (3, f"2\n{sb.workspace}\n", "err\n")
        sb.write_file("a.txt", "hello")
        assert sb.read_file("a.txt") == b"hello" and sb.exec("cat a.txt").stdout == "hello"
        assert sb.exec("sleep 30", timeout_s=2).killed_by == "timeout"
        assert sb.exec("head -c 100000 /dev/zero").stdout_truncated
        old = sb.id
        sb.reset()
        assert sb.id != old
        with pytest.raises(FileNotFoundError):
            sb.read_file("a.txt")
    finally:
        sb.close()


@contextlib.contextmanager
def _on_fake(monkeypatch: pytest.MonkeyPatch, **options: Any) -> Iterator[tuple[E2BProvider, FakeE2B]]:
    """An e2b provider on the real SDK (``options``: its own, beside a 5 s request timeout), talking to
    a local fake of e2b's API (see fake_e2b.py); closed at the end."""
    with fake_e2b() as (url, state):
        monkeypatch.setenv("E2B_SANDBOX_URL", url)  # the SDK's own setting for where sandboxes answer
        monkeypatch.setenv("E2B_CONNECTION_RETRIES", "0")
        provider = E2BProvider(api_key="e2b_test", api_url=url, **{"request_timeout_s": 5, **options})
        try:
            yield provider, state
        finally:
            provider.close()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[E2BProvider, FakeE2B]]:
    """An e2b provider on the real SDK, talking to a local fake of e2b's API."""
    with _on_fake(monkeypatch) as made:
        yield made


def _in_forked_child(work: Callable[[], bytes]) -> bytes:
    """What ``work`` returns in a forked child, as the executor's action children run (20 s at most)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            os.write(write_fd, work())
        finally:
            os._exit(0)
    os.close(write_fd)
    try:
        ready, _, _ = select.select([read_fd], [], [], 20)
        return os.read(read_fd, 1000) if ready else b"(no answer in 20 s: the child hangs)"
    finally:
        os.close(read_fd)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_forked_child_reaches_its_sandbox(fake: tuple[E2BProvider, FakeE2B]) -> None:
    # The executor runs each action in a forked child of the orchestrator. An SDK client that crossed
    # the fork (the earlier design) never returned there; the helper process makes it a plain call.
    provider, _state = fake
    box = provider.create(SandboxSpec())
    box.write_file("a.txt", b"from parent")
    assert box.read_file("a.txt") == b"from parent" and box.health() is None

    def in_child() -> bytes:
        box.write_file("b.txt", "from child")
        ran = box.exec("cat b.txt; echo ' and a command'").stdout.encode() if needs_bwrap else b""
        return box.read_file("a.txt") + b"|" + box.read_file("b.txt") + b"|" + ran

    answer = _in_forked_child(in_child)
    ran = b"from child and a command\n" if needs_bwrap else b""
    assert answer == b"from parent|from child|" + ran
    assert box.read_file("b.txt") == b"from child"  # the parent sees what the child wrote


@pytest.mark.skipif(not needs_bwrap, reason="the fake runs commands under bubblewrap")
def test_commands_through_the_real_sdk(fake: tuple[E2BProvider, FakeE2B]) -> None:
    provider, _state = fake
    box = provider.create(SandboxSpec(wall_timeout_s=30, max_output_bytes=1000, output_kill_bytes=1 << 20))
    r = box.exec("echo $TANGRAM_CORES; pwd; echo err >&2; exit 3", cores=(0, 1))
    assert (r.exit_code, r.stdout, r.stderr) == (3, f"2\n{box.workspace}\n", "err\n")
    box.write_file("a.txt", "hello")
    assert box.exec(["cat", "a.txt"]).stdout == "hello" and box.exec("cat", stdin=b"piped").stdout == "piped"
    assert box.exec("pwd", cwd="sub").exit_code != 0  # no such folder: cd fails, nothing runs elsewhere
    late = box.exec("sleep 30", timeout_s=2)
    assert late.killed_by == "timeout" and late.wall_s < 10
    cut = box.exec("head -c 100000 /dev/zero")
    assert cut.stdout_truncated and cut.ok
    assert box.exec("yes").killed_by == "output"
    old = box.id
    box.reset()
    assert box.id != old
    with pytest.raises(FileNotFoundError):
        box.read_file("a.txt")


def test_sdk_errors_map_faithfully(fake: tuple[E2BProvider, FakeE2B]) -> None:
    provider, state = fake
    box = provider.create(SandboxSpec())
    with pytest.raises(FileNotFoundError):
        box.read_file("missing.txt")
    for status in (429, 503):  # backpressure: retry later, not a timeout and not a dead sandbox
        state.status_for_create = status
        with pytest.raises(SandboxBusy, match="retry later"):
            provider.create(SandboxSpec())
    state.status_for_create = 401
    with pytest.raises(SandboxUnavailable, match="refused the API key"):
        provider.create(SandboxSpec())
    with state.lock:
        state.sandboxes.pop(box.id)  # e2b ended the sandbox (its lifetime ran out)
    assert box.health() is not None
    with pytest.raises(SandboxBroken):
        box.read_file("a.txt")
    box.close()
    assert box.id in state.killed


def test_a_dead_helper_is_restarted_and_reconnects(fake: tuple[E2BProvider, FakeE2B]) -> None:
    provider, _state = fake
    box = provider.create(SandboxSpec())
    box.write_file("a.txt", "kept in the cloud")
    first = provider.link.process
    first.kill()
    first.wait()
    assert box.read_file("a.txt") == b"kept in the cloud"  # a new helper, connected to it by id
    assert provider.link.process is not first


@pytest.mark.skipif(not needs_bwrap, reason="the fake runs commands under bubblewrap")
def test_a_slow_start_is_an_infrastructure_error_not_the_commands_timeout(
    fake: tuple[E2BProvider, FakeE2B],
) -> None:
    # e2b raised TimeoutException for a command whose start event came after its limit: the code was
    # graded as timed out (a correct solution's tests read as failing) though it never ran.
    provider, state = fake
    box = provider.create(SandboxSpec())
    state.start_delay_s = 3.0
    with pytest.raises(SandboxError, match="e2b failed starting the command") as failed:
        box.exec("true", timeout_s=1)
    assert not isinstance(failed.value, SandboxBroken)  # the sandbox runs: the session keeps it
    state.start_delay_s = 0.0
    assert box.exec("echo still here").stdout == "still here\n"


@pytest.mark.skipif(not needs_bwrap, reason="the fake runs commands under bubblewrap")
def test_an_end_that_e2b_withholds_is_not_the_commands_timeout(fake: tuple[E2BProvider, FakeE2B]) -> None:
    # The command ended at once, but e2b held its end event back past the limit: it was reported as
    # the command's own time-out (exit -9), and a grading failed the code. A real overrun still is one.
    provider, state = fake
    box = provider.create(SandboxSpec())
    state.end_delay_s = 15.0  # well past the helper's grace for a late end (END_GRACE_S)
    started = time.monotonic()
    with pytest.raises(SandboxBroken, match="e2b withheld the outcome of a command that ended by itself"):
        box.exec("echo done; exit 0", timeout_s=1)
    assert time.monotonic() - started < 12
    late = box.exec("sleep 30", timeout_s=1)  # its end is withheld too: it overran all the same
    assert late.killed_by == "timeout" and late.exit_code == -9
    state.end_delay_s = 0.0
    late = box.exec("sleep 30", timeout_s=1)
    assert late.killed_by == "timeout" and late.exit_code == -9 and late.wall_s < 5
    assert box.exec("echo on time", timeout_s=5).stdout == "on time\n"


@pytest.mark.skipif(not needs_bwrap, reason="the fake runs commands under bubblewrap")
def test_output_limits_count_the_bytes_written_not_their_decoding(fake: tuple[E2BProvider, FakeE2B]) -> None:
    # The SDK decodes output as UTF-8, each invalid byte becoming U+FFFD (3 bytes in UTF-8): counted
    # re-encoded, 3000 binary bytes were cut at 4096 and killed at 8000, where Docker keeps them all.
    provider, _state = fake
    box = provider.create(SandboxSpec(max_output_bytes=4096, output_kill_bytes=8000))
    binary = box.exec("head -c 3000 /dev/zero | tr '\\0' '\\377'")
    assert binary.ok and binary.killed_by is None and not binary.stdout_truncated
    assert binary.stdout == "\ufffd" * 3000
    mixed = box.exec("printf 'h\\303\\251\\377!'; printf '\\377' >&2")  # valid UTF-8 stays as it was
    assert (mixed.stdout, mixed.stderr) == ("h\u00e9\ufffd!", "\ufffd")
    cut = box.exec("head -c 5000 /dev/zero | tr '\\0' '\\377'")
    assert cut.stdout_truncated and cut.stdout.startswith("\ufffd" * 4096) and cut.killed_by is None
    assert box.exec("head -c 9000 /dev/zero | tr '\\0' '\\377'").killed_by == "output"


@pytest.mark.skipif(not needs_bwrap, reason="the fake runs commands under bubblewrap")
@pytest.mark.parametrize("streams", ["cancelled", "killed"])
def test_a_sandbox_that_expires_mid_command_is_broken_not_a_result(
    fake: tuple[E2BProvider, FakeE2B], streams: str
) -> None:
    # Its lifetime ran out while the tests ran: a cancelled stream read as the command's timeout, and
    # processes killed with the sandbox as the command's own exit code 137; both were graded.
    provider, state = fake
    box = provider.create(SandboxSpec())
    timer = threading.Timer(1.0, state.expire, args=(box.id,), kwargs={"streams": streams})
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(SandboxBroken, match="stopped"):
            box.exec("sleep 20", timeout_s=30)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 15


@pytest.mark.skipif(not needs_bwrap, reason="the fake runs commands under bubblewrap")
def test_a_file_over_the_read_limit_is_refused_without_downloading_it(
    fake: tuple[E2BProvider, FakeE2B],
) -> None:
    # A sparse file costs the sandbox nothing; downloaded whole before its size was checked, it cost
    # the helper process its size in memory (twice over).
    provider, _state = fake
    box = provider.create(SandboxSpec())
    assert box.exec("truncate -s 512M big && printf small > small").ok
    with pytest.raises(SandboxFileTooLarge, match="big holds more than 1000 bytes"):
        box.read_file("big", max_bytes=1000)
    assert box.read_file("small", max_bytes=5) == b"small"
    with pytest.raises(SandboxFileTooLarge):
        box.read_file("small", max_bytes=4)
    with open(f"/proc/{provider.link.process.pid}/status") as status:
        peak_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    assert peak_kib < 256 * 1024, f"the helper's peak memory was {peak_kib} KiB"


def test_a_hung_helper_fails_the_call_and_is_replaced(
    fake: tuple[E2BProvider, FakeE2B], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tangram_env.server.sandbox import e2b_provider

    monkeypatch.setattr(e2b_provider, "_PING_EVERY_S", 0.5)
    monkeypatch.setattr(e2b_provider, "_PING_S", 0.5)
    monkeypatch.setattr(e2b_provider, "_STALL_S", 1.0)
    provider, _state = fake
    box = provider.create(SandboxSpec())
    box.write_file("a.txt", "kept")
    hung = provider.link.process
    os.kill(hung.pid, signal.SIGSTOP)  # as a wedged SDK call would leave it: alive, answering nothing
    started = time.monotonic()
    with pytest.raises(SandboxError, match="helper process hung"):
        box.read_file("a.txt")
    assert time.monotonic() - started < 10  # the call waited forever
    assert hung.wait(10) == -signal.SIGKILL
    assert box.read_file("a.txt") == b"kept" and provider.link.process is not hung
    if not needs_bwrap:
        return
    # hung while a call waits on it: the waiting call's pings go unanswered
    second = provider.link.process
    threading.Timer(1.0, os.kill, args=(second.pid, signal.SIGSTOP)).start()
    started = time.monotonic()
    with pytest.raises(SandboxError, match="nor to a ping"):
        box.exec("sleep 20", timeout_s=30)
    assert time.monotonic() - started < 10 and second.wait(10) == -signal.SIGKILL


def test_a_child_forked_while_the_helper_lock_was_held_still_calls(fake: tuple[E2BProvider, FakeE2B]) -> None:
    # A set-up thread starting the helper held the lock at the fork: the child's copy stayed held.
    provider, _state = fake
    box = provider.create(SandboxSpec())
    box.write_file("a.txt", "from parent")
    with provider._link_lock:
        answer = _in_forked_child(lambda: box.read_file("a.txt"))
    assert answer == b"from parent"


def _eventually(check: Callable[[], bool], within_s: float = 15.0) -> bool:
    """Whether ``check()`` holds within ``within_s`` (asked every 0.1 s)."""
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_kill_that_e2b_fails_is_tried_again(fake: tuple[E2BProvider, FakeE2B]) -> None:
    # A kill answered 500 was dropped: the sandbox ran (and was billed) until its lifetime ended.
    provider, state = fake
    box = provider.create(SandboxSpec())
    state.delete_statuses = [500, 500]
    box.close()
    assert _eventually(lambda: not state.sandboxes), "the sandbox whose kill failed lives on"
    assert state.killed == [box.id]


def test_a_sandbox_given_back_to_a_full_pool_makes_no_cloud_sandbox(
    fake: tuple[E2BProvider, FakeE2B],
) -> None:
    # An e2b reset replaces the cloud sandbox. The pool reset every sandbox given back and only then
    # closed those it had no room for: each session's end made (and billed) a cloud sandbox for nothing.
    provider, state = fake
    pool = SandboxPool(provider)
    try:
        pool.keep("base", 1)
        for session in ("a", "b"):
            pool.acquire("base", session=session)
        assert len(state.metadata) == 2
        pool.end_session("a")  # kept: reset, which makes one new cloud sandbox
        pool.end_session("b")  # the pool is full: closed as it is
        assert len(state.metadata) == 3 and len(state.sandboxes) == 1
        assert pool.stats()["resets"] == 1
    finally:
        pool.close()
    assert not state.sandboxes


def test_a_slow_e2b_reset_holds_up_no_other_session(fake: tuple[E2BProvider, FakeE2B]) -> None:
    # An e2b reset is a create (seconds, at times): the pool held its one lock through it, so another
    # session's fast path found nothing and its acquire of the sandbox it held waited as long.
    provider, state = fake
    pool = SandboxPool(provider)
    try:
        pool.acquire("base", session="a")
        mine = pool.acquire("base", session="b")
        state.create_delay_s = 3.0
        ending = threading.Thread(target=pool.end_session, args=("a",))
        ending.start()
        time.sleep(0.5)  # a's reset is under way
        started = time.monotonic()
        assert pool.held("b", "base") is mine and pool.acquire("base", session="b") is mine
        assert time.monotonic() - started < 1.0
        ending.join()
        assert pool.stats()["resets"] == 1 and pool.stats()["images"]["base"]["warm"] == 1
    finally:
        state.create_delay_s = 0.0
        pool.close()
    assert not state.sandboxes


def test_the_providers_close_kills_what_earlier_kills_left(
    fake: tuple[E2BProvider, FakeE2B], capfd: pytest.CaptureFixture[str]
) -> None:
    provider, state = fake
    kept, doomed = provider.create(SandboxSpec()), provider.create(SandboxSpec())
    state.status_for_delete = 500  # e2b fails every kill for now
    kept.close()
    state.status_for_delete, state.delete_statuses = None, [500]
    provider.close()  # the kills that failed are tried again before the helper exits
    assert not state.sandboxes and set(state.killed) == {kept.id, doomed.id}
    assert "could not be killed" not in capfd.readouterr().err


def test_a_sandbox_e2b_will_not_kill_is_reported_at_close(
    fake: tuple[E2BProvider, FakeE2B], capfd: pytest.CaptureFixture[str]
) -> None:
    provider, state = fake
    box = provider.create(SandboxSpec())
    state.status_for_delete = 500
    provider.close()
    assert list(state.sandboxes) == [box.id]
    reported = capfd.readouterr().err  # by the helper process, on this process's stderr
    assert f"e2b sandboxes {box.id} could not be killed" in reported
    assert f"e2b sandbox kill --all --metadata=tangram.owner={provider.owner}" in reported  # by hand


def test_a_provider_whose_process_dies_leaves_no_sandbox(fake: tuple[E2BProvider, FakeE2B]) -> None:
    # The orchestrator closes its sandbox pool, never the provider, and a server that is killed
    # closes nothing: the sandboxes it held ran on until their lifetime.
    _provider, state = fake

    def make_and_die() -> bytes:
        provider = E2BProvider(api_key="e2b_test", api_url=state.url, request_timeout_s=5)
        provider.create(SandboxSpec())
        os.kill(os.getpid(), signal.SIGKILL)
        return b""

    _in_forked_child(make_and_die)
    assert _eventually(lambda: len(state.killed) == 1 and not state.sandboxes), state.sandboxes


def test_a_create_answered_after_we_stopped_waiting_is_killed(fake: tuple[E2BProvider, FakeE2B]) -> None:
    # Our deadline passed while e2b was still making the sandbox; made, it was nobody's and ran on.
    provider, state = fake
    state.create_delay_s = 2.0
    provider._answer_s = 0.5
    with pytest.raises(SandboxError, match="did not answer 'create'"):
        provider.create(SandboxSpec())
    assert _eventually(lambda: len(state.killed) == 1 and not state.sandboxes), state.sandboxes


def test_a_create_that_timed_out_but_was_made_is_found_and_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    # The SDK's request timed out while e2b went on and made the sandbox: nobody knew its id.
    with _on_fake(monkeypatch, request_timeout_s=1, retries=0) as (provider, state):
        state.create_delay_s = 2.0
        with pytest.raises(SandboxError, match="could not create an e2b sandbox"):
            provider.create(SandboxSpec())
        assert _eventually(lambda: len(state.killed) == 1 and not state.sandboxes), state.sandboxes


def test_reset_after_close_is_refused_and_starts_nothing(fake: tuple[E2BProvider, FakeE2B]) -> None:
    # reset() after close() made a new sandbox that close(), already done, never killed.
    provider, state = fake
    box = provider.create(SandboxSpec())
    box.close()
    with pytest.raises(SandboxBroken, match="closed"):
        box.reset()
    assert not state.sandboxes


def test_a_create_the_sdk_retries_after_a_made_sandbox_makes_only_that_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # e2b made the sandbox but a 502 came back; the SDK's retry made a second, and the first, whose id
    # nobody had, lived on until the provider closed.
    with _on_fake(monkeypatch, retries=1) as (provider, state):
        state.made_then_failed = [502]
        box = provider.create(SandboxSpec())
        assert list(state.sandboxes) == [box.id]
        assert box.exec("echo hi").stdout.strip() == "hi"
