"""Real engines behind KWOK's fake pods: an HTTP front that maps `/{namespace}/{pod}/...` to `tidepool serve`s.

KWOK pods run nothing and their IPs lead nowhere. The operator reaches a pod at the URL its resolver
gives (TIDEPOOL_POD_URL_TEMPLATE, operator/lora/client.py); pointed at this front, every pod gets one of
the test's real engines (the first pod seen gets the first engine, and so on; a pod keeps its engine).
The front also plays the pod's filesystem for adapters: a load whose `lora_path` is one of the test's
source URIs (hf://...) is forwarded with the local folder the test made, as the engine in a pod would
fetch it into its model cache. Everything else goes through unchanged, replies included, so what the
operator and the test see (the 404s included) is the real engine's answer.

A context manager: the server thread is stopped and joined on exit (see tests/controlplane/conftest.py for
why no thread may outlive a control-plane test).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx


@dataclass
class PodEngines:
    engines: Sequence[str]  # base URLs of the real engines
    sources: Mapping[str, Path]  # source URI -> the folder holding that adapter
    assigned: dict[str, str] = field(default_factory=dict)  # "namespace/pod" -> engine URL
    url: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def engine_of(self, pod: str) -> str:
        with self.lock:
            if pod not in self.assigned:
                self.assigned[pod] = self.engines[len(self.assigned) % len(self.engines)]
            return self.assigned[pod]

    def pod_url(self, namespace: str, pod: str) -> str:
        return f"{self.url}/{namespace}/{pod}"

    def rewrite(self, path: str, body: bytes) -> bytes:
        if not path.endswith("v1/load_lora_adapter") or not body:
            return body
        request = json.loads(body)
        source = request.get("lora_path", "")
        if source in self.sources:
            request["lora_path"] = str(self.sources[source])
        return json.dumps(request).encode()


def _handler(front: PodEngines) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _forward(self) -> None:
            _, namespace, pod, rest = self.path.split("/", 3)
            length = int(self.headers.get("Content-Length") or 0)
            body = front.rewrite(rest, self.rfile.read(length) if length else b"")
            headers = {"Content-Type": self.headers.get("Content-Type") or "application/json"}
            try:
                reply = httpx.request(
                    self.command, f"{front.engine_of(f'{namespace}/{pod}')}/{rest}", content=body, headers=headers,
                    timeout=120,
                )  # fmt: skip
            except httpx.HTTPError as exc:
                self.send_error(502, str(exc))
                return
            self.send_response(reply.status_code)
            self.send_header("Content-Type", reply.headers.get("content-type", "text/plain"))
            self.send_header("Content-Length", str(len(reply.content)))
            self.end_headers()
            self.wfile.write(reply.content)

        do_GET = do_POST = _forward  # http.server's method names

        def log_message(self, *_args: object) -> None:  # quiet: the engines log
            return

    return Handler


@contextmanager
def pod_engines(engines: Sequence[str], sources: Mapping[str, Path]) -> Iterator[PodEngines]:
    front = PodEngines(engines, sources)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(front))
    front.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="pod-engines", daemon=True)
    thread.start()
    try:
        yield front
    finally:
        server.shutdown()
        server.server_close()
        thread.join(30)
