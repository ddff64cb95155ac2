"""The InferenceService API (group tidepool.dev, version v1alpha1): pydantic models, the single source of truth.

Contract for the rest of the operator (builders, reconcile, autoscaler, crdgen):

- `InferenceServiceSpec` / `InferenceServiceStatus`: snake_case attributes, camelCase wire names
  (`model_validate` accepts either; `to_wire()` emits camelCase without None fields).
- `InferenceService.from_body(body) -> (spec, status)` reads a kopf body; `status_patch(status)`
  gives the dict for a status-subresource patch.
- Pools are named "unified", "prefill", "decode" (`POOL_NAMES`); `spec.pool_names()` lists those
  the spec's mode runs; `spec.pool(name)`, `spec.pool_replicas(name)`, `spec.pool_resources(name)`.
- Scale subresource: `spec.replicas` is the replica count of the scaled pool (`spec.scaled_pool()`:
  "unified" in unified mode, "decode" in disaggregated mode) and wins over that pool's `replicas`
  when set; `status.replicas` and `status.selector` describe the same pool.
- Parallelism: a replica uses tensor x pipeline GPUs (`resources.gpusPerReplica` must equal it, or
  be 0 for CPU, where the tensor ranks share a pod); each pipeline stage is one pod with `tensor` GPUs
  (`spec.pods_per_replica()`, `spec.gpus_per_pod()`), so pipeline > 1 spans nodes.
- `validate_spec(spec, name)` returns the messages of the cross-field rules the spec breaks: the
  same rules and messages the CRD's CEL makes the API server enforce (see rules.py).
- `ServiceView.from_spec(spec)` (view.py) is the one derived view the builders and the autoscaler
  read: the validated spec's own models plus per-pool replicas, bounds and resources; `SpecError`
  for a spec that can never be reconciled. The controller parses each object once per sync
  (`ServiceView.from_body(body)`) and hands that view on. No reader keeps defaults of its own.
- Engine settings: `EngineSpec` fields marked `ServeFlagRef` pass through as that `tidepool serve`
  flag (`serve_flag_fields()`), with the flag table's default (tidepool.contract.serve_flags, torch-free).
- Quantities: `canonical_quantity` / `quantity_value` (quantity.py), the API server's canonical form.
- Conditions: Ready, Progressing, Degraded, ScalingLimited; `status.set_condition(...)` moves
  lastTransitionTime only when the status changes.

Never imports torch (the operator image has none); of the engine it imports only the flag table.
"""

from tidepool.operator.api.model import CacheClaim, EmptyDirCache, ModelCache, ModelCredentials, ModelSource
from tidepool.operator.api.pod import PodOverrides, Toleration
from tidepool.operator.api.quantity import canonical_quantity, quantity_value
from tidepool.operator.api.resource import (
    API_VERSION,
    CATEGORIES,
    CRD_NAME,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    InferenceService,
    status_patch,
)
from tidepool.operator.api.rules import MAX_NAME_LENGTH, SPEC_RULES, Rule, validate_spec
from tidepool.operator.api.spec import (
    DEFAULT_ENGINE_IMAGE,
    POOL_DECODE,
    POOL_NAMES,
    POOL_PREFILL,
    POOL_UNIFIED,
    AutoscalingSpec,
    EngineSpec,
    InferenceServiceSpec,
    Parallelism,
    Pools,
    PoolSpec,
    PrefillDecodeRatio,
    ResourceOverrides,
    Resources,
    RolloutSpec,
    RouterSpec,
    ScaleToZero,
    ServeFlagRef,
    Slo,
    Speculative,
    Stabilization,
    serve_flag_fields,
)
from tidepool.operator.api.status import (
    CONDITION_TYPES,
    AutoscalingPoolStatus,
    AutoscalingStatus,
    Condition,
    InferenceServiceStatus,
    PoolStatus,
    now_rfc3339,
)
from tidepool.operator.api.view import PoolView, ServiceView, SpecError

__all__ = [
    "API_VERSION",
    "CATEGORIES",
    "CONDITION_TYPES",
    "CRD_NAME",
    "DEFAULT_ENGINE_IMAGE",
    "GROUP",
    "KIND",
    "MAX_NAME_LENGTH",
    "PLURAL",
    "POOL_DECODE",
    "POOL_NAMES",
    "POOL_PREFILL",
    "POOL_UNIFIED",
    "SHORT_NAMES",
    "SINGULAR",
    "SPEC_RULES",
    "VERSION",
    "AutoscalingPoolStatus",
    "AutoscalingSpec",
    "AutoscalingStatus",
    "CacheClaim",
    "Condition",
    "EmptyDirCache",
    "EngineSpec",
    "InferenceService",
    "InferenceServiceSpec",
    "InferenceServiceStatus",
    "ModelCache",
    "ModelCredentials",
    "ModelSource",
    "Parallelism",
    "PodOverrides",
    "PoolSpec",
    "PoolStatus",
    "PoolView",
    "Pools",
    "PrefillDecodeRatio",
    "ResourceOverrides",
    "Resources",
    "RolloutSpec",
    "RouterSpec",
    "Rule",
    "ScaleToZero",
    "ServeFlagRef",
    "ServiceView",
    "Slo",
    "SpecError",
    "Speculative",
    "Stabilization",
    "Toleration",
    "canonical_quantity",
    "now_rfc3339",
    "quantity_value",
    "serve_flag_fields",
    "status_patch",
    "validate_spec",
]
