"""A local HTTP server speaking the part of e2b's API that the real ``e2b`` SDK calls for sandbox
create, kill, health and files (only the cloud is replaced; the SDK is real).

Control plane: ``POST /v2/sandboxes`` and ``DELETE /sandboxes/{id}``. Sandbox (envd) plane, which the
SDK reaches at ``$E2B_SANDBOX_URL``: ``GET /health`` and ``GET``/``POST /files`` (multipart or
octet-stream uploads). Files live in memory per sandbox (the ``E2b-Sandbox-Id`` header says which).
``status_for_create`` makes creates answer with an error status (401, 429, 503) instead.
"""

from __future__ import annotations

import email.parser
import email.policy
import http.server
import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import parse_qs, urlparse


class FakeE2B:
    """State shared by the handler threads."""

    def __init__(self) -> None:
        self.files: dict[str, dict[str, bytes]] = {}
        self.killed: list[str] = []
        self.status_for_create: int | None = None
        self.lock = threading.Lock()


def _handler(state: FakeE2B) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _reply(self, status: int, body: bytes = b"", content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, value: object) -> None:
            self._reply(status, json.dumps(value).encode())

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _box(self) -> dict[str, bytes] | None:
            with state.lock:
                return state.files.get(self.headers.get("E2b-Sandbox-Id", ""))

        def do_POST(self) -> None:
            url = urlparse(self.path)
            body = self._body()
            if url.path == "/v2/sandboxes":
                if state.status_for_create is not None:
                    self._json(state.status_for_create, {"code": state.status_for_create, "message": "fake"})
                    return
                template = json.loads(body or b"{}").get("templateID", "base")
                sandbox_id = f"fake{uuid.uuid4().hex[:10]}"
                with state.lock:
                    state.files[sandbox_id] = {}
                self._json(
                    201,
                    {
                        "templateID": template,
                        "sandboxID": sandbox_id,
                        "clientID": "fake",
                        "envdVersion": "0.2.0",
                    },
                )
            elif url.path == "/files":
                box = self._box()
                if box is None:
                    self._json(502, {"code": 502, "message": "sandbox not found"})
                    return
                path = parse_qs(url.query).get("path", [""])[0]
                kind = self.headers.get("Content-Type", "")
                if kind.startswith("multipart/"):
                    parsed = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
                        b"Content-Type: " + kind.encode() + b"\r\n\r\n" + body
                    )
                    part = next(iter(parsed.iter_parts()))
                    data = part.get_payload(decode=True) or b""
                    path = path or part.get_filename() or ""
                else:
                    data = body
                box[path] = data
                self._json(200, [{"name": path.rsplit("/", 1)[-1], "path": path, "type": "file"}])
            else:
                self._json(404, {"code": 404, "message": f"no route {url.path}"})

        def do_GET(self) -> None:
            url = urlparse(self.path)
            if url.path == "/health":
                self._reply(204 if self._box() is not None else 502)
            elif url.path == "/files":
                box = self._box()
                path = parse_qs(url.query).get("path", [""])[0]
                if box is None:
                    self._json(502, {"code": 502, "message": "sandbox not found"})
                elif path not in box:
                    self._json(404, {"code": 404, "message": f"path '{path}' does not exist"})
                else:
                    self._reply(200, box[path], "application/octet-stream")
            else:
                self._json(404, {"code": 404, "message": f"no route {url.path}"})

        def do_DELETE(self) -> None:
            sandbox_id = urlparse(self.path).path.rsplit("/", 1)[-1]
            with state.lock:
                found = state.files.pop(sandbox_id, None)
                state.killed.append(sandbox_id)
            self._reply(204 if found is not None else 404)

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@contextmanager
def fake_e2b() -> Iterator[tuple[str, FakeE2B]]:
    """A running fake: its base URL (control plane and envd alike) and its state."""
    state = FakeE2B()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()
