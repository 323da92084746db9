"""A local server speaking the part of e2b's API that the real ``e2b`` SDK calls (only the cloud is
replaced; the SDK, its HTTP client and its Connect RPC are real).

Control plane: ``POST /v2/sandboxes``, ``GET /v2/sandboxes`` (filtered by metadata),
``POST /v2/sandboxes/{id}/connect`` and ``DELETE /sandboxes/{id}``. Sandbox (envd) plane, which the
SDK reaches at ``$E2B_SANDBOX_URL`` with the ``E2b-Sandbox-Id`` header naming the sandbox:
``GET /health``, ``GET``/``POST /files``, and the ``process.Process`` Connect service (``Start``,
``SendInput``, ``CloseStdin``, ``SendSignal``) served by the SDK's own generated WSGI application.
Each fake sandbox is a host directory shown to its commands as ``/home/user`` (through bubblewrap;
commands need ``bwrap``), and the files API reads and writes the same directory.
``status_for_create`` makes creates answer with an error status (401, 429, 503) instead, and
``create_statuses`` only the next few; ``status_for_delete`` and ``delete_statuses`` do the same for
kills (a sandbox whose kill failed lives on). ``create_delay_s`` makes each create take that long, and
the sandbox is made even when its caller stopped waiting, as e2b's are; ``made_then_failed`` makes the
next creates make their sandbox and still answer an error status, as a proxy's 502 in front of e2b
can. A create with an ``Idempotency-Key`` already seen answers with that key's sandbox.
``start_delay_s`` holds each command's start event back, as a slow sandbox does, and
``end_delay_s`` its end event, after the command ended, as a stalled proxy in front of envd can. As
envd does, a command is killed at its request's timeout (``Connect-Timeout-Ms``), and ``List`` names
the commands still running. :meth:`FakeE2B.expire` ends a sandbox the ways e2b's do when their lifetime
runs out.
"""

from __future__ import annotations

import email.parser
import email.policy
import io
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from socketserver import ThreadingMixIn
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

HOME = "/home/user"
ENVD_VERSION = "0.6.0"  # new enough for closing stdin, which the provider uses


