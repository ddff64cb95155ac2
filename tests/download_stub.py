"""A stub of the Hugging Face Hub's two HTTP calls on 127.0.0.1, for `tidepool download` tests.

`StubHub(files)` serves `GET /api/models/{repo}/revision/{rev}` (siblings with size and LFS sha256)
and `GET /{repo}/resolve/{sha}/{file}` with Range support. Knobs: `status` (answer every request with
it), `hang` (hold requests until `release()`), `truncate_once` (send half a file once, then drop the
connection), `wrong_sha` (list a sha256 that does not match). `requests` records (path, Range header,
Authorization header) of each request.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

REPO, SHA = "org/tiny", "0123456789abcdef0123456789abcdef01234567"


class StubHub:
    def __init__(self, files: dict[str, bytes], lfs: tuple[str, ...] = ()) -> None:
        self.files, self.lfs = files, set(lfs)
        self.status: int | None = None
        self.truncate_once: set[str] = set()
        self.wrong_sha: set[str] = set()
        self.requests: list[tuple[str, str | None, str | None]] = []
        self._hang = threading.Event()
        self._hang.set()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                stub.requests.append((self.path, self.headers.get("Range"), self.headers.get("Authorization")))
                stub._hang.wait(30)
                if stub.status is not None:
                    self._send(stub.status, b'{"error": "stub"}')
                elif self.path.startswith(f"/api/models/{REPO}/revision/"):
                    self._send(200, json.dumps(stub.info()).encode())
                elif self.path.startswith(f"/{REPO}/resolve/{SHA}/"):
                    self._file(self.path.removeprefix(f"/{REPO}/resolve/{SHA}/"))
                else:
                    self._send(404, b'{"error": "not found"}')

            def _file(self, name: str) -> None:
                data = stub.files.get(name)
                if data is None:
                    self._send(404, b"")
                    return
                rng = self.headers.get("Range")
                start = int(rng.removeprefix("bytes=").rstrip("-")) if rng else 0
                body = data[start:]
                self.send_response(206 if rng else 200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if name in stub.truncate_once:
                    stub.truncate_once.discard(name)
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client that gave up (the timeout tests) breaks the pipe: expected

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def info(self) -> dict[str, Any]:
        siblings = []
        for name, data in sorted(self.files.items()):
            sib: dict[str, Any] = {"rfilename": name, "size": len(data)}
            if name in self.lfs:
                digest = hashlib.sha256(data + (b"x" if name in self.wrong_sha else b"")).hexdigest()
                sib["lfs"] = {"sha256": digest, "size": len(data), "pointerSize": 134}
            siblings.append(sib)
        return {"id": REPO, "sha": SHA, "siblings": siblings}

    def hang(self) -> None:
        self._hang.clear()

    def release(self) -> None:
        self._hang.set()

    def file_requests(self) -> list[tuple[str, str | None]]:
        return [(p, r) for p, r, _ in self.requests if "/resolve/" in p]

    def __enter__(self) -> StubHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()
