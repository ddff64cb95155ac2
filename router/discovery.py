"""Replica discovery: a static list for local use, or the EndpointSlices of the pools' Kubernetes Services.

Static: `--unified-url URL`, `--prefill-url URL`, `--decode-url URL,kv=HOST:PORT` (each
repeatable). A decode replica must name its KV-transfer listener (`kv=`): the prefill
replica pushes KV blocks there.

Kubernetes: every `interval_s`, list `discovery.k8s.io/v1` EndpointSlices labelled
`kubernetes.io/service-name=<Service>` in the namespace, over plain HTTPS to the API
server with the pod's service-account token (re-read each time: projected tokens rotate)
and CA. Each non-terminating endpoint address becomes a replica `http://ADDR:PORT`, where
PORT is the Service port named `http` (or the only port not named `kv`), and the port
named `kv`, if any, gives its KV address `ADDR:KVPORT`. Readiness is then the router's own
`/ready` probe (faster than the kubelet's, and it also sees draining). An API error keeps
the last membership: a hiccup of the API server must not empty a pool.
The router's service account needs `get`/`list` on `endpointslices` in its namespace.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from .pool import Endpoint

logger = logging.getLogger(__name__)

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
KV_PORT_NAME = "kv"

OnUpdate = Callable[[str, list[Endpoint]], Awaitable[None]]  # (pool name, endpoints)


def parse_static_url(value: str, flag: str, needs_kv: bool = False) -> Endpoint:
    """`http://host:port` or `http://host:port,kv=host:port` -> Endpoint; ValueError naming the flag."""
    url, *options = value.split(",")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"{flag} {value!r}: expected http://HOST:PORT (scheme, host and port)")
    if parts.path not in ("", "/"):
        raise ValueError(f"{flag} {value!r}: give the server's base URL without a path (the router adds /v1/...)")
    kv_addr = None
    for option in options:
        name, _, addr = option.partition("=")
        if name != "kv" or not _valid_host_port(addr):
            raise ValueError(f"{flag} {value!r}: unknown option {option!r}; the only option is kv=HOST:PORT")
        kv_addr = addr
    if needs_kv and kv_addr is None:
        raise ValueError(f"{flag} {value!r}: a decode replica needs its KV listener: {url},kv=HOST:PORT")
    return Endpoint(f"{parts.scheme}://{parts.netloc}", kv_addr)


def _valid_host_port(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def endpoints_from_slices(slices: dict[str, Any], port_name: str = "http") -> list[Endpoint]:
    """The replicas in an EndpointSliceList (the API's JSON), sorted by URL."""
    found: dict[str, Endpoint] = {}
    for item in slices.get("items") or []:
        ports = {p.get("name") or "": p.get("port") for p in item.get("ports") or [] if p.get("port")}
        http_port = ports.get(port_name)
        if http_port is None:
            others = [port for name, port in ports.items() if name != KV_PORT_NAME]
            http_port = others[0] if len(others) == 1 else None
        if http_port is None:
            logger.warning(
                "EndpointSlice %s has no port named %r; skipped", item.get("metadata", {}).get("name"), port_name
            )
            continue
        kv_port = ports.get(KV_PORT_NAME)
        is_ipv6 = item.get("addressType") == "IPv6"
        for endpoint in item.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("terminating"):
                continue
            for addr in endpoint.get("addresses") or []:
                host = f"[{addr}]" if is_ipv6 else addr
                url = f"http://{host}:{http_port}"
                found[url] = Endpoint(url, f"{host}:{kv_port}" if kv_port else None)
    return [found[url] for url in sorted(found)]


class StaticDiscovery:
    def __init__(self, members: dict[str, list[Endpoint]]) -> None:
        self.members = members

    async def run(self, on_update: OnUpdate) -> None:
        for pool, endpoints in self.members.items():
            await on_update(pool, endpoints)


@dataclass(slots=True)
class KubernetesConfig:
    namespace: str
    services: dict[str, str]  # pool name -> Service name
    api_server: str | None = None  # default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
    token_file: Path = field(default_factory=lambda: SA_DIR / "token")
    ca_file: Path | None = field(default_factory=lambda: SA_DIR / "ca.crt")  # None: the system CAs
    port_name: str = "http"
    interval_s: float = 2.0

    def server(self) -> str:
        if self.api_server:
            return self.api_server.rstrip("/")
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError("not in a Kubernetes pod (KUBERNETES_SERVICE_HOST unset): pass --kube-api-server")
        return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


class KubernetesDiscovery:
    def __init__(self, config: KubernetesConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.server = config.server()
        self._transport = transport  # tests pass a mock transport

    def _client(self) -> httpx.AsyncClient:
        ca = self.config.ca_file
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca)) if ca and ca.is_file() else True
        return httpx.AsyncClient(base_url=self.server, verify=verify, timeout=10.0, transport=self._transport)

    def _headers(self) -> dict[str, str]:
        token_file = self.config.token_file
        return {"Authorization": f"Bearer {token_file.read_text().strip()}"} if token_file.is_file() else {}

    async def list_pool(self, client: httpx.AsyncClient, service: str) -> list[Endpoint]:
        path = f"/apis/discovery.k8s.io/v1/namespaces/{self.config.namespace}/endpointslices"
        response = await client.get(
            path, params={"labelSelector": f"{SERVICE_NAME_LABEL}={service}"}, headers=self._headers()
        )
        response.raise_for_status()
        return endpoints_from_slices(response.json(), self.config.port_name)

    async def run(self, on_update: OnUpdate) -> None:
        async with self._client() as client:
            while True:
                await self.poll_once(client, on_update)
                await asyncio.sleep(self.config.interval_s)

    async def poll_once(self, client: httpx.AsyncClient, on_update: OnUpdate) -> None:
        for pool, service in self.config.services.items():
            try:
                endpoints = await self.list_pool(client, service)
            except (httpx.HTTPError, ValueError, OSError) as err:
                logger.warning(
                    "discovery: listing endpoints of Service %s/%s failed, keeping the last list: %r",
                    self.config.namespace,
                    service,
                    err,
                )
                continue
            await on_update(pool, endpoints)
