"""`InferenceService.status` as pydantic models (written by the operator, read by kubectl/HPA).

Invariants: condition types are Ready, Progressing, Degraded, ScalingLimited, and kstatus' abnormal-true
pair Reconciling and Stalled (never both True; operator/status.py decides them); a condition's
lastTransitionTime changes only when its status does (see `set_condition`). `replicas` and
`selector` serve the scale subresource and describe the scaled pool (unified, or decode when
disaggregated); `selector` is a label-selector string (`a=b,c=d`) matching that pool's pods.
Status models ignore unknown fields: the operator's framework may keep its own bookkeeping
under status, and reading it must not fail.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, StringConstraints

from tidepool.operator.api.base import ApiModel

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "ScalingLimited", "Reconciling", "Stalled")
ConditionStatus = Literal["True", "False", "Unknown"]
AdapterState = Literal["Ready", "Loading", "Failed", "Pending"]
Timestamp = Annotated[str, StringConstraints(max_length=64), Field(json_schema_extra={"format": "date-time"})]
_Reason = Annotated[str, StringConstraints(max_length=1024, pattern=r"^([A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?)?$")]


def now_rfc3339() -> str:
    """Current UTC time as Kubernetes writes it (second precision, Z suffix)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition_order(condition: Condition) -> tuple[int, str]:
    known = condition.type in CONDITION_TYPES
    return (CONDITION_TYPES.index(condition.type) if known else len(CONDITION_TYPES), condition.type)


class StatusModel(ApiModel):
    model_config = ConfigDict(extra="ignore")


class Condition(StatusModel):
    """A metav1.Condition."""

    type: Annotated[str, StringConstraints(min_length=1, max_length=316)] = Field(
        description="Ready, Progressing, Degraded, ScalingLimited, Reconciling or Stalled."
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: _Reason = Field(default="", description="CamelCase reason for the last transition.")
    message: Annotated[str, StringConstraints(max_length=32768)] = Field(
        default="", description="Human-readable details: what is wrong and what to do."
    )
    last_transition_time: Timestamp | None = Field(default=None, description="When status last changed.")
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation this condition was computed from."
    )


class PoolStatus(StatusModel):
    """Observed replicas of one pool."""

    replicas: int = Field(default=0, ge=0, description="Pods (replicas) that exist.")
    ready_replicas: int = Field(default=0, ge=0, description="Replicas passing readiness.")
    updated_replicas: int | None = Field(
        default=None, ge=0, description="Replicas whose pods all run the current spec's template."
    )
    desired_replicas: int = Field(default=0, ge=0, description="Replicas the operator is driving towards.")


class AutoscalingPoolStatus(StatusModel):
    """The autoscaler's last view of one pool."""

    desired_replicas: int = Field(default=0, ge=0, description="Replicas the autoscaler wants.")
    inputs: dict[str, float] = Field(
        default_factory=dict,
        max_length=32,
        description="Signals behind the decision (e.g. ttftP95Ms, itlP95Ms, kvCacheUsage, queueDepth).",
    )


class Recommendation(StatusModel):
    """One raw recommendation the autoscaler remembers for its stabilization windows."""

    time: Timestamp = Field(description="When it was made (RFC 3339).")
    replicas: dict[str, int] = Field(default_factory=dict, max_length=3, description="Replicas per pool.")


class AutoscalingStatus(StatusModel):
    """The autoscaler's last decision, and the state it resumes from after an operator restart."""

    mode: Literal["active", "advisory"] | None = Field(default=None, description="Mode the decision was made in.")
    last_scale_time: Timestamp | None = Field(default=None, description="When replicas were last changed.")
    last_decision: Annotated[str, StringConstraints(max_length=4096)] | None = Field(
        default=None, description="Reason of the last decision."
    )
    pools: dict[str, AutoscalingPoolStatus] = Field(
        default_factory=dict, max_length=3, description="Per-pool desired replicas and inputs."
    )
    limited: Annotated[str, StringConstraints(max_length=1024)] | None = Field(
        default=None, description="Why the last decision could not scale as far as it wanted (bounds, capacity)."
    )
    last_active_time: Timestamp | None = Field(
        default=None, description="Last time a pool saw a request (scale to zero counts idleness from it)."
    )
    asleep_since: Timestamp | None = Field(
        default=None, description="autoscaling.idle sleep: since when the pools' engines sleep (unset: awake)."
    )
    recommendations: list[Recommendation] = Field(
        default_factory=list,
        max_length=64,
        description="Recent raw recommendations within the stabilization windows (oldest first).",
    )


class LoraPoolStatus(StatusModel):
    """One adapter in one pool."""

    pool: Annotated[str, StringConstraints(max_length=16)] = Field(description="unified, prefill or decode.")
    state: AdapterState = Field(
        description="Ready: every serving replica holds it; Loading: some are loading it; Failed: a replica refused "
        "it (see message); Pending: no replica to load it on yet."
    )
    ready_replicas: int = Field(default=0, ge=0, description="Serving replicas that hold the adapter.")
    replicas: int = Field(default=0, ge=0, description="Serving replicas of the pool.")
    held_by: list[Annotated[str, StringConstraints(max_length=253)]] = Field(
        default_factory=list, max_length=64, description="Pods that hold the adapter (at most 64 listed)."
    )
    message: Annotated[str, StringConstraints(max_length=4096)] = Field(
        default="", description="Why the adapter failed to load (the engine's reply), or what is under way."
    )


