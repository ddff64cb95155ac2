"""What the controller keeps in memory about one InferenceService: one `ServiceState` per key.

A state is created the first time a sync sees its key and dropped when the InferenceService is
gone from the cache (`ServiceSync.forget`), its autoscaler metric series with it. Nothing the sync
or the autoscaler remembers about a service lives anywhere else (the caches hold the cluster's
objects, the work queue a key's retry backoff), so nothing can outlive it. Everything in it can be lost (a restarted
operator starts without it): the fast path's evidence is rebuilt by a full reconcile, and the
autoscaler reads its durable state back from status.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tidepool.operator.api import ServiceView
from tidepool.operator.api_keys import ApiKeyState
from tidepool.operator.autoscaler.handlers import AutoscaleState
from tidepool.operator.builders import ChildKey, Desired
from tidepool.operator.lora.sync import LoraState


@dataclass(slots=True)
class Verified:
    """What the last full reconcile of a key established (the fast path's evidence)."""

    fingerprint: tuple[Any, ...]  # (uid, generation, applied replicas, cluster features)
    versions: dict[ChildKey, str]  # child -> version that matched the spec
    desired: Desired  # children dropped; pool layouts, URL and selector kept
    has_deferred: bool  # make-before-break prunes (or a held router update) still waiting

    def covers(self, fingerprint: tuple[Any, ...], versions: dict[ChildKey, str]) -> bool:
        """True when nothing changed since: same inputs, every child at a verified version, nothing waiting."""
        return self.fingerprint == fingerprint and not self.has_deferred and self.versions == versions


@dataclass(slots=True)
class ServiceState:
    """Everything the operator remembers of one InferenceService between syncs."""

    verified: Verified | None = None  # None: the next reconcile is a full one
    resync_due: float | None = None  # when the safety-net full reconcile is due (monotonic)
    wake_at: float | None = None  # the pending wake-up (autoscaler tick, paced status write)
    status_written_at: float | None = None  # when status was last written (the controller's clock)
    claims_kept: set[str] = field(default_factory=set)  # the ClaimKept messages already told
    autoscale: AutoscaleState = field(default_factory=AutoscaleState)
    lora: LoraState = field(default_factory=LoraState)  # adapter loads per pod (operator/lora/sync.py)
    api_key: ApiKeyState = field(default_factory=ApiKeyState)  # spec.auth's Secret as last read (api_keys.py)
    # The last valid spec parsed (a copy of its wire form) and its view: a sync whose spec equals it reuses the
    # view instead of validating the same spec again (most syncs are pod and workload events, not spec changes).
    parsed: tuple[dict[str, Any], ServiceView] | None = None

    def view_of(self, body: Mapping[str, Any]) -> ServiceView:
        """The spec's view (`ServiceView.from_body`), validated once per spec: a key's name never changes, so a spec
        equal to the one last parsed has the same view (a dict comparison instead of pydantic and the CEL twins).
        Raises as `from_body` does; an invalid spec is not kept (it is parsed again, and refused again)."""
        spec = body.get("spec") or {}
        if self.parsed is not None and self.parsed[0] == spec:
            return self.parsed[1]
        view = ServiceView.from_body(body)
        self.parsed = (copy.deepcopy(dict(spec)), view)
        return view
