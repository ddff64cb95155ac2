"""Write container images as OCI image-layout tarballs, without a registry or a container engine.

`write_layer()` packs a folder (or a few files) into one uncompressed layer tarball, reproducibly:
entries sorted, owner and mode kept, mtimes clamped to a fixed date, so the same inputs give the
same digest. `write_archive()` wraps layers and an image config into the OCI image layout (oci-layout,
index.json, blobs/sha256/...) as one tar, which `ctr -n k8s.io images import` takes as is; the image
name travels in the index's `io.containerd.image.name` annotation.

Invariants: every blob is named by the sha256 of its bytes; a layer's diff_id equals its digest
(layers are not compressed: they are imported locally once, so gzip would only cost CPU).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path

SOURCE_DATE = 946684800  # 2000-01-01: fixed mtimes make layers reproducible
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class Layer:
    """A layer tarball on disk and its digest (== diff_id: uncompressed)."""

    path: Path
    digest: str
    size: int


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.mtime = min(info.mtime, SOURCE_DATE)
    info.uname = info.gname = ""
    return info


def write_layer(out: Path, root: Path | None = None, files: dict[str, tuple[Path, int]] | None = None) -> Layer:
    """Pack the tree under `root` (paths relative to it), or `files` {path in image: (source, mode)}."""
    tmp = out.with_suffix(".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        if root is not None:
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                base = Path(dirpath)
                for name in [*sorted(dirnames), *sorted(filenames)]:
                    path = base / name
                    arcname = str(path.relative_to(root))
                    info = tar.gettarinfo(str(path), arcname)
                    if info.isreg():
                        with open(path, "rb") as fh:
                            tar.addfile(_normalise(info), fh)
                    else:
                        tar.addfile(_normalise(info))
        for arcname, (source, mode) in sorted((files or {}).items()):
            info = tar.gettarinfo(str(source), arcname.lstrip("/"))
            info.mode = stat.S_IMODE(mode)
            info.uid = info.gid = 0
            with open(source, "rb") as fh:
                tar.addfile(_normalise(info), fh)
    tmp.replace(out)
    return Layer(out, _sha256_file(out), out.stat().st_size)


def image_config(layers: list[Layer], entrypoint: list[str], env: dict[str, str], user: str = "") -> dict:
    """The OCI image config: linux/amd64, the layers' diff_ids, the process defaults."""
    return {
        "architecture": "amd64",
        "os": "linux",
        "created": "2000-01-01T00:00:00Z",
        "config": {
            "Entrypoint": entrypoint,
            "Env": [f"{k}={v}" for k, v in sorted(env.items())],
            "User": user,
            "WorkingDir": "/",
        },
        "rootfs": {"type": "layers", "diff_ids": [layer.digest for layer in layers]},
        "history": [{"created": "2000-01-01T00:00:00Z", "created_by": "tidepool e2e/images"} for _ in layers],
    }


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def write_archive(out: Path, ref: str, layers: list[Layer], config: dict) -> None:
    """One OCI image-layout tarball holding `layers` and `config`, named `ref` (e.g. tidepool.local/x:tag)."""
    config_digest, config_bytes = _blob(json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": MEDIA_CONFIG, "digest": config_digest, "size": len(config_bytes)},
        "layers": [{"mediaType": MEDIA_LAYER, "digest": x.digest, "size": x.size} for x in layers],
    }
    manifest_digest, manifest_bytes = _blob(json.dumps(manifest, sort_keys=True).encode())
    tag = ref.rsplit(":", 1)[1] if ":" in ref.rsplit("/", 1)[-1] else "latest"
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": MEDIA_MANIFEST,
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": tag},
            }
        ],
    }
    tmp = out.with_suffix(".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:

        def add_bytes(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), SOURCE_DATE, 0o644
            tar.addfile(info, io.BytesIO(data))

        add_bytes("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        add_bytes("index.json", json.dumps(index, sort_keys=True).encode())
        add_bytes(f"blobs/sha256/{config_digest[7:]}", config_bytes)
        add_bytes(f"blobs/sha256/{manifest_digest[7:]}", manifest_bytes)
        for layer in layers:
            info = tarfile.TarInfo(f"blobs/sha256/{layer.digest[7:]}")
            info.size, info.mtime, info.mode = layer.size, SOURCE_DATE, 0o644
            with open(layer.path, "rb") as fh:
                tar.addfile(info, fh)
    tmp.replace(out)