class LoraAdapterStatus(StatusModel):
    """One declared adapter, over every pool."""

    name: Annotated[str, StringConstraints(max_length=128)] = Field(
        description="The adapter's name (spec.lora.adapters[].name)."
    )
    state: AdapterState = Field(description="The worst of its pools' states (Failed > Loading > Pending > Ready).")
    pools: list[LoraPoolStatus] = Field(default_factory=list, max_length=3, description="Per pool.")


class OperatorDefaults(StatusModel):
    """The operator's default images a service's children were last rolled out with (operator/rollout.py)."""

    engine_image: Annotated[str, StringConstraints(max_length=1024)] | None = Field(
        default=None, description="Engine image of a service without spec.engine.image (--engine-image)."
    )
    router_image: Annotated[str, StringConstraints(max_length=1024)] | None = Field(
        default=None, description="Router image (--router-image); unset: the engine image."
    )
    hf_download_image: Annotated[str, StringConstraints(max_length=1024)] | None = Field(
        default=None, description="Image of the hf:// download init (--hf-download-image); unset: the engine image."
    )
    s3_download_image: Annotated[str, StringConstraints(max_length=1024)] | None = Field(
        default=None, description="Image of the s3:// download init (--s3-download-image)."
    )


class ModelStatus(StatusModel):
    """The commit a floating hf:// revision was resolved to, and what the resolution is valid for (revision.py)."""

    repo: Annotated[str, StringConstraints(max_length=2048)] = Field(description="The hf:// repository (org/name).")
    revision: Annotated[str, StringConstraints(max_length=256)] = Field(
        description="The floating revision as the spec names it (main when unset)."
    )
    resolved_revision: Annotated[str, StringConstraints(max_length=64)] | None = Field(
        default=None, description="The commit every pod of this spec downloads."
    )
    generation: int | None = Field(default=None, ge=0, description="metadata.generation it was resolved for.")
    spec_key: Annotated[str, StringConstraints(max_length=64)] | None = Field(
        default=None, description="Digest of the spec (replica counts left out) it was resolved for."
    )
    resolve_request: Annotated[str, StringConstraints(max_length=256)] | None = Field(
        default=None, description="The tidepool.dev/resolve-revision annotation value it was resolved for."
    )


class InferenceServiceStatus(StatusModel):
    """Observed state of an InferenceService."""

    observed_generation: int | None = Field(
        default=None,
        ge=0,
        description="metadata.generation the conditions describe: applied, or found invalid (see Stalled).",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        description=(
            "Ready, Progressing, Degraded, ScalingLimited; Reconciling and Stalled follow kstatus (Flux, Argo CD): "
            "Reconciling=True until this generation serves, Stalled=True when something blocks it."
        ),
        # One entry per type, merged by type under server-side apply (as metav1.Condition lists are).
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    pools: dict[str, PoolStatus] = Field(
        default_factory=dict, max_length=3, description="Per-pool replica counts, keyed unified/prefill/decode."
    )
    replicas: int | None = Field(default=None, ge=0, description="Scale subresource: replicas of the scaled pool.")
    selector: Annotated[str, StringConstraints(max_length=4096)] | None = Field(
        default=None, description="Scale subresource: label selector of the scaled pool's pods."
    )
    url: Annotated[str, StringConstraints(max_length=2048)] | None = Field(
        default=None,
        description="In-cluster URL of the OpenAI-compatible endpoint: the router Service, or the pool's Service "
        "with router.enabled false.",
    )
    autoscaling: AutoscalingStatus | None = Field(default=None, description="The autoscaler's last decision.")
    lora: list[LoraAdapterStatus] | None = Field(
        default=None,
        max_length=64,
        description="Each declared LoRA adapter's readiness per pool (spec.lora); unset without spec.lora.",
    )

    operator_defaults: OperatorDefaults | None = Field(
        default=None,
        description="The operator's default images this service was last rolled out with: an operator upgrade that "
        "changes them rolls the service through the operator's rollout budget (--max-concurrent-rollouts).",
    )

    model: ModelStatus | None = Field(
        default=None,
        description="spec.model's floating revision resolved to a commit, once per spec (unset for a commit, or "
        "a model that is not hf://); annotate tidepool.dev/resolve-revision with a new value to resolve it again.",
    )

    def condition(self, type_: str) -> Condition | None:
        """The condition of that type, if present."""
        return next((c for c in self.conditions if c.type == type_), None)

    def set_condition(
        self,
        type_: str,
        status: ConditionStatus,
        reason: str,
        message: str,
        observed_generation: int | None = None,
        now: str | None = None,
    ) -> bool:
        """Upsert a condition; lastTransitionTime moves only when status changes. True when anything changed."""
        if type_ not in CONDITION_TYPES:
            raise ValueError(f"unknown condition type {type_!r}; expected one of {CONDITION_TYPES}")
        old = self.condition(type_)
        keep_time = old is not None and old.status == status and old.last_transition_time is not None
        new = Condition(
            type=type_,
            status=status,
            reason=reason,
            message=message,
            last_transition_time=old.last_transition_time if keep_time and old else (now or now_rfc3339()),
            observed_generation=observed_generation,
        )
        if old == new:
            return False
        others = [c for c in self.conditions if c.type != type_]
        self.conditions = sorted([*others, new], key=_condition_order)
        return True
