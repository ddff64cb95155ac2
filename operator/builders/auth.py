"""spec.auth in the pods: the API-key Secret's volume, its mount and the `--api-key-file` flag. Pure.

Every engine pod (all pools, every rank of a multi-node replica: one template) and every router pod mounts the
one key of `spec.auth.apiKeySecretRef` read-only at `API_KEY_MOUNT_DIR/<key>` (defaultMode 0400; the pod's fsGroup
lets the container's user read it) and gets `--api-key-file` naming that file. The volume is not optional: a pod
whose Secret or key is missing does not start (the kubelet reports FailedMount), which the operator also reports
in status (operator/api_keys.py), instead of a pod that would serve without authentication.

Invariants: no spec.auth, no change at all (the templates and their spec-hash stay as they were); mounts stay
sorted by path and volumes by name, as the builders keep them; the Secret's content never enters a template,
so rotating keys rolls no pod (the engine and router re-read the file).
"""

from __future__ import annotations

from typing import Any

from tidepool.contract.serve_flags import FLAGS
from tidepool.operator.api.auth import API_KEY_MOUNT_DIR, API_KEY_VOLUME, api_key_path
from tidepool.operator.api.view import ServiceView

# `tidepool serve` and `tidepool router` take the same flag (the serve-flag table's AUTH_FLAGS). Not a managed
# flag: the engine args add it only with spec.auth, after the rendered (sorted) managed flags.
API_KEY_FILE_FLAG = FLAGS["api-key-file"].option
READ_ONLY_MODE = 0o400


def api_key_args(view: ServiceView) -> list[str]:
    """`--api-key-file <path>` when spec.auth asks for keys, else nothing."""
    auth = view.spec.auth
    return [API_KEY_FILE_FLAG, api_key_path(auth.api_key_secret_ref)] if auth else []


def with_api_key(
    view: ServiceView, mounts: list[dict[str, Any]], volumes: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The container's mounts and the pod's volumes plus the API-key Secret's (re-sorted); unchanged without
    spec.auth."""
    auth = view.spec.auth
    if auth is None:
        return mounts, volumes
    secret = auth.api_key_secret_ref
    mount = {"name": API_KEY_VOLUME, "mountPath": API_KEY_MOUNT_DIR, "readOnly": True}
    volume = {
        "name": API_KEY_VOLUME,
        "secret": {
            "secretName": secret.name,
            "items": [{"key": secret.key, "path": secret.key}],
            "defaultMode": READ_ONLY_MODE,
        },
    }
    return (
        sorted([*mounts, mount], key=lambda m: m["mountPath"]),
        sorted([*volumes, volume], key=lambda v: v["name"]),
    )
