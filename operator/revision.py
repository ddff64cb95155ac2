"""Pinned model revisions: a floating hf:// revision (a branch or tag, `main` when unset) is resolved to a
commit once per spec, recorded in `status.model`, and every pod of that spec downloads exactly that commit.

Who resolves, and why the operator: the commit must be known *before* any pod of the generation exists, so
it can be rendered into every pod's download init (`--revision <sha>`, and the cache folder named after the
commit). If the first download init resolved it, the operator could learn the commit only after that pod
ran, and would have to roll it (or let the replicas started meanwhile resolve on their own, which is the bug).
The operator asks the same endpoint with the same token as the download init: `HF_ENDPOINT` and `HF_TOKEN` of
`spec.model.credentials.secretName` (one narrow `get` of the Secret the spec names, the chart's RBAC for spec.auth's
Secret; the token lives in memory for the one request and is never logged, written or put in an Event), else
the public Hub anonymously. Call: `GET {endpoint}/api/models/{repo}/revision/{rev}` -> `sha`.

When it resolves again: when the spec changes, `replicas` fields left out (`spec_key`: an HPA writing
spec.replicas through the scale subresource bumps the generation, and must not roll every pod onto a newer
commit), or when annotation `tidepool.dev/resolve-revision` takes a new value (bump it to move onto the
branch's current head). Nothing else: a `main` that moves upstream does not roll pods until one of those
happens (documented in README). A restarted operator reads the record back from `status.model` and never
re-resolves an unchanged spec.

Failure: the resolver raises `RevisionError` with a one-line cause (HTTP status, unreachable endpoint); the sync
reports it (Degraded and Stalled, reason RevisionUnresolved), applies nothing (no pod of the spec is created
with an unresolved revision; pods of an earlier spec keep serving) and retries with the work queue's backoff.

Invariants: `spec_key`, `wanted`, `reuse`, `record`, `pin` and `unresolved_status` are pure; the `Resolver`
keeps no state (what was resolved lives in status, and in the sync's memory until status is written); a 40-hex
revision is already pinned and is never resolved.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from tidepool.contract.download import HF_DEFAULT_REVISION as DEFAULT_REVISION
from tidepool.contract.download import HF_ENDPOINT as DEFAULT_ENDPOINT
from tidepool.operator.api.status import InferenceServiceStatus, ModelStatus
from tidepool.operator.api.view import ServiceView
from tidepool.operator.k8s import ApiError, KubeClient, resource_path

RESOLVE_ANNOTATION = "tidepool.dev/resolve-revision"  # a new value re-resolves the floating revision
REASON = "RevisionUnresolved"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class RevisionError(Exception):
    """The floating revision could not be resolved; the message is one line naming the cause."""


@dataclass(frozen=True, slots=True)
class Wanted:
    """A floating revision to resolve, and what its resolution is valid for."""

    repo: str  # org/name
    revision: str  # the branch or tag as the spec names it (DEFAULT_REVISION when unset)
    spec_key: str  # the spec it is resolved for (replica counts left out)
    request: str | None  # the value of RESOLVE_ANNOTATION it is resolved for


def is_commit(revision: str) -> bool:
    """A full commit id: already pinned."""
    return bool(_COMMIT.match(revision))


def _without_replicas(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _without_replicas(v) for k, v in value.items() if k != "replicas"}
    if isinstance(value, list):
        return [_without_replicas(v) for v in value]
    return value


def spec_key(spec: Mapping[str, Any]) -> str:
    """A digest of the spec without replica counts: what a resolution is valid for."""
    canonical = json.dumps(_without_replicas(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def wanted(view: ServiceView, body: Mapping[str, Any]) -> Wanted | None:
    """The floating revision this spec needs resolved, or None (not hf://, or already a commit)."""
    model = view.spec.model
    scheme, _, rest = model.uri.partition("://")
    revision = model.revision or DEFAULT_REVISION
    if scheme != "hf" or is_commit(revision):
        return None
    annotations = body["metadata"].get("annotations") or {}
    return Wanted(rest.strip("/"), revision, spec_key(body.get("spec") or {}), annotations.get(RESOLVE_ANNOTATION))


def reuse(want: Wanted, recorded: ModelStatus | None) -> ModelStatus | None:
    """The recorded resolution when it is for this very spec and request (then nothing is resolved again)."""
    if recorded is None or recorded.resolved_revision is None:
        return None
    same = (recorded.repo, recorded.revision, recorded.spec_key, recorded.resolve_request)
    return recorded if same == (want.repo, want.revision, want.spec_key, want.request) else None


def record(want: Wanted, sha: str, generation: int) -> ModelStatus:
    return ModelStatus(
        repo=want.repo,
        revision=want.revision,
        resolved_revision=sha,
        generation=generation,
        spec_key=want.spec_key,
        resolve_request=want.request,
    )


def pin(view: ServiceView, sha: str, name: str) -> ServiceView:
    """The view whose model revision is the commit: the builders render it into every pod's download init."""
    model = view.spec.model.model_copy(update={"revision": sha})
    return ServiceView.from_spec(view.spec.model_copy(update={"model": model}), name=name)


def unresolved_status(
    previous: InferenceServiceStatus, generation: int, message: str, now: str
) -> InferenceServiceStatus:
    """Status while generation G's revision cannot be resolved: Degraded and Stalled with the cause (kstatus reads
    it as Failed, Flux `wait` stops), Reconciling False; Ready and the pools' counts stay as they are (pods of an
    earlier spec serve on)."""
    status = previous.model_copy(deep=True)
    status.observed_generation = generation  # a verdict about G, as for a refused apply
    status.set_condition("Degraded", "True", REASON, message, generation, now)
    status.set_condition("Stalled", "True", REASON, message, generation, now)
    status.set_condition("Reconciling", "False", REASON, "blocked: see Stalled", generation, now)
    return status


def _secret_value(secret: Mapping[str, Any] | None, key: str) -> str | None:
    raw = ((secret or {}).get("data") or {}).get(key)
    if not raw:
        return None
    return base64.b64decode(raw).decode().strip() or None


class Resolver:
    """Resolves a floating revision with the endpoint and token the download init would use."""

    def __init__(self, client: KubeClient, http: httpx.AsyncClient | None = None, timeout_s: float = 10.0) -> None:
        self.client = client
        self.http = http or httpx.AsyncClient(timeout=timeout_s, follow_redirects=True)

    async def resolve(self, want: Wanted, namespace: str, secret_name: str | None) -> str:
        """The commit `want.revision` points at now; raises RevisionError with the cause."""
        secret = None
        if secret_name:  # absent: the download init gets no keys either (secretKeyRef optional)
            try:
                secret = await self.client.get(resource_path("Secret", namespace, secret_name))
            except ApiError as exc:
                raise RevisionError(f"cannot read Secret {secret_name}: HTTP {exc.status} {exc.reason}") from None
        endpoint = (_secret_value(secret, "HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        token = _secret_value(secret, "HF_TOKEN")
        headers = {"User-Agent": "tidepool-operator/1"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        url = f"{endpoint}/api/models/{want.repo}/revision/{quote(want.revision, safe='')}"
        what = f"hf://{want.repo}@{want.revision}"
        try:
            resp = await self.http.get(url, headers=headers)
        except httpx.HTTPError as exc:
            raise RevisionError(f"cannot resolve {what}: {endpoint} unreachable ({type(exc).__name__})") from None
        if resp.status_code in (401, 403):
            where = f"the token in Secret {secret_name} key HF_TOKEN" if secret_name else "no token"
            raise RevisionError(f"cannot resolve {what}: HTTP {resp.status_code} from {endpoint} with {where}")
        if resp.status_code == 404:
            raise RevisionError(
                f"cannot resolve {what}: 404 from {endpoint}; check spec.model.uri and spec.model.revision"
            )
        if resp.status_code >= 400:
            raise RevisionError(f"cannot resolve {what}: HTTP {resp.status_code} from {endpoint}")
        try:
            sha = resp.json().get("sha")
        except ValueError:
            sha = None
        if not isinstance(sha, str) or not is_commit(sha):
            raise RevisionError(f"cannot resolve {what}: {endpoint} answered without a commit sha")
        return sha

    async def close(self) -> None:
        await self.http.aclose()
