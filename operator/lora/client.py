"""Reaching one engine replica's LoRA endpoints: list, load, unload (vLLM's API on `tidepool serve`).

`ReplicaApi` is the seam: `HttpReplicaApi` speaks HTTP to a pod's base URL, which a resolver gives. The
default resolver is the pod's IP and the engine port, from the operator's pod cache (as the autoscaler's
`PodsSource` scrapes metrics: no API request). KWOK pods have no real IPs, so tests set
TIDEPOOL_POD_URL_TEMPLATE (e.g. `http://127.0.0.1:9000/{namespace}/{pod}`) to put real `tidepool serve`
processes behind fake pods.

Endpoints: `GET /v1/models` (adapters are the entries with a `parent`; `root` is the path they were
loaded from), `POST /v1/load_lora_adapter {"lora_name", "lora_path"}`, `POST /v1/unload_lora_adapter
{"lora_name"}`; replies 200 (plain text) or an OpenAI-style error body whose message becomes the reason.

With spec.auth every call carries `Authorization: Bearer <key>` (the key from the service's Secret,
operator/api_keys.py; None sends no header); a refused key is a `Reply` with status 401 (a listing: None).

Invariants: never raises for a replica's failure (an unreachable replica lists None; a refused load is a
`Reply` with its status and message); the load timeout covers an engine fetching the adapter itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from tidepool.operator.builders.common import ENGINE_PORT
from tidepool.operator.cache import PodInfo

URL_TEMPLATE_ENV = "TIDEPOOL_POD_URL_TEMPLATE"
LIST_TIMEOUT_S = 5.0
LOAD_TIMEOUT_S = 900.0  # an hf:// or s3:// adapter is fetched by the engine inside the call
UNLOAD_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Reply:
    status: int  # HTTP status; 0 when the replica could not be reached
    message: str

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


class ReplicaApi(Protocol):
    async def adapters(self, namespace: str, pod: PodInfo, api_key: str | None = None) -> dict[str, str] | None: ...
    async def load(self, namespace: str, pod: PodInfo, name: str, path: str, api_key: str | None = None) -> Reply: ...
    async def unload(self, namespace: str, pod: PodInfo, name: str, api_key: str | None = None) -> Reply: ...


Resolver = Callable[[str, PodInfo], str | None]


def pod_ip_url(namespace: str, pod: PodInfo) -> str | None:
    """http://<pod IP>:<engine port>, or None while the pod has no IP."""
    if not pod.ip:
        return None
    host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
    return f"http://{host}:{ENGINE_PORT}"


def template_resolver(template: str) -> Resolver:
    return lambda namespace, pod: template.format(namespace=namespace, pod=pod.name, ip=pod.ip or "")


def resolver_from_env() -> Resolver:
    template = os.environ.get(URL_TEMPLATE_ENV)
    return template_resolver(template) if template else pod_ip_url


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The request headers that authenticate to a pod of a service with spec.auth (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _error_message(response: httpx.Response) -> str:
    """The OpenAI-style error's message, or the body's text."""
    try:
        body: Any = response.json()
    except ValueError:
        return response.text.strip()[:2000]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])[:2000]
    return response.text.strip()[:2000]


class HttpReplicaApi:
    """`ReplicaApi` over httpx; `resolve` maps a pod to its base URL."""

    def __init__(self, http: httpx.AsyncClient, resolve: Resolver | None = None) -> None:
        self.http = http
        self.resolve = resolve or resolver_from_env()

    async def adapters(self, namespace: str, pod: PodInfo, api_key: str | None = None) -> dict[str, str] | None:
        base = self.resolve(namespace, pod)
        if base is None:
            return None
        try:
            response = await self.http.get(f"{base}/v1/models", headers=auth_headers(api_key), timeout=LIST_TIMEOUT_S)
            response.raise_for_status()
            entries = response.json().get("data") or []
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return {str(e["id"]): str(e.get("root") or "") for e in entries if isinstance(e, dict) and e.get("parent")}

    async def _post(
        self, base: str | None, path: str, body: dict[str, str], timeout: float, api_key: str | None
    ) -> Reply:
        if base is None:
            return Reply(0, "the pod has no address yet")
        try:
            response = await self.http.post(f"{base}{path}", json=body, headers=auth_headers(api_key), timeout=timeout)
        except httpx.HTTPError as exc:
            return Reply(0, f"{type(exc).__name__}: {exc}"[:2000])
        if response.is_success:
            return Reply(response.status_code, response.text.strip()[:2000])
        return Reply(response.status_code, _error_message(response))

    async def load(self, namespace: str, pod: PodInfo, name: str, path: str, api_key: str | None = None) -> Reply:
        body = {"lora_name": name, "lora_path": path}
        base = self.resolve(namespace, pod)
        return await self._post(base, "/v1/load_lora_adapter", body, LOAD_TIMEOUT_S, api_key)

    async def unload(self, namespace: str, pod: PodInfo, name: str, api_key: str | None = None) -> Reply:
        body = {"lora_name": name}
        return await self._post(
            self.resolve(namespace, pod), "/v1/unload_lora_adapter", body, UNLOAD_TIMEOUT_S, api_key
        )
