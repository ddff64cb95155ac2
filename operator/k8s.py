"""A small asyncio Kubernetes REST client for the reconciler (aiohttp; kopf already depends on it).

Why not the `kubernetes` package: it is synchronous, deserialises every response into models and
adds ~50 MB to the operator's RSS. The reconciler needs a handful of verbs on plain dicts: get, list
(label selector), server-side apply (one field manager, force), delete, merge-patch of status, and
API discovery. Credentials come from the pod's ServiceAccount (in-cluster) or a kubeconfig with a
token or client certificate (exec plugins are not supported); the same credentials feed kopf's
login handler (`connection_info()`), so both talk to the server as the same identity.

Invariants: no module-level state; one aiohttp session per client; a 401 re-reads a token file
once (projected ServiceAccount tokens rotate) and retries.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import aiohttp
import yaml

FIELD_MANAGER = "tidepool-operator"
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

# kind -> (api prefix path, plural) for everything the operator manages or reads.
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Pod": ("/api/v1", "pods"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
    "Event": ("/api/v1", "events"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "LeaderWorkerSet": ("/apis/leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    "ServiceMonitor": ("/apis/monitoring.coreos.com/v1", "servicemonitors"),
    "InferenceService": ("/apis/tidepool.dev/v1alpha1", "inferenceservices"),
}


class ApiError(RuntimeError):
    """A non-2xx answer from the API server; `status` is the HTTP code, the message is the server's."""

    def __init__(self, status: int, message: str, reason: str = "") -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


@dataclass(frozen=True, slots=True)
class Credentials:
    server: str
    ca_file: str | None = None
    insecure: bool = False
    token: str | None = None
    token_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    namespace: str | None = None

    def current_token(self) -> str | None:
        if self.token_file:
            return Path(self.token_file).read_text().strip()
        return self.token


def _materialise(data_b64: str | None, path: str | None, base: Path, suffix: str) -> str | None:
    """kubeconfig `*-data` fields are base64 PEM; ssl wants files. Write them 0600 into a private temp dir."""
    if path:
        return str((base / path).resolve()) if not os.path.isabs(path) else path
    if not data_b64:
        return None
    fd, out = tempfile.mkstemp(prefix="tidepool-", suffix=suffix)
    with os.fdopen(fd, "wb") as fh:
        fh.write(base64.b64decode(data_b64))
    return out


def load_credentials(kubeconfig: str | None = None, context: str | None = None) -> Credentials:
    """In-cluster ServiceAccount when no kubeconfig is given (or $KUBECONFIG unset) and we run in a pod."""
    kubeconfig = kubeconfig or os.environ.get("KUBECONFIG")
    if not kubeconfig and os.environ.get("KUBERNETES_SERVICE_HOST"):
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        host = f"[{host}]" if ":" in host else host
        ns_file = SA_DIR / "namespace"
        return Credentials(
            server=f"https://{host}:{port}",
            ca_file=str(SA_DIR / "ca.crt"),
            token_file=str(SA_DIR / "token"),
            namespace=ns_file.read_text().strip() if ns_file.exists() else None,
        )
    path = Path(kubeconfig or Path.home() / ".kube" / "config")
    if not path.exists():
        raise RuntimeError(f"no kubeconfig at {path} and not running in a pod; pass --kubeconfig")
    cfg = yaml.safe_load(path.read_text()) or {}
    ctx_name = context or cfg.get("current-context")
    ctx = next((c["context"] for c in cfg.get("contexts", []) if c["name"] == ctx_name), None)
    if ctx is None:
        raise RuntimeError(f"kubeconfig {path}: context {ctx_name!r} not found")
    cluster = next(c["cluster"] for c in cfg.get("clusters", []) if c["name"] == ctx["cluster"])
    user = next((u["user"] for u in cfg.get("users", []) if u["name"] == ctx.get("user")), {}) or {}
    if "exec" in user or "auth-provider" in user:
        raise RuntimeError(f"kubeconfig {path}: exec/auth-provider users are not supported; use a token")
    base = path.parent
    return Credentials(
        server=cluster["server"].rstrip("/"),
        ca_file=_materialise(
            cluster.get("certificate-authority-data"), cluster.get("certificate-authority"), base, ".crt"
        ),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        token=user.get("token"),
        token_file=user.get("tokenFile"),
        cert_file=_materialise(user.get("client-certificate-data"), user.get("client-certificate"), base, ".crt"),
        key_file=_materialise(user.get("client-key-data"), user.get("client-key"), base, ".key"),
        namespace=ctx.get("namespace"),
    )


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


class KubeClient:
    """Async REST calls with one aiohttp session. Use `async with KubeClient(creds) as client:`."""

    def __init__(self, creds: Credentials, max_connections: int = 32) -> None:
        self.creds = creds
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self.num_requests = 0

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
        url = self.creds.server + path + (f"?{urlencode(params)}" if params else "")
        data = None if body is None else json.dumps(body)
        for attempt in range(2):
            headers = {"Accept": "application/json", "Content-Type": content_type}
            token = self.creds.current_token()
            if token:
                headers["Authorization"] = f"Bearer {token}"
            self.num_requests += 1
            async with session.request(method, url, data=data, headers=headers) as resp:
                raw = await resp.read()
                if resp.status == 401 and attempt == 0 and self.creds.token_file:
                    continue  # the projected token may have rotated under us: re-read and retry once
                try:
                    payload: dict[str, Any] = json.loads(raw) if raw else {}
                except ValueError:  # e.g. "404 page not found" for an API group that is not served
                    payload = {"message": raw.decode(errors="replace")}
                if resp.status >= 400:
                    raise ApiError(
                        resp.status, payload.get("message", raw.decode(errors="replace")), payload.get("reason", "")
                    )
                return payload
        raise ApiError(401, "unauthorized after re-reading the token", "Unauthorized")

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str | None, label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        answer = await self.request("GET", resource_path(kind, namespace), params=params)
        items = answer.get("items", [])
        api_version = answer.get("apiVersion", "v1")
        for item in items:  # list items carry no kind/apiVersion; the reconciler compares on them
            item.setdefault("kind", kind)
            item.setdefault("apiVersion", api_version)
        return items

    async def apply(self, obj: dict[str, Any], force: bool = True) -> dict[str, Any]:
        """Server-side apply as FIELD_MANAGER (force: we own every field we set; hand edits lose)."""
        params = {"fieldManager": FIELD_MANAGER, "force": "true" if force else "false"}
        return await self.request(
            "PATCH", object_path(obj), body=obj, params=params, content_type="application/apply-patch+yaml"
        )

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

    async def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        return await self.request(
            "PATCH",
            resource_path(kind, namespace, name, "status"),
            body={"status": status},
            content_type="application/merge-patch+json",
        )

    async def has_kind(self, group_version: str, kind: str) -> bool:
        """API discovery: is `kind` served under `group_version` (e.g. 'leaderworkerset.x-k8s.io/v1')?"""
        found = await self.get(f"/apis/{group_version}")
        return bool(found) and any(r.get("kind") == kind for r in found.get("resources", []))
