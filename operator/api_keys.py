"""The API-key Secret of an InferenceService with spec.auth: is it there, and which key the operator sends.

Pods mount `spec.auth.apiKeySecretRef` (builders/auth.py); a missing Secret or key keeps every new pod in
ContainerCreating (FailedMount), which the pods' own status does not say clearly. So each sync of a service with
spec.auth checks the Secret (`ApiKeys.check`) and reports a problem (status: Degraded, reason
ApiKeySecretMissing, the Secret named; a Warning Event when the problem starts or changes). The same read gives
the key the operator sends (`Authorization: Bearer`) on its own calls to protected pod endpoints (the LoRA step):
the first key of the Secret's value, read by the parser the pods read their key file with
(tidepool.common.api_key.parse_keys: one key a line, blank and `#` lines ignored, printable ASCII without spaces).

Cost (the operator neither lists nor watches Secrets: its RBAC is a narrow `get`): one GET when the reference
changes, then again only after `refresh_s` (a rotated or deleted Secret is seen within it), while the Secret is
missing once per `retry_s` (the sync asks for a wake-up, so creating the Secret is noticed without a watch), and
at once after a pod refused the key (`is_refused`: it was rotated).

Invariants: everything kept is the service's `ApiKeyState` (in its ServiceState); the key is held in memory
only, never logged, written to status or put in an Event; an API error other than 404/403 keeps what was known
and asks for a retry (a flaky API server does not turn into a Degraded service).
"""

from __future__ import annotations

import base64
import binascii
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tidepool.common.api_key import ApiKeyError, parse_keys
from tidepool.operator.api import ServiceView
from tidepool.operator.events import EventRecorder
from tidepool.operator.k8s import ApiError, KubeClient, resource_path

logger = logging.getLogger("tidepool.operator.api_keys")
REFRESH_S = 300.0  # a Secret found good is read again after this long
RETRY_S = 30.0  # a missing (or unreadable) Secret is looked for again after this long
MISSING_REASON = "ApiKeySecretMissing"


@dataclass(slots=True)
class ApiKeyState:
    """What the operator knows of one service's API-key Secret."""

    ref: tuple[str, str] | None = None  # (Secret name, key) last read
    key: str | None = None  # the key sent to pods (None: none usable)
    problem: str | None = None  # why pods cannot start (None: the Secret and key are there)
    read_at: float | None = None  # the controller's clock at the last read
    told: str | None = None  # the problem last posted as an Event

    def reset(self) -> None:
        self.ref = self.key = self.problem = self.read_at = self.told = None


@dataclass(frozen=True, slots=True)
class ApiKeyOutcome:
    key: str | None  # what to send as `Authorization: Bearer` (None: no spec.auth, or no usable key)
    problem: str | None  # a Degraded message naming the Secret
    wake_s: float | None  # sync again in this long (the Secret is missing, or could not be read)


def first_key(secret: Mapping[str, Any], item: str) -> tuple[str | None, str | None]:
    """(key, problem) from a Secret object: the first non-blank line of `data[item]`, or why there is none."""
    data = secret.get("data") or {}
    name = secret.get("metadata", {}).get("name", "?")
    if item not in data:
        keys = ", ".join(sorted(data)) or "none"
        return None, f"Secret {name} has no key {item} (its keys: {keys}); set spec.auth.apiKeySecretRef.key"
    try:
        text = base64.b64decode(data[item], validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None, f"Secret {name} key {item} is not UTF-8 text (one API key per line)"
    try:  # exactly as the pods read the mounted file: a value they refuse is a problem here too
        return parse_keys(text, f"Secret {name} key {item}")[0], None
    except ApiKeyError as err:
        return None, str(err)


class ApiKeys:
    """Checks and reads services' API-key Secrets (see the module docstring)."""

    def __init__(
        self,
        client: KubeClient,
        events: EventRecorder,
        clock: Callable[[], float] = time.monotonic,
        refresh_s: float = REFRESH_S,
        retry_s: float = RETRY_S,
    ) -> None:
        self.client, self.events, self.clock = client, events, clock
        self.refresh_s, self.retry_s = refresh_s, retry_s

    async def check(
        self, body: Mapping[str, Any], view: ServiceView, state: ApiKeyState, is_refused: bool = False
    ) -> ApiKeyOutcome:
        """The service's key and problem, reading the Secret when due; posts a Warning when a problem starts."""
        auth = view.spec.auth
        if auth is None:
            state.reset()
            return ApiKeyOutcome(None, None, None)
        ref = (auth.api_key_secret_ref.name, auth.api_key_secret_ref.key)
        now = self.clock()
        due_after = self.retry_s if state.problem else self.refresh_s
        is_due = state.ref != ref or state.read_at is None or now - state.read_at >= due_after or is_refused
        wake_s: float | None = None
        if is_due:
            wake_s = await self._read(body["metadata"]["namespace"], ref, state, now)
        if state.problem:
            wake_s = self.retry_s
            if state.told != state.problem:
                await self.events.post(body, "Warning", MISSING_REASON, state.problem)
        state.told = state.problem
        return ApiKeyOutcome(state.key, state.problem, wake_s)

    async def _read(self, namespace: str, ref: tuple[str, str], state: ApiKeyState, now: float) -> float | None:
        """Read the Secret into `state`; a retry delay when the API server could not answer."""
        name, item = ref
        try:
            secret = await self.client.get(resource_path("Secret", namespace, name))
        except ApiError as exc:
            if exc.status != 403:
                logger.warning("[%s] reading Secret %s (spec.auth): %s", namespace, name, exc)
                return self.retry_s  # transient: keep what was known
            key: str | None = None
            problem: str | None = (
                f"the operator may not read Secret {name} (spec.auth.apiKeySecretRef): grant it get on secrets "
                "(the chart's ClusterRole does)"
            )
        else:
            key, problem = first_key(secret, item) if secret is not None else (None, None)
            if secret is None:
                problem = (
                    f"Secret {name} (spec.auth.apiKeySecretRef) not found in namespace {namespace}: engine and router "
                    f"pods cannot start until it exists with key {item}"
                )
        if problem and problem != state.problem:
            logger.warning("[%s] %s", namespace, problem)
        state.ref, state.key, state.problem, state.read_at = ref, key, problem, now
        return None
