"""Credentials for the API server: the pod's ServiceAccount (in-cluster) or a kubeconfig.

A kubeconfig user may hold a token, a token file or a client certificate (exec plugins and auth
providers are refused with a message). The same `Credentials` feed the operator's REST client and
kopf's login handler, so both talk to the server as the same identity. Projected ServiceAccount
tokens rotate: `current_token()` re-reads the file each time.
"""

from __future__ import annotations

import base64
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


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
