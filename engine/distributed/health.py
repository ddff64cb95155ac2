"""The health endpoint of a worker node (`tidepool serve --node-rank R`, R > 0), which serves no API.

Why: every pod of a multi-node replica runs the same pod template (a StatefulSet has only one;
a LeaderWorkerSet's leader reuses the worker template), so every rank is probed like node 0:
HTTP GET `/health` and `/ready` on `--port`. Node 0's FastAPI server answers there; a worker
node answers from this small stdlib server (no FastAPI, no event loop) running in a daemon
thread beside its ranks. An HTTP answer says more than an open TCP port (loading vs. serving vs.
lost its group), and costs nothing per probe, unlike an exec probe that starts a Python.

- `/health` (startup and liveness): 200 while this node's ranks are alive, loading or serving;
  503 once one of them died or the group shut down (the driver went away). A worker whose
  in-process rank fails exits at once, so its probes then fail by connection refused.
- `/ready` (readiness): 200 once every rank of this node loaded its shard and joined the driver,
  503 before that and after the group is gone.
- Anything else: 404. Bodies are small JSON objects saying why.

Invariants: stdlib only; `NodeHealth` is safe to read from the server thread while the launcher
updates it; the server binds before any rank starts, so a taken port fails the node at once.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class ReadyFlag(Protocol):
    """What a rank sets once it has loaded and joined the driver (threading or multiprocessing Event)."""

    def is_set(self) -> bool: ...


class NodeHealth:
    """The state of one worker node's ranks, as the kubelet's probes see it."""

    def __init__(self, ready_flags: Sequence[ReadyFlag], is_alive: Callable[[], bool]) -> None:
        self._ready_flags = tuple(ready_flags)
        self._is_alive = is_alive  # every spawned rank process still runs
        self._lock = threading.Lock()
        self._stopped: str | None = None

    def stop(self, reason: str) -> None:
        """The group is gone (or this node is shutting down): unhealthy from now on."""
        with self._lock:
            if self._stopped is None:
                self._stopped = reason

    def check(self) -> tuple[bool, bool, str]:
        """(healthy, ready, what a human should know)."""
        with self._lock:
            stopped = self._stopped
        if stopped is not None:
            return False, False, stopped
        if not self._is_alive():
            return False, False, "a rank process of this node exited"
        num_ready = sum(flag.is_set() for flag in self._ready_flags)
        if num_ready < len(self._ready_flags):
            return True, False, f"loading: {num_ready}/{len(self._ready_flags)} ranks ready"
        return True, True, "serving"


def _handler(health: NodeHealth) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            healthy, ready, detail = health.check()
            if self.path == "/health":
                self._send(200 if healthy else 503, {"status": "ok" if healthy else "dead", "detail": detail})
            elif self.path == "/ready":
                self._send(200 if ready else 503, {"ready": ready, "reason": detail})
            else:
                self._send(404, {"error": f"{self.path} is not served by a worker node; try /health or /ready"})

        def _send(self, code: int, body: dict[str, Any]) -> None:
            payload = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            # Probes come every few seconds for the pod's whole life: keep them out of the INFO log.
            logger.debug("health probe: " + format, *args)

    return Handler


def serve_health(host: str, port: int, health: NodeHealth) -> ThreadingHTTPServer:
    """Bind host:port and answer probes from a daemon thread; `shutdown()` + `server_close()` stop it."""
    server = ThreadingHTTPServer((host, port), _handler(health))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="tidepool-health", daemon=True).start()
    logger.info("worker-node health endpoint on %s:%d (/health, /ready)", host, port)
    return server
