"""A synthetic metrics feed for the autoscaler on the control plane (KWOK pods serve nothing).

`Feed` plays the pods' `/metrics`: for each pool it returns one Prometheus block per Ready pod of
that pool (so data is complete exactly when real scrapes would be) plus a router block with held
requests; `feed_server(feed)` serves it on loopback for the operator's
TIDEPOOL_METRICS_SOURCE_URL_TEMPLATE (`<url>/{namespace}/{name}/{pool}`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kubernetes import client

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, float("inf"))


def histogram(name: str, count: int, value: float) -> list[str]:
    lines = [f"# TYPE {name} histogram"]
    for le in TTFT_BUCKETS:
        label = "+Inf" if le == float("inf") else repr(le)
        lines.append(f'{name}_bucket{{model_name="m",le="{label}"}} {count if value <= le else 0}')
    lines += [f'{name}_count{{model_name="m"}} {count}', f'{name}_sum{{model_name="m"}} {count * value}']
    return lines


class Feed:
    """Per-pool synthetic load; counters grow by `requests` per scrape of each pod while active."""

    def __init__(self, cluster) -> None:
        self.core = client.CoreV1Api(cluster.api_client())
        self.url = ""  # the feed server's base URL, set while feed_server serves it
        self.load: dict[str, dict[str, float]] = {}
        self.held: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def set(self, pool: str, kv: float = 0.0, requests: int = 0, ttft: float = 0.1) -> None:
        with self.lock:
            self.load[pool] = {"kv": kv, "requests": requests, "ttft": ttft}

    def body(self, namespace: str, name: str, pool: str) -> str:
        selector = f"tidepool.dev/inferenceservice={name},tidepool.dev/pool={pool}"
        listed = self.core.list_namespaced_pod(namespace, label_selector=selector, _request_timeout=(5, 10))
        ready = [p for p in listed.items if _ready(p)]
        blocks = []
        with self.lock:
            load = self.load.get(pool, {"kv": 0.0, "requests": 0, "ttft": 0.1})
            for pod in ready:
                key = pod.metadata.name
                self.counts[key] = self.counts.get(key, 0) + int(load["requests"])
                lines = [
                    f"# pod: {key}",
                    f'vllm:kv_cache_usage_perc{{model_name="m"}} {load["kv"]}',
                    'vllm:num_requests_waiting{model_name="m"} 0',
                    f'vllm:num_requests_running{{model_name="m"}} {1 if load["requests"] else 0}',
                    *histogram("vllm:time_to_first_token_seconds", self.counts[key], load["ttft"]),
                ]
                blocks.append("\n".join(lines))
            blocks.append(f'# pod: router-0\ntidepool_router_held_requests{{pool="{pool}"}} {self.held.get(pool, 0)}')
        return "\n".join(blocks) + "\n"


def _ready(pod) -> bool:
    return pod.status.phase == "Running" and any(
        c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []
    )


@contextmanager
def feed_server(feed: Feed) -> Iterator[str]:
    """Serve `feed` on loopback; yields the base URL. On exit the server stops and its threads are joined:
    a handler still in `feed.body` would call the API server during interpreter shutdown (see
    test_cp_operator_chaos.ReplicaRecorder for why that aborts the test process)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            _, namespace, name, pool = self.path.split("/")
            data = feed.body(namespace, name, pool).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = False  # server_close() joins the request threads (HTTP/1.0: one request each)
    thread = threading.Thread(target=server.serve_forever, name="autoscale-feed", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
