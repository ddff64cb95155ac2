"""The per-pool key of a multi-node group's control channel: its Secret, and what every rank's pod gets. Pure.

Every rank of a multi-node group (nnodes > 1) proves it holds the control channel's HMAC key before any
message is decoded (contract/wire.py); the key never crosses the network, each rank reads it from the file
named by `CONTROL_KEY_FILE_ENV`. The operator keeps it in one Secret per multi-node pool,
`<service>-<pool>-control-key`, owned by the InferenceService (the garbage collector removes it with the
service), and mounts it read-only (defaultMode 0400; the pod's fsGroup lets the engine's user read it) at
the contract's mount directory in the engine container of every rank: one pod template serves the
StatefulSet groups' pods and the LeaderWorkerSet's leaders and workers alike. Single-node pools get
nothing: their engine draws a key itself and hands it to its local ranks at spawn.

Invariants:
- pure: `control_key_secret` carries no key; the plan draws the random bytes when it executes
  (reconcile.py) and fills them in with `with_key`. The Secret is created once, never applied or updated
  (AlreadyExists means done), and immutable, so the key stays what the running ranks read, across spec
  edits and operator restarts; the operator never reads it back (its RBAC grants create only).
- a pool that stops being multi-node keeps its Secret until the service goes (a few bytes, and the same
  key again should the pool become multi-node once more).
"""

from __future__ import annotations

import posixpath
from typing import Any

from tidepool.contract.wire import CONTROL_KEY_FILE_ENV, CONTROL_KEY_MOUNT_PATH

from .common import child_name, labels, metadata

SECRET_KIND = "Secret"  # created once by the plan (reconcile.py), never applied
CONTROL_KEY_VOLUME = "control-key"  # reserved in api/pod.py (an override may not name it)
CONTROL_KEY_DIR = posixpath.dirname(CONTROL_KEY_MOUNT_PATH)  # the Secret's volume, mounted here
CONTROL_KEY_ITEM = posixpath.basename(CONTROL_KEY_MOUNT_PATH)  # its one key, the file the ranks read
KEY_BYTES = 32  # random bytes per key
READ_ONLY_MODE = 0o400


def control_key_name(service: str, pool: str) -> str:
    return child_name(service, f"{pool}-control-key")


def control_key_secret(service: str, namespace: str, pool: str) -> dict[str, Any]:
    """The pool's Secret without its key (`with_key` adds it when the plan creates it)."""
    return {
        "apiVersion": "v1",
        "kind": SECRET_KIND,
        "metadata": metadata(control_key_name(service, pool), namespace, labels(service, pool, "control-key")),
        "type": "Opaque",
        "immutable": True,
    }


def with_key(secret: dict[str, Any], key: str) -> dict[str, Any]:
    """`secret` holding `key` (text: the file's bytes, read without surrounding whitespace by the ranks)."""
    return {**secret, "stringData": {CONTROL_KEY_ITEM: key}}


def control_key_env(nnodes: int) -> dict[str, str]:
    """The engine container's env naming the key file; {} for a single-node pool."""
    return {CONTROL_KEY_FILE_ENV: CONTROL_KEY_MOUNT_PATH} if nnodes > 1 else {}


def with_control_key(
    service: str, pool: str, nnodes: int, mounts: list[dict[str, Any]], volumes: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The engine container's mounts and the pod's volumes plus the key's (sorted by path and by name, as the
    builders keep them); unchanged for a single-node pool."""
    if nnodes <= 1:
        return mounts, volumes
    mount = {"name": CONTROL_KEY_VOLUME, "mountPath": CONTROL_KEY_DIR, "readOnly": True}
    volume = {
        "name": CONTROL_KEY_VOLUME,
        "secret": {"secretName": control_key_name(service, pool), "defaultMode": READ_ONLY_MODE},
    }
    return (
        sorted([*mounts, mount], key=lambda m: m["mountPath"]),
        sorted([*volumes, volume], key=lambda v: v["name"]),
    )