class FakeE2B:
    """The fake cloud's state: one host directory per sandbox."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="fake-e2b-")
        self.url = ""  # where the fake answers (set by fake_e2b())
        self.sandboxes: dict[str, str] = {}  # the live ones: id -> home
        self.metadata: dict[str, dict[str, str]] = {}  # what each was created with
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self.killed: list[str] = []
        self.status_for_create: int | None = None
        self.create_statuses: list[int] = []  # error statuses the next creates answer, in turn
        self.create_delay_s = 0.0
        self.made_then_failed: list[int] = []  # statuses the next creates answer after making theirs
        self.by_key: dict[str, str] = {}  # Idempotency-Key -> the sandbox its first create made
        self.status_for_delete: int | None = None
        self.delete_statuses: list[int] = []  # error statuses the next kills answer, in turn
        self.start_delay_s = 0.0
        self.end_delay_s = 0.0
        self.owners: dict[int, str] = {}  # command pid -> its sandbox's id
        self.cancelled: set[str] = set()  # sandboxes whose open command streams end CANCELED
        self.lock = threading.Lock()

    def expire(self, sandbox_id: str, *, streams: str) -> None:
        """End a sandbox as its lifetime running out does: it is gone, and its open command streams
        are ``"cancelled"`` by the proxy (Connect CANCELED) or end as their processes are ``"killed"``.
        """
        with self.lock:
            self.sandboxes.pop(sandbox_id, None)
            if streams == "cancelled":
                self.cancelled.add(sandbox_id)
                return
            pids = [pid for pid, owner in self.owners.items() if owner == sandbox_id]
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def home(self, sandbox_id: str) -> str | None:
        with self.lock:
            return self.sandboxes.get(sandbox_id)

    def host_path(self, sandbox_id: str, path: str) -> str | None:
        home = self.home(sandbox_id)
        if home is None or not (path == HOME or path.startswith(HOME + "/")):
            return None
        return os.path.join(home, os.path.relpath(path, HOME))

    def close(self) -> None:
        for proc in list(self.processes.values()):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


from e2b.envd.process.process_connect import ProcessSync  # noqa: E402  (the SDK's own service stubs)


class _Process(ProcessSync):
    """The ``process.Process`` service, running each command under bubblewrap in its sandbox's home
    (the methods it does not override answer UNIMPLEMENTED, as the generated stubs do).
    """

    def __init__(self, state: FakeE2B) -> None:
        self.state = state

    def start(self, request: Any, ctx: Any) -> Iterator[Any]:
        from connectrpc.code import Code
        from connectrpc.errors import ConnectError
        from e2b.envd.process import process_pb
        from protobuf import Oneof

        sandbox_id = ctx.request_headers.get("e2b-sandbox-id", "")
        home = self.state.home(sandbox_id)
        if home is None:
            raise ConnectError(Code.NOT_FOUND, "sandbox not found")
        config = request.process
        argv = ["bwrap", "--dev-bind", "/", "/", "--tmpfs", "/home", "--bind", home, HOME]
        argv += ["--chdir", config.cwd or HOME, "--", config.cmd, *config.args]
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if request.stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin", "HOME": HOME, **dict(config.envs)},
            start_new_session=True,
        )
        with self.state.lock:
            self.state.processes[proc.pid] = proc
            self.state.owners[proc.pid] = sandbox_id
        limit_ms = ctx.timeout_ms  # envd ends the process at its request's timeout
        deadline = threading.Timer((limit_ms or 0) / 1000, _kill_group, args=(proc,))
        deadline.daemon = True
        if limit_ms:
            deadline.start()
        time.sleep(self.state.start_delay_s)

        def event(**kind: Any) -> Any:
            ((name, value),) = kind.items()
            return process_pb.StartResponse(event=process_pb.ProcessEvent(event=Oneof(name, value)))

        yield event(start=process_pb.ProcessEvent.StartEvent(pid=proc.pid))
        chunks: list[tuple[str, bytes]] = []
        done = threading.Event()

        def pump(stream: Any, name: str) -> None:
            for chunk in iter(lambda: stream.read1(65536), b""):
                chunks.append((name, chunk))
            done.set()

        readers = [
            threading.Thread(target=pump, args=(proc.stdout, "stdout"), daemon=True),
            threading.Thread(target=pump, args=(proc.stderr, "stderr"), daemon=True),
        ]
        for reader in readers:
            reader.start()
        while any(r.is_alive() for r in readers) or chunks:
            done.wait(0.05)
            done.clear()
            if sandbox_id in self.state.cancelled:
                raise ConnectError(Code.CANCELED, "the sandbox was shut down")
            while chunks:
                name, chunk = chunks.pop(0)
                yield event(data=process_pb.ProcessEvent.DataEvent(output=Oneof(name, chunk)))
        code = proc.wait()
        deadline.cancel()
        time.sleep(self.state.end_delay_s)
        yield event(
            end=process_pb.ProcessEvent.EndEvent(
                exit_code=code if code >= 0 else 128 - code, exited=code >= 0, status=f"exit status {code}"
            )
        )

    def list(self, request: Any, ctx: Any) -> Any:
        from e2b.envd.process import process_pb

        sandbox_id = ctx.request_headers.get("e2b-sandbox-id", "")
        with self.state.lock:
            running = [
                pid
                for pid, proc in self.state.processes.items()
                if self.state.owners.get(pid) == sandbox_id and proc.poll() is None
            ]
        return process_pb.ListResponse(
            processes=[
                process_pb.ProcessInfo(pid=pid, config=process_pb.ProcessConfig(cmd="/bin/bash"))
                for pid in running
            ]
        )

    def _proc(self, request: Any) -> subprocess.Popen[bytes]:
        from connectrpc.code import Code
        from connectrpc.errors import ConnectError

        proc = self.state.processes.get(request.process.selector.value)
        if proc is None or proc.poll() is not None:  # envd forgets a process once it ended
            raise ConnectError(Code.NOT_FOUND, "process not found")
        return proc

    def send_input(self, request: Any, ctx: Any) -> Any:
        from e2b.envd.process import process_pb

        proc = self._proc(request)
        assert proc.stdin is not None
        proc.stdin.write(request.input.input.value)
        proc.stdin.flush()
        return process_pb.SendInputResponse()

    def close_stdin(self, request: Any, ctx: Any) -> Any:
        from e2b.envd.process import process_pb

        proc = self._proc(request)
        if proc.stdin is not None:
            proc.stdin.close()
        return process_pb.CloseStdinResponse()

    def send_signal(self, request: Any, ctx: Any) -> Any:
        from e2b.envd.process import process_pb

        _kill_group(self._proc(request))
        return process_pb.SendSignalResponse()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:  # not reaped yet, so its pid is not anyone else's
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _dechunk(environ: dict[str, Any]) -> None:
    """Decode a chunked request body in place (wsgiref hands it over raw; the SDK streams RPCs so), and
    buffer any other, so that a read to its end (the Connect application's, answering an error) ends.
    """
    if environ.get("HTTP_TRANSFER_ENCODING", "").lower() != "chunked":
        length = int(environ.get("CONTENT_LENGTH") or 0)
        environ["wsgi.input"] = io.BytesIO(environ["wsgi.input"].read(length))
        return
    raw, body = environ["wsgi.input"], bytearray()
    while True:
        size = int(raw.readline().split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while raw.readline() not in (b"\r\n", b"\n", b""):  # trailers, then the blank line
                pass
            break
        body += raw.read(size)
        raw.readline()  # the CRLF after each chunk
    environ["wsgi.input"] = io.BytesIO(bytes(body))
    environ["CONTENT_LENGTH"] = str(len(body))
    del environ["HTTP_TRANSFER_ENCODING"]


def _chunks(path: str) -> Iterator[bytes]:
    with open(path, "rb") as f:
        yield from iter(lambda: f.read(1 << 16), b"")


def _json(start: Any, status: int, value: object) -> list[bytes]:
    body = json.dumps(value).encode()
    start(f"{status} X", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


def _app(state: FakeE2B) -> Any:
    from e2b.envd.process.process_connect import ProcessWSGIApplication

    process_app = ProcessWSGIApplication(_Process(state))

    def app(environ: dict[str, Any], start: Any) -> Iterable[bytes]:
        _dechunk(environ)
        path, method = environ["PATH_INFO"], environ["REQUEST_METHOD"]
        if path.startswith("/process.Process/"):
            return process_app(environ, start)  # type: ignore[no-any-return]
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        sandbox_id = environ.get("HTTP_E2B_SANDBOX_ID", "")
        query = parse_qs(environ.get("QUERY_STRING", ""))
        if path == "/v2/sandboxes" and method == "POST":
            with state.lock:
                status = state.create_statuses.pop(0) if state.create_statuses else state.status_for_create
            if status is not None:
                return _json(start, status, {"code": status, "message": "fake"})
            time.sleep(state.create_delay_s)  # a caller that stopped waiting meanwhile goes unnoticed
            request = json.loads(body or b"{}")
            key = environ.get("HTTP_IDEMPOTENCY_KEY")
            with state.lock:
                new_id = state.by_key.get(key, "") if key else ""
                if not new_id:  # a key seen before gets its first create's sandbox
                    new_id = f"fake{uuid.uuid4().hex[:10]}"
                    home = os.path.join(state.root, new_id)
                    os.makedirs(home)
                    state.sandboxes[new_id] = home
                    state.metadata[new_id] = dict(request.get("metadata") or {})
                    if key:
                        state.by_key[key] = new_id
                failed = state.made_then_failed.pop(0) if state.made_then_failed else None
            if failed is not None:
                return _json(start, failed, {"code": failed, "message": "fake: made, then failed"})
            template = request.get("templateID", "base")
            reply = {
                "templateID": template,
                "sandboxID": new_id,
                "clientID": "fake",
                "envdVersion": ENVD_VERSION,
            }
            return _json(start, 201, reply)
        if path == "/v2/sandboxes" and method == "GET":
            # metadata=k1%3Dv1%26k2%3Dv2: the filter is itself url-encoded, as the SDK sends it
            wanted = {k: v[0] for k, v in parse_qs(query.get("metadata", [""])[0]).items()}
            with state.lock:
                found = [
                    (known, state.metadata.get(known, {}))
                    for known in state.sandboxes
                    if wanted.items() <= state.metadata.get(known, {}).items()
                ]
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            listed = [
                {
                    "templateID": "base",
                    "sandboxID": known,
                    "clientID": "fake",
                    "startedAt": now,
                    "endAt": now,
                    "cpuCount": 2,
                    "memoryMB": 512,
                    "diskSizeMB": 1024,
                    "state": "running",
                    "envdVersion": ENVD_VERSION,
                    "metadata": metadata,
                }
                for known, metadata in found
            ]
            return _json(start, 200, listed)
        if path.startswith("/v2/sandboxes/") and path.endswith("/connect") and method == "POST":
            known = path.split("/")[3]
            if state.home(known) is None:
                return _json(start, 404, {"code": 404, "message": f"sandbox {known} not found"})
            reply = {
                "templateID": "base",
                "sandboxID": known,
                "clientID": "fake",
                "envdVersion": ENVD_VERSION,
            }
            return _json(start, 200, reply)
        if path.startswith("/sandboxes/") and method == "DELETE":
            gone = path.rsplit("/", 1)[-1]
            with state.lock:
                status = state.delete_statuses.pop(0) if state.delete_statuses else state.status_for_delete
                if status is not None:
                    return _json(start, status, {"code": status, "message": "fake"})
                found = state.sandboxes.pop(gone, None)
                state.killed.append(gone)
            if not found:  # with a JSON body, as e2b's (the SDK parses it)
                return _json(start, 404, {"code": 404, "message": f"sandbox {gone} not found"})
            start("204 No Content", [("Content-Length", "0")])
            return [b""]
        if path == "/health":
            ok = state.home(sandbox_id) is not None
            start("204 No Content" if ok else "502 Bad Gateway", [("Content-Length", "0")])
            return [b""]
        if path == "/files":
            if state.home(sandbox_id) is None:
                return _json(start, 502, {"code": 502, "message": "sandbox not found"})
            file_path = query.get("path", [""])[0]
            if method == "POST":
                kind = environ.get("CONTENT_TYPE", "")
                data = body
                if kind.startswith("multipart/"):
                    parsed = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
                        b"Content-Type: " + kind.encode() + b"\r\n\r\n" + body
                    )
                    part = next(iter(parsed.iter_parts()))
                    data = part.get_payload(decode=True) or b""
                    file_path = file_path or part.get_filename() or ""
                target = state.host_path(sandbox_id, file_path)
                if target is None:
                    return _json(start, 400, {"code": 400, "message": f"fake: only {HOME} is writable"})
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    f.write(data)
                return _json(
                    start, 200, [{"name": os.path.basename(file_path), "path": file_path, "type": "file"}]
                )
            target = state.host_path(sandbox_id, file_path)
            if target is None or not os.path.isfile(target):
                return _json(start, 404, {"code": 404, "message": f"path '{file_path}' does not exist"})
            size = os.path.getsize(target)
            start("200 OK", [("Content-Type", "application/octet-stream"), ("Content-Length", str(size))])
            return _chunks(target)  # streamed, as e2b does: a client may stop reading early
        return _json(start, 404, {"code": 404, "message": f"no route {method} {path}"})

    return app


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def fake_e2b() -> Iterator[tuple[str, FakeE2B]]:
    """A running fake: its base URL (control plane and envd alike) and its state."""
    state = FakeE2B()
    server = make_server("127.0.0.1", 0, _app(state), server_class=_Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state.url, state
    finally:
        server.shutdown()
        server.server_close()
        state.close()
