"""A flat, typed view of an InferenceService spec, read from its camelCase dict.

The builders consume this view rather than the pydantic models so that they depend only on the
field names of the API contract (issue #5), not on how `tidepool.operator.api` nests its classes.
The reconciler first validates the raw spec with `InferenceServiceSpec` (defaults filled in) and
`validate_spec`, dumps it with `to_wire()` and hands the dict to `ServiceView.from_spec`; tests may
pass plain dicts. Parallelism follows the API contract: a replica is `pipeline` pods (one per stage)
of `tensor` GPUs each; `gpusPerReplica` 0 runs on CPU.

Invariants: pure (no I/O), frozen dataclasses, every default equals the API's default. Errors a
spec can never recover from raise `SpecError` with a message naming the field to fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

POOLS_BY_MODE: dict[str, tuple[str, ...]] = {"unified": ("unified",), "disaggregated": ("prefill", "decode")}
# The pool that `spec.replicas` (the scale subresource) stands for, per mode.
SCALED_POOL: dict[str, str] = {"unified": "unified", "disaggregated": "decode"}


class SpecError(ValueError):
    """A spec that can never be reconciled; the message says which field to change."""


@dataclass(frozen=True, slots=True)
class PoolView:
    name: str  # "unified" | "prefill" | "decode"
    replicas: int  # replicas from the spec (before any autoscaler override)
    min_replicas: int
    max_replicas: int
    gpu_product: str | None  # resources overrides of this pool
    cpu: str | None
    memory: str | None


@dataclass(frozen=True, slots=True)
class ServiceView:
    model_uri: str
    model_revision: str | None
    quantization: str | None
    image: str
    dtype: str
    max_model_len: int | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    block_size: int | None
    gpu_memory_utilization: float | None
    prefix_caching: bool
    chunked_prefill: bool
    speculative: dict[str, Any] | None  # {method, draftModel, numSpeculativeTokens}
    extra_args: tuple[str, ...]
    tensor: int
    pipeline: int
    gpus_per_replica: int
    gpu_product: str | None
    cpu: str | None
    memory: str | None
    mode: str
    pools: dict[str, PoolView]
    router_replicas: int
    router_policy: str
    max_surge: str | int
    max_unavailable: str | int
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    annotations: dict[str, str] = field(default_factory=dict)
    service_account_name: str | None = None
    priority_class_name: str | None = None
    cache_claim: str | None = None  # shared model-cache PVC; None: an emptyDir per pod
    cache_size: str | None = None  # set: the operator creates the claim
    cache_storage_class: str | None = None
    drain_timeout_s: int = 30

    @property
    def pool_names(self) -> tuple[str, ...]:
        return POOLS_BY_MODE[self.mode]

    @staticmethod
    def from_spec(spec: Mapping[str, Any]) -> ServiceView:
        return _view(spec)


def _get(d: Mapping[str, Any] | None, key: str, default: Any = None) -> Any:
    if not d:
        return default
    value = d.get(key)
    return default if value is None else value


def _int_or_str(value: Any, default: str) -> str | int:
    """An IntOrString: "3" and 3 both mean three replicas, "25%" stays a percentage."""
    value = default if value is None else value
    return value if isinstance(value, int) or str(value).endswith("%") else int(value)


def _view(spec: Mapping[str, Any]) -> ServiceView:
    model = _get(spec, "model", {})
    engine = _get(spec, "engine", {})
    par = _get(spec, "parallelism", {})
    res = _get(spec, "resources", {})
    router = _get(spec, "router", {})
    rollout = _get(spec, "rollout", {})
    pod = _get(spec, "pod", {})
    cache = _get(spec, "modelCache", {})
    mode = _get(spec, "mode", "unified")
    if mode not in POOLS_BY_MODE:
        raise SpecError(f"spec.mode must be one of {sorted(POOLS_BY_MODE)}, got {mode!r}")
    uri = _get(model, "uri")
    if not uri:
        raise SpecError("spec.model.uri is required")
    image = _get(engine, "image")
    if not image:
        raise SpecError("spec.engine.image is required")
    tensor, pipeline = int(_get(par, "tensor", 1)), int(_get(par, "pipeline", 1))
    if tensor < 1 or pipeline < 1:
        raise SpecError("spec.parallelism.tensor and .pipeline must be >= 1")
    gpus = int(_get(res, "gpusPerReplica", tensor * pipeline))
    pools_spec = _get(spec, "pools", {})
    scaled = SCALED_POOL[mode]
    pools: dict[str, PoolView] = {}
    for name in POOLS_BY_MODE[mode]:
        p = _get(pools_spec, name)
        if p is None:
            raise SpecError(f"spec.pools.{name} is required in {mode} mode")
        replicas = _get(p, "replicas", 1)
        if name == scaled and spec.get("replicas") is not None:
            replicas = spec["replicas"]  # the scale subresource's field wins (HPA/KEDA write it)
        pres = _get(p, "resources", {})
        pools[name] = PoolView(
            name=name,
            replicas=int(replicas),
            min_replicas=int(_get(p, "minReplicas", 0)),
            max_replicas=int(_get(p, "maxReplicas", max(int(replicas), 1))),
            gpu_product=_get(pres, "gpuProduct"),
            cpu=_get(pres, "cpu"),
            memory=_get(pres, "memory"),
        )
    return ServiceView(
        model_uri=str(uri),
        model_revision=_get(model, "revision"),
        quantization=None if _get(model, "quantization") in (None, "none") else _get(model, "quantization"),
        image=str(image),
        dtype=_get(engine, "dtype", "auto"),
        max_model_len=_get(engine, "maxModelLen"),
        max_num_seqs=_get(engine, "maxNumSeqs"),
        max_num_batched_tokens=_get(engine, "maxNumBatchedTokens"),
        block_size=_get(engine, "blockSize"),
        gpu_memory_utilization=_get(engine, "gpuMemoryUtilization"),
        prefix_caching=bool(_get(engine, "prefixCaching", True)),
        chunked_prefill=bool(_get(engine, "chunkedPrefill", True)),
        speculative=dict(_get(engine, "speculative")) if _get(engine, "speculative") else None,
        extra_args=tuple(_get(engine, "extraArgs", ())),
        tensor=tensor,
        pipeline=pipeline,
        gpus_per_replica=gpus,
        gpu_product=_get(res, "gpuProduct"),
        cpu=_get(res, "cpu"),
        memory=_get(res, "memory"),
        mode=mode,
        pools=pools,
        router_replicas=int(_get(router, "replicas", 1)),
        router_policy=_get(router, "policy", "prefix-aware"),
        max_surge=_int_or_str(_get(rollout, "maxSurge"), "1"),
        max_unavailable=_int_or_str(_get(rollout, "maxUnavailable"), "0"),
        node_selector=dict(_get(pod, "nodeSelector", {})),
        tolerations=tuple(_get(pod, "tolerations", ())),
        annotations=dict(_get(pod, "annotations", {})),
        service_account_name=_get(pod, "serviceAccountName"),
        priority_class_name=_get(pod, "priorityClassName"),
        cache_claim=_get(cache, "claimName"),
        cache_size=_get(cache, "size"),
        cache_storage_class=_get(cache, "storageClassName"),
        drain_timeout_s=int(_get(engine, "drainTimeoutSeconds", 30)),
    )
