"""A tiny aggregated API server for `external.metrics.k8s.io/v1beta1`, so a real HPA has a metrics API.

What KEDA's metrics server or prometheus-adapter serve to the HPA controller, reduced to what it asks:
discovery of the group version, and `GET .../namespaces/<ns>/<metric>` answering an
`ExternalMetricValueList`. The value of each metric is set by the test (`stub.values[metric]`); every
request is recorded. HTTPS with a serving certificate from the cluster's CA (the APIService carries
that CA as its caBundle), in a thread of the test process.

`register(cluster, stub, namespace)` makes the kube-apiserver route the group to it: an ExternalName
Service `metrics-stub` naming this host's loopback address (the aggregator dials an ExternalName
Service's name directly; a Service with endpoints would need --enable-aggregator-routing and a
non-loopback address), and the APIService `v1beta1.external.metrics.k8s.io`; it waits until the
APIService is Available (the apiserver reached the stub). `unregister` removes both.
"""

from __future__ import annotations

import json
import re
import ssl
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

GROUP, VERSION = "external.metrics.k8s.io", "v1beta1"
GROUP_VERSION = f"{GROUP}/{VERSION}"
APISERVICE = f"{VERSION}.{GROUP}"
SERVICE = "metrics-stub"
_METRIC_PATH = re.compile(rf"^/apis/{re.escape(GROUP_VERSION)}/namespaces/([^/]+)/([^/?]+)")


class MetricsStub:
    """Serves external metrics from `values` (metric name -> value) until `close()`."""

    def __init__(self, cert: Path, key: Path, host: str = "127.0.0.1") -> None:
        self.values: dict[str, float] = {}
        self.requests: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's name
                stub.requests.append(self.path)
                status, body = stub.answer(self.path)
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *_args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer((host, 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="metrics-stub", daemon=True)
        self.thread.start()

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        if path.split("?")[0] == f"/apis/{GROUP_VERSION}":
            return 200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": GROUP_VERSION, "resources": []}
        match = _METRIC_PATH.match(path)
        if match is None or match.group(2) not in self.values:
            return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404, "reason": "NotFound"}
        metric = match.group(2)
        item = {
            "metricName": metric,
            "metricLabels": {},
            "timestamp": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "value": f"{int(self.values[metric] * 1000)}m",
        }
        return 200, {"kind": "ExternalMetricValueList", "apiVersion": GROUP_VERSION, "metadata": {}, "items": [item]}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def register(cluster, stub: MetricsStub, namespace: str, ca_crt: Path) -> None:
    """Route external.metrics.k8s.io to the stub and wait until the API server reports it Available."""
    import base64

    docs = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": SERVICE, "namespace": namespace},
            "spec": {"type": "ExternalName", "externalName": "localhost", "ports": [{"port": stub.port}]},
        },
        {
            "apiVersion": "apiregistration.k8s.io/v1",
            "kind": "APIService",
            "metadata": {"name": APISERVICE},
            "spec": {
                "group": GROUP,
                "version": VERSION,
                "service": {"namespace": namespace, "name": SERVICE, "port": stub.port},
                "caBundle": base64.b64encode(ca_crt.read_bytes()).decode(),
                "groupPriorityMinimum": 100,
                "versionPriority": 100,
            },
        },
    ]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    cluster.kubectl("wait", "--for=condition=Available", f"apiservice/{APISERVICE}", "--timeout=60s", timeout=70)


def unregister(cluster, namespace: str) -> None:
    cluster.kubectl("delete", "apiservice", APISERVICE, "--ignore-not-found", check=False)
    cluster.kubectl("delete", "service", SERVICE, "-n", namespace, "--ignore-not-found", check=False)
