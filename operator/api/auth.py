"""`spec.auth`: API keys on the engine and router endpoints, and where the operator mounts them.

Shapes, and the one rule on them (a CEL expression plus its Python twin, rules.py's way). The key is a Secret
*reference* (never a value in the spec): the operator mounts that Secret's one key read-only into every engine
pod (all pools) and router pod at `API_KEY_MOUNT_DIR/<key>` and passes the file to `tidepool serve` and
`tidepool router` (`--api-key-file`); both re-read it when it changes, so rotating the key in the Secret needs no
restart. The operator itself reads the Secret (a narrow `get`, no list or watch) only to
authenticate its own calls to protected pod endpoints (LoRA loads) and to report a missing Secret or key in
status, since pods that mount a missing Secret never start.

Invariants: the volume name and mount directory are reserved (api/pod.py refuses an override that takes them);
health, readiness and metrics stay open on the pods (probes and scrapers carry no key).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints

from tidepool.operator.api.base import ApiModel
from tidepool.operator.api.kube import CONFIG_KEY_RE
from tidepool.operator.api.rule import Rule
from tidepool.operator.api.types import DnsSubdomain

API_KEY_VOLUME = "api-key"  # the pods' volume holding the Secret's key (reserved in api/pod.py)
API_KEY_MOUNT_DIR = "/etc/tidepool/api-key"  # mounted here, read-only; the file is named after the key
DEFAULT_API_KEY_ITEM = "api-key"

SecretKey = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=CONFIG_KEY_RE)]


class ApiKeySecretRef(ApiModel):
    """A key of a Secret in the InferenceService's namespace holding the accepted API keys."""

    name: DnsSubdomain = Field(description="Name of the Secret, in the InferenceService's namespace.")
    key: SecretKey = Field(
        default=DEFAULT_API_KEY_ITEM,
        description=(
            "The Secret's key whose value lists the accepted API keys, one per line (several lines let a new key "
            "be rolled out before the old one is removed)."
        ),
    )


class AuthSpec(ApiModel):
    """Who may call the service: clients must send `Authorization: Bearer <key>`."""

    api_key_secret_ref: ApiKeySecretRef = Field(
        description=(
            "The Secret key holding the API keys. It is mounted read-only into every engine and router pod and "
            "passed as --api-key-file; /v1/* and admin endpoints then answer 401 without a listed key, while "
            "/health, /ready and /metrics stay open to probes and scrapers. Editing the Secret rotates the keys "
            "without restarting pods. A missing Secret or key keeps new pods from starting: status says so "
            "(Degraded, reason ApiKeySecretMissing). The operator reads this Secret (get) to authenticate its own "
            "LoRA calls."
        )
    )


def api_key_path(secret: ApiKeySecretRef) -> str:
    """The file the pods read the keys from."""
    return f"{API_KEY_MOUNT_DIR}/{secret.key}"


AUTH_RULES: tuple[Rule, ...] = (
    Rule(
        ApiKeySecretRef,
        "self.key != '.' && self.key != '..'",
        "auth.apiKeySecretRef.key must not be '.' or '..' (it names the file the pods read; Secret keys cannot be "
        "either)",
        lambda a: a.key not in (".", ".."),
        ".key",
    ),
)
