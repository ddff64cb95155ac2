"""Where an engine pod finds its model: a path under /models, plus the init container or volume it needs.

hf://org/name  -> downloaded by an init container (`hf download`) into the cache volume
s3://bucket/p  -> downloaded by an init container (`aws s3 sync`) into the cache volume
pvc://claim/p  -> the claim mounted read-only at /models/pvc/<claim>; no download
(file:// is refused by the API itself: it would need a hostPath volume, which Pod Security
"restricted" forbids; a local or hostPath PersistentVolume bound to a claim serves it via pvc://.)

Invariants: pure; volume names are derived from the URI, so the same URI yields the same pod spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tidepool.operator.api.view import SpecError

from .common import container_security_context, sorted_env, spec_hash

MODELS_DIR = "/models"
CACHE_VOLUME = "model-cache"


@dataclass(frozen=True, slots=True)
class ModelSource:
    path: str  # where the engine reads the model
    init_container: dict[str, Any] | None = None
    volume: dict[str, Any] | None = None  # an extra volume (pvc://)
    mount: dict[str, Any] | None = None  # its mount in the engine container


def _small_resources() -> dict[str, Any]:
    return {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}


def model_source(
    uri: str, revision: str | None, *, field: str, hf_image: str, s3_image: str, name: str = "model"
) -> ModelSource:
    """Resolve one model URI; `field` names the spec field in error messages, `name` the init container."""
    scheme, sep, rest = uri.partition("://")
    rest = rest.strip("/")
    if not sep or not rest:
        raise SpecError(f"{field}: {uri!r} is not a URI; use hf://org/name, s3://bucket/prefix or pvc://claim/path")
    env = sorted_env({"HOME": "/tmp", "HF_HOME": f"{MODELS_DIR}/.hf-home"})
    mounts = [
        {"name": CACHE_VOLUME, "mountPath": MODELS_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if scheme == "hf":
        path = f"{MODELS_DIR}/hf/{rest}"
        args = ["download", rest, "--local-dir", path]
        if revision:
            args += ["--revision", revision]
        init = {
            "name": f"fetch-{name}",
            "image": hf_image,
            "command": ["hf"],
            "args": args,
            "env": env,
            "resources": _small_resources(),
            "securityContext": container_security_context(),
            "volumeMounts": mounts,
        }
        return ModelSource(path=path, init_container=init)
    if scheme == "s3":
        path = f"{MODELS_DIR}/s3/{rest}"
        init = {
            "name": f"fetch-{name}",
            "image": s3_image,
            "command": ["aws"],
            "args": ["s3", "sync", f"s3://{rest}", path, "--only-show-errors"],
            "env": env,
            "resources": _small_resources(),
            "securityContext": container_security_context(),
            "volumeMounts": mounts,
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
    raise SpecError(f"{field}: unsupported URI scheme {scheme!r}; use hf://, s3:// or pvc://")
