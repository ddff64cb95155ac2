"""A small asyncio Kubernetes REST client for the controller (aiohttp; kopf already depends on it).

Why not the `kubernetes` package: it is synchronous, deserialises every response into models and
adds ~50 MB to the operator's RSS. The controller needs a handful of verbs on plain dicts: paged
list and watch (label-selected, for the informer caches), server-side apply (one field manager,
force), create/replace (the leader Lease), delete with a uid precondition, merge patches with a
resourceVersion precondition (status), and API discovery.

Invariants: no module-level state; one aiohttp session per client; every request first takes a
token from the client's bucket (QPS/burst, like client-go); a 429 (API Priority and Fairness, or
any throttling) is retried after the server's Retry-After, a bounded number of times; a 401
re-reads a token file once (projected ServiceAccount tokens rotate) and retries.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import aiohttp

from tidepool.operator.credentials import SA_DIR, Credentials, load_credentials
from tidepool.operator.metrics import REST_REQUESTS
from tidepool.operator.ratelimit import TokenBucket

__all__ = ["FIELD_MANAGER", "RESOURCES", "SA_DIR", "ApiError", "Credentials", "KubeClient", "load_credentials"]

FIELD_MANAGER = "tidepool-operator"
MAX_THROTTLE_RETRIES = 8
MAX_RETRY_AFTER_S = 30.0
logger = logging.getLogger("tidepool.operator.k8s")

# kind -> (api prefix path, plural) for everything the operator manages or reads.
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Secret": ("/api/v1", "secrets"),  # control keys created; spec.auth's Secret read by name (api_keys.py)
    "Pod": ("/api/v1", "pods"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
    "Event": ("/api/v1", "events"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "LeaderWorkerSet": ("/apis/leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    "ServiceMonitor": ("/apis/monitoring.coreos.com/v1", "servicemonitors"),
    "InferencePool": ("/apis/inference.networking.k8s.io/v1", "inferencepools"),
    "InferenceService": ("/apis/tidepool.dev/v1alpha1", "inferenceservices"),
    "Lease": ("/apis/coordination.k8s.io/v1", "leases"),
    "EndpointSlice": ("/apis/discovery.k8s.io/v1", "endpointslices"),
}


class ApiError(RuntimeError):
    """A non-2xx answer from the API server; `status` is the HTTP code, the message is the server's."""

    def __init__(self, status: int, message: str, reason: str = "", retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after


def resource_path(kind: str, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
    prefix, plural = RESOURCES[kind]
    path = f"{prefix}/namespaces/{quote(namespace)}/{plural}" if namespace else f"{prefix}/{plural}"
    if name:
        path += f"/{quote(name)}"
    if sub:
        path += f"/{sub}"
    return path


def object_path(obj: dict[str, Any], sub: str | None = None) -> str:
    meta = obj["metadata"]
    return resource_path(obj["kind"], meta.get("namespace"), meta["name"], sub)


def _retry_after(headers: Mapping[str, str]) -> float:
    try:
        return min(max(float(headers.get("Retry-After", "1")), 0.0), MAX_RETRY_AFTER_S)
    except ValueError:  # an HTTP date instead of seconds: the server only asks for "later"
        return 1.0


class KubeClient:
    """Async REST calls with one aiohttp session. Use `async with KubeClient(creds) as client:`."""

    def __init__(self, creds: Credentials, max_connections: int = 32, qps: float = 0.0, burst: int = 1) -> None:
        self.creds = creds
        self._host = urlsplit(creds.server).netloc  # rest_client_requests_total's `host`
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self.limiter = TokenBucket(qps, max(burst, 1))
        self.num_requests = 0
        self.requests_by_verb: Counter[str] = Counter()
        self.seconds_by_verb: Counter[str] = Counter()  # time from asking for a token to the answer
        self.num_throttled = 0  # 429 answers, each retried after Retry-After

    async def __aenter__(self) -> KubeClient:
        await self.open()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        if self._session is not None:
            return
        ctx: ssl.SSLContext | bool
        if self.creds.insecure:
            ctx = False
        else:
            ctx = ssl.create_default_context(cafile=self.creds.ca_file)
            if self.creds.cert_file and self.creds.key_file:
                ctx.load_cert_chain(self.creds.cert_file, self.creds.key_file)
        connector = aiohttp.TCPConnector(ssl=ctx, limit=self._max_connections)
        # No total timeout: under a burst, time spent queueing for a pooled connection must not count.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self, content_type: str) -> dict[str, str]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        token = self.creds.current_token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _url(self, path: str, params: dict[str, str] | None) -> str:
        return self.creds.server + path + (f"?{urlencode(params)}" if params else "")

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        await self.open()
        session = self._session
        if session is None:
            raise RuntimeError("KubeClient session is closed")
        url = self._url(path, params)
        data = None if body is None else json.dumps(body, separators=(",", ":"))
        reauthenticated = False
        started = time.monotonic()
        try:
            return await self._request(session, method, url, path, data, content_type, reauthenticated)
        finally:
            self.seconds_by_verb[method] += time.monotonic() - started

    async def _request(
        self,
        session: aiohttp.ClientSession,
        method: str,
        url: str,
        path: str,
        data: str | None,
        content_type: str,
        reauthenticated: bool,
    ) -> dict[str, Any]:
        for _attempt in range(MAX_THROTTLE_RETRIES + 2):
            await self.limiter.acquire()
            self.num_requests += 1
            self.requests_by_verb[method] += 1
            try:
                async with session.request(method, url, data=data, headers=self._headers(content_type)) as resp:
                    status, headers, raw = resp.status, resp.headers, await resp.read()
            except (aiohttp.ClientError, TimeoutError, OSError):
                REST_REQUESTS.labels("<error>", method, self._host).inc()
                raise
            REST_REQUESTS.labels(str(status), method, self._host).inc()
            if status == 401 and not reauthenticated and self.creds.token_file:
                reauthenticated = True
                continue  # the projected token may have rotated under us: re-read and retry once
            if status == 429:
                self.num_throttled += 1
                delay = _retry_after(headers)
                logger.info("API server throttled %s %s (429); retrying after %.1fs", method, path, delay)
                await asyncio.sleep(delay)
                continue
            try:
                payload: dict[str, Any] = json.loads(raw) if raw else {}
            except ValueError:  # e.g. "404 page not found" for an API group that is not served
                payload = {"message": raw.decode(errors="replace")}
            if status >= 400:
                raise ApiError(status, payload.get("message", raw.decode(errors="replace")), payload.get("reason", ""))
            return payload
        raise ApiError(429, f"{method} {path}: still throttled after {MAX_THROTTLE_RETRIES} retries", "TooManyRequests")

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def get_object(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return await self.get(resource_path(kind, namespace, name))

    async def list_page(
        self, kind: str, namespace: str | None, label_selector: str | None, limit: int = 500, cont: str = ""
    ) -> tuple[list[dict[str, Any]], str, str]:
        """One page of a list: (items with kind/apiVersion set, the list's resourceVersion, continue token)."""
        params = {"limit": str(limit)}
        if label_selector:
            params["labelSelector"] = label_selector
        if cont:
            params["continue"] = cont
        answer = await self.request("GET", resource_path(kind, namespace), params=params)
        items = answer.get("items") or []
        api_version = answer.get("apiVersion", "v1")
        for item in items:  # list items carry no kind/apiVersion; the controller compares on them
            item.setdefault("kind", kind)
            item.setdefault("apiVersion", api_version)
        meta = answer.get("metadata") or {}
        return items, meta.get("resourceVersion", ""), meta.get("continue", "")

    async def list(self, kind: str, namespace: str | None, label_selector: str | None = None) -> list[dict[str, Any]]:
        """Every item (all pages). The controller reads from its caches; this serves tools and tests."""
        items, _, cont = await self.list_page(kind, namespace, label_selector)
        while cont:
            more, _, cont = await self.list_page(kind, namespace, label_selector, cont=cont)
            items += more
        return items

    async def watch(
        self, kind: str, namespace: str | None, label_selector: str | None, resource_version: str, timeout_s: int
    ) -> AsyncIterator[dict[str, Any]]:
        """Watch events ({type, object}) from `resource_version` with bookmarks, until the server ends it."""
        await self.open()
        session = self._session
        if session is None:
            raise RuntimeError("KubeClient session is closed")
        params = {
            "watch": "1",
            "allowWatchBookmarks": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(int(timeout_s)),
        }
        if label_selector:
            params["labelSelector"] = label_selector
        await self.limiter.acquire()
        self.num_requests += 1
        self.requests_by_verb["WATCH"] += 1
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout_s + 60)
        url = self._url(resource_path(kind, namespace), params)
        try:
            resp = await session.get(url, headers=self._headers("application/json"), timeout=timeout)
        except (aiohttp.ClientError, TimeoutError, OSError):
            REST_REQUESTS.labels("<error>", "GET", self._host).inc()
            raise
        REST_REQUESTS.labels(str(resp.status), "GET", self._host).inc()  # client-go counts a watch as its GET
        async with resp:  # released (the connection closed or returned) however the watch ends
            if resp.status >= 400:
                raw = await resp.read()
                retry = _retry_after(resp.headers) if resp.status == 429 else None
                raise ApiError(resp.status, raw.decode(errors="replace")[:500], "", retry_after=retry)
            buffer = bytearray()
            async for chunk in resp.content.iter_any():
                buffer += chunk
                start = 0
                while (end := buffer.find(b"\n", start)) >= 0:
                    line = bytes(buffer[start:end])
                    start = end + 1
                    if line.strip():
                        yield json.loads(line)
                del buffer[:start]

    async def apply(self, obj: dict[str, Any], force: bool = True) -> dict[str, Any]:
        """Server-side apply as FIELD_MANAGER (force: we own every field we set; hand edits lose)."""
        params = {"fieldManager": FIELD_MANAGER, "force": "true" if force else "false"}
        return await self.request(
            "PATCH", object_path(obj), body=obj, params=params, content_type="application/apply-patch+yaml"
        )

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return await self.request("POST", resource_path(obj["kind"], meta.get("namespace")), body=obj)

    async def replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        """PUT: fails with 409 unless metadata.resourceVersion is still current (compare-and-swap)."""
        return await self.request("PUT", object_path(obj), body=obj)

    async def delete(self, obj: dict[str, Any]) -> None:
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        uid = obj["metadata"].get("uid")
        if uid:
            body["preconditions"] = {"uid": uid}  # never delete a newer object that reuses the name
        try:
            await self.request("DELETE", object_path(obj), body=body)
        except ApiError as exc:
            if exc.status not in (404, 409):
                raise

    async def patch_merge(
        self, kind: str, namespace: str, name: str, body: dict[str, Any], sub: str | None = None
    ) -> dict[str, Any]:
        """A JSON merge patch; a `metadata.resourceVersion` in `body` makes it conditional (409 if stale)."""
        return await self.request(
            "PATCH", resource_path(kind, namespace, name, sub), body=body, content_type="application/merge-patch+json"
        )

    async def patch_status(
        self, kind: str, namespace: str, name: str, status: dict[str, Any], resource_version: str | None = None
    ) -> dict[str, Any]:
        """Merge-patch the status subresource; with `resource_version` only if the object is unchanged."""
        body: dict[str, Any] = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        return await self.patch_merge(kind, namespace, name, body, sub="status")

    async def has_kind(self, group_version: str, kind: str) -> bool:
        """API discovery: is `kind` served under `group_version` (e.g. 'leaderworkerset.x-k8s.io/v1')?"""
        found = await self.get(f"/apis/{group_version}")
        return bool(found) and any(r.get("kind") == kind for r in found.get("resources", []))
