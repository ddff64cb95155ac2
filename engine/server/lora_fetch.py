"""A `lora_path` that is a source URI (contract/lora.py): the adapter fetched into the pod's cache, then read.

Role: the operator loads declared hf:// and s3:// adapters by passing their URI as `lora_path` (it never
downloads for the engine); `local_adapter_folder` turns such a path into the local folder the
adapter reader takes, in the load's worker thread (never on the event loop or the engine thread):
- a path without a scheme is already a folder: returned as it is;
- `hf://org/name[@revision]`: the adapter's two files from the Hub (`tidepool download`'s client),
  into `$TIDEPOOL_LORA_DIR/hf/<org>/<name>/<revision>`; credentials HF_TOKEN, HF_ENDPOINT;
- `s3://bucket/prefix`: `prefix/adapter_config.json` and `prefix/adapter_model.safetensors` with
  SigV4-signed GETs (download/s3.py), into `$TIDEPOOL_LORA_DIR/s3/<bucket>/<prefix>`; credentials
  AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL (none: anonymous).
Both schemes take one path, `files.download`: resumable `.incomplete` files renamed once whole, a lock
and a completion marker so replicas sharing the cache fetch once.

Invariant: every failure is a `LoRAError` (400, `param` "lora_path") whose message names the object and
says what to change; the fetched folder is what the registry re-reads an evicted adapter from.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote

from tidepool.contract.download import SECRET_NAME_ENV
from tidepool.contract.lora import LORA_DIR_ENV, parse_source_uri

from ..download.files import download
from ..download.hub import DEFAULT_ENDPOINT, DownloadError, Hub
from ..download.s3 import REVISION, S3Store
from ..lora.types import LoRAError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
DEFAULT_LORA_DIR = Path.home() / ".cache" / "tidepool" / "lora"  # outside a pod ($TIDEPOOL_LORA_DIR unset)


def local_adapter_folder(path: str) -> str:
    """The folder to read the adapter at `path` from, fetching a source URI first (blocking: a worker thread)."""
    try:
        source = parse_source_uri(path)
    except ValueError as err:
        raise LoRAError(str(err), param="lora_path") from None
    if source is None:
        return path
    root = Path(os.environ.get(LORA_DIR_ENV) or DEFAULT_LORA_DIR)
    secret_name = os.environ.get(SECRET_NAME_ENV) or None
    store: Hub
    try:
        if source.scheme == "hf":
            revision = source.revision or "main"
            dest = root / "hf" / _safe_location(source.location, 2) / quote(revision, safe="")
            store = Hub(os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT, os.environ.get("HF_TOKEN") or None,
                        secret_name=secret_name)  # fmt: skip
        else:
            revision = REVISION
            dest = root / "s3" / _safe_location(source.location, None)
            store = S3Store(ADAPTER_FILES, os.environ, secret_name=secret_name)
    except DownloadError as err:
        raise LoRAError(f"lora_path {path!r}: {err}", param="lora_path") from None
    try:
        download(store, source.location, revision, dest, include=ADAPTER_FILES)
    except DownloadError as err:
        raise LoRAError(f"fetching the adapter {path!r} failed: {err}", param="lora_path") from None
    except OSError as err:  # the cache volume itself: permissions, a read-only mount, no space
        raise LoRAError(f"cannot write the adapter cache {dest}: {err.strerror or err}", param="lora_path") from None
    finally:
        store.close()
    return str(dest)


def _safe_location(location: str, parts: int | None) -> str:
    """`location` as a relative folder: `parts` segments when given (hf://org/name), none empty, '.' or '..'."""
    segments = location.split("/")
    if (parts is not None and len(segments) != parts) or any(p in ("", ".", "..") for p in segments):
        shape = "hf://org/name[@revision]" if parts is not None else "s3://bucket/prefix"
        raise DownloadError(f"not {shape}")
    return location
