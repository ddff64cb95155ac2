"""What the operator and the engine agree on for LoRA adapters declared in an InferenceService (stdlib only).

The operator loads each declared adapter on every ready replica with vLLM's
`POST /v1/load_lora_adapter {"lora_name", "lora_path"}`. `lora_path` is either a folder inside the pod
(pvc:// adapters, on a claim the pod mounts) or a *source URI* the engine fetches itself into
`$TIDEPOOL_LORA_DIR` (inside the pod's model cache) with the credentials in its environment:

    hf://org/name            the Hub repo at main
    hf://org/name@revision   at a branch, tag or commit (Hub repo names never hold '@')
    s3://bucket/prefix       prefix/adapter_config.json and prefix/adapter_model.safetensors (AWS_* env)

Invariants: `source_uri` and `parse_source_uri` are inverses; a path without a scheme is a local folder.
"""

from __future__ import annotations

from dataclasses import dataclass

LORA_DIR_ENV = "TIDEPOOL_LORA_DIR"  # where the engine keeps adapters it fetched (the operator sets it)
FETCHED_SCHEMES = ("hf", "s3")  # schemes the engine fetches itself


@dataclass(frozen=True, slots=True)
class AdapterSource:
    """A parsed source URI: scheme ("hf" | "s3"), the rest after `://` and the Hub revision (hf only)."""

    scheme: str
    location: str
    revision: str | None = None


def source_uri(uri: str, revision: str | None = None) -> str:
    """The `lora_path` of a fetched source: the URI, with `@revision` appended for a pinned hf:// repo."""
    return f"{uri.rstrip('/')}@{revision}" if revision and uri.startswith("hf://") else uri.rstrip("/")


def parse_source_uri(path: str) -> AdapterSource | None:
    """A `lora_path` the engine must fetch, parsed; None for a local folder. ValueError for another scheme."""
    scheme, sep, rest = path.partition("://")
    if not sep:
        return None
    if scheme not in FETCHED_SCHEMES or not rest.strip("/"):
        raise ValueError(f"lora_path {path!r}: use a folder, hf://org/name[@revision] or s3://bucket/prefix")
    if scheme == "hf":
        repo, _, revision = rest.partition("@")
        return AdapterSource("hf", repo.strip("/"), revision or None)
    return AdapterSource("s3", rest.strip("/"))
