"""The optional steps of one InferenceService's sync, around the reconcile (sync.py's `ServiceSync` inherits them).

- `_pin`: spec.model's floating hf:// revision replaced by its commit, resolved once per spec (revision.py); a
  failure is reported (`_unresolved`: Degraded/Stalled RevisionUnresolved, one Warning Event) and raised.
- `_api_key`: spec.auth's Secret checked (api_keys.py), its key for the LoRA step; a missing Secret asks for a
  wake-up (Secrets are not watched).
- `_lora`: declared adapters onto serving replicas (operator/lora/sync.py), a failed load's retry timer.
- `_reclaim`: cache claims that claims.py says go now (reclaimPolicy Delete, creator gone, named by no service).

Invariants: the steps keep no state of their own: what they remember is the service's `ServiceState` or the
`ServiceSync` attributes declared below; they write status only through `ServiceSync._write`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from tidepool.operator.api import InferenceServiceStatus, ServiceView, now_rfc3339
from tidepool.operator.api.status import ModelStatus
from tidepool.operator.api_keys import ApiKeyOutcome, ApiKeys
from tidepool.operator.cache import Key, PodInfo, Store
from tidepool.operator.claims import reclaimable_in
from tidepool.operator.events import EventRecorder
from tidepool.operator.k8s import ApiError, KubeClient
from tidepool.operator.lora.sync import LoraOutcome, LoraSync
from tidepool.operator.revision import REASON as REVISION_UNRESOLVED
from tidepool.operator.revision import Resolver, RevisionError, pin, record, reuse, unresolved_status, wanted
from tidepool.operator.state import ServiceState

logger = logging.getLogger("tidepool.operator")


class SyncSteps:
    """Mixin of `ServiceSync`: the attributes and methods the steps use are ServiceSync's."""

    client: KubeClient
    store: Store
    events: EventRecorder
    lora: LoraSync | None
    api_keys: ApiKeys
    revisions: Resolver | None
    pins: dict[Key, ModelStatus]
    _write: Callable[..., Awaitable[Any]]
    _wake: Callable[[Key, ServiceState, float], None]

    async def _pin(self, key: Key, body: dict[str, Any], view: ServiceView, state: ServiceState) -> ServiceView:
        """The view with spec.model's floating revision replaced by its commit, resolved once per spec (revision.py).
        A failure is reported (Degraded and Stalled, RevisionUnresolved) and raised: nothing is applied, the key
        is retried with backoff."""
        want = wanted(view, body) if self.revisions is not None else None
        if want is None or self.revisions is None:
            self.pins.pop(key, None)
            return view
        previous = InferenceServiceStatus.model_validate(body.get("status") or {})
        pinned = reuse(want, self.pins.get(key)) or reuse(want, previous.model)
        if pinned is None:
            secret = view.spec.model.credentials.secret_name if view.spec.model.credentials else None
            try:
                sha = await self.revisions.resolve(want, key[0], secret)
            except RevisionError as exc:
                await self._unresolved(key, body, state, previous, str(exc))
                raise ApiError(503, str(exc), REVISION_UNRESOLVED) from None
            pinned = record(want, sha, int(body["metadata"].get("generation", 1)))
            logger.info("[%s/%s] hf://%s@%s resolved to %s", *key, want.repo, want.revision, sha)
        self.pins[key] = pinned
        return pin(view, pinned.resolved_revision or want.revision, body["metadata"]["name"])

    async def _unresolved(
        self, key: Key, body: dict[str, Any], state: ServiceState, previous: InferenceServiceStatus, message: str
    ) -> None:
        """Status and a Warning Event for a revision that could not be resolved; pods of earlier specs serve on."""
        generation = int(body["metadata"].get("generation", 1))
        state.verified = None
        await self._write(key, body, state, previous, unresolved_status(previous, generation, message, now_rfc3339()))
        told = previous.condition("Degraded")
        if told is None or told.reason != REVISION_UNRESOLVED or told.message != message:
            await self.events.post(body, "Warning", REVISION_UNRESOLVED, message[:1000])

    async def _api_key(self, key: Key, body: dict[str, Any], view: ServiceView, state: ServiceState) -> ApiKeyOutcome:
        """spec.auth's Secret (api_keys.py): its key for the LoRA step, a problem for status; a missing Secret is
        looked for again by a wake-up (the operator does not watch Secrets)."""
        outcome = await self.api_keys.check(body, view, state.api_key, state.lora.take_key_refused())
        if outcome.wake_s is not None:
            self._wake(key, state, outcome.wake_s)
        return outcome

    async def _lora(
        self, key: Key, view: ServiceView, pods: list[PodInfo], state: ServiceState, api_key: str | None = None
    ) -> LoraOutcome:
        """The LoRA step (operator/lora/sync.py): adapters onto serving replicas; a failed load's retry timer."""
        if self.lora is None:
            return LoraOutcome(None, [], None)
        outcome = await self.lora.step(key, view, pods, state.lora, api_key)
        if outcome.wake_s is not None:
            self._wake(key, state, outcome.wake_s)
        return outcome

    async def _reclaim(self, namespace: str) -> None:
        """Delete the cache claims of `namespace` that claims.py says go now (created by the operator with
        reclaimPolicy Delete, their creator gone, named by no InferenceService). Runs whenever a service's key
        finds it gone (its deletion; at start, for a claim whose creator went while the operator was down)."""
        for claim in reclaimable_in(self.store, namespace):
            await self.client.delete(claim)  # uid precondition: never a newer claim of that name
            self.store.delete(claim)
            logger.info("[%s/%s] deleted cache claim (reclaimPolicy Delete; its creator is gone, no service names it)",
                        namespace, claim["metadata"]["name"])  # fmt: skip
