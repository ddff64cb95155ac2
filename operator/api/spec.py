"""`InferenceService.spec` as pydantic models: the single source of truth for the CRD schema.

Every field carries a description (it becomes the CRD's), a default where one makes sense and
bounds the API server enforces. Cross-field rules (mode vs pools, replicas within bounds,
parallelism vs GPUs, ...) live in `rules.py` next to their CEL; this module is shapes only.

Scale contract: `spec.replicas` is what the scale subresource (kubectl scale, HPA, KEDA) reads and
writes. It is the replica count of the *scaled pool*: `unified` in unified mode, `decode` in
disaggregated mode. When set it wins over that pool's `replicas`; when unset the pool's own
`replicas` applies. Use `InferenceServiceSpec.pool_replicas(name)` instead of reading either field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints

from tidepool.contract.serve_flags import FLAGS, managed_spellings
from tidepool.operator.api.auth import AuthSpec
from tidepool.operator.api.availability import DisruptionBudget
from tidepool.operator.api.base import ApiModel
from tidepool.operator.api.gateway import InferencePoolSpec
from tidepool.operator.api.kube import LABEL_VALUE_RE
from tidepool.operator.api.lora import LoraSpec
from tidepool.operator.api.model import ModelCache, ModelSource
from tidepool.operator.api.netpol import NetworkPolicySpec
from tidepool.operator.api.pod import (
    DEFAULT_ACCELERATOR,
    Accelerator,
    PodOverrides,
    PoolPodOverrides,
)
from tidepool.operator.api.router import RouterSpec
from tidepool.operator.api.types import IntOrPercent, Quantity, ReplicaCount

POOL_UNIFIED = "unified"
POOL_PREFILL = "prefill"
POOL_DECODE = "decode"
POOL_NAMES = (POOL_UNIFIED, POOL_PREFILL, POOL_DECODE)
DEFAULT_ENGINE_IMAGE = "ghcr.io/tidepool-dev/tidepool:0.1.0"

Mode = Literal["unified", "disaggregated"]
# Enumerations the engine defines are taken from its flag table, not copied.
Dtype = Literal[FLAGS["dtype"].choices]  # type: ignore[valid-type]
# The value of the node label nvidia.com/gpu.product, so a label value (the builders put it in a nodeSelector).
GpuProduct = Annotated[str, StringConstraints(min_length=1, max_length=63, pattern=LABEL_VALUE_RE)]


@dataclass(frozen=True, slots=True)
class ServeFlagRef:
    """Marks an `EngineSpec` field as the value of one `tidepool serve` flag: the builders pass it through as
    that flag (bools as --x / --no-x), so exposing another engine flag is one annotated field here."""

    name: str


def serve_flag_field(name: str, **kwargs: Any) -> Any:
    """A Field whose default is the engine's own default for flag `name` (one source for both)."""
    return Field(default=FLAGS[name].default, **kwargs)


class Speculative(ApiModel):
    """Speculative decoding: propose tokens cheaply, verify them in one target-model step."""

    method: Literal["suffix", "ngram", "draft"] = Field(
        description=(
            "suffix: suffix decoding over the request and recent outputs (model-free, the usual choice); "
            "ngram: propose from n-gram matches in the prompt; draft: propose with a smaller draft model."
        )
    )
    draft_model: Annotated[str, StringConstraints(min_length=1, max_length=2048)] | None = Field(
        default=None, description="URI of the draft model (same schemes as model.uri); required when method is draft."
    )
    num_speculative_tokens: int = Field(default=4, ge=1, le=16, description="Tokens proposed per step.")


class EngineSpec(ApiModel):
    """The Tidepool engine each replica runs (`tidepool serve` flags)."""

    image: Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=r"^\S+$")] | None = Field(
        default=None,
        description=(
            "Container image holding the `tidepool` engine; unset: the operator's default engine image "
            "(`tidepool operator --engine-image`, the chart's engineImage value)."
        ),
    )
    dtype: Annotated[Dtype, ServeFlagRef("dtype")] = serve_flag_field(
        "dtype", description="Activation/weight dtype; auto uses the checkpoint's."
    )
    max_model_len: Annotated[int | None, ServeFlagRef("max-model-len")] = serve_flag_field(
        "max-model-len", ge=16, le=1_048_576, description="Longest prompt+output in tokens; unset uses the model's."
    )
    max_num_seqs: Annotated[int, ServeFlagRef("max-num-seqs")] = serve_flag_field(
        "max-num-seqs", ge=1, le=4096, description="Most sequences scheduled in one step."
    )
    max_num_batched_tokens: Annotated[int | None, ServeFlagRef("max-num-batched-tokens")] = serve_flag_field(
        "max-num-batched-tokens",
        ge=16,
        le=1_048_576,
        description="Token budget of one engine step; must be at least maxNumSeqs. Unset lets the engine choose.",
    )
    block_size: Annotated[Literal[8, 16, 32, 64, 128], ServeFlagRef("block-size")] = serve_flag_field(
        "block-size", description="Tokens per KV-cache block."
    )
    gpu_memory_utilization: Annotated[float, ServeFlagRef("gpu-memory-utilization")] = serve_flag_field(
        "gpu-memory-utilization",
        gt=0.0,
        le=1.0,
        description="Fraction of GPU memory the engine may use (weights + KV cache).",
    )
    prefix_caching: Annotated[bool, ServeFlagRef("enable-prefix-caching")] = serve_flag_field(
        "enable-prefix-caching", description="Reuse KV blocks of shared prompt prefixes."
    )
    chunked_prefill: Annotated[bool, ServeFlagRef("enable-chunked-prefill")] = serve_flag_field(
        "enable-chunked-prefill", description="Split long prompts across steps so decodes are not stalled behind them."
    )
    drain_timeout_seconds: Annotated[int, ServeFlagRef("drain-timeout")] = Field(
        default=int(FLAGS["drain-timeout"].default),  # whole seconds, like terminationGracePeriodSeconds
        ge=0,
        le=3600,
        description=(
            "Seconds in-flight requests get to finish when a pod stops (scale-down, rollout, eviction); the pod's "
            "termination grace period is this plus a margin. Raise it for long generations."
        ),
    )
    speculative: Speculative | None = Field(default=None, description="Speculative decoding; unset disables it.")
    extra_args: list[Annotated[str, StringConstraints(min_length=3, max_length=256)]] = Field(
        default_factory=list,
        max_length=64,
        description=(
            "Extra `tidepool serve` flags, one `--flag` or `--flag=value` per entry. Flags the operator sets itself "
            "are refused (use the spec fields): " + ", ".join(managed_spellings()) + "."
        ),
    )


def serve_flag_fields() -> dict[str, str]:
    """EngineSpec field name -> the `tidepool serve` flag it is passed through as (from the ServeFlagRef marks)."""
    return {
        name: mark.name
        for name, info in EngineSpec.model_fields.items()
        for mark in info.metadata
        if isinstance(mark, ServeFlagRef)
    }


class Parallelism(ApiModel):
    """How one replica splits the model across GPUs."""

    tensor: int = Field(default=1, ge=1, le=64, description="Tensor-parallel degree (GPUs sharing each layer).")
    pipeline: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Pipeline-parallel degree (stages of consecutive layers); each stage runs in its own pod.",
    )


class Resources(ApiModel):
    """Resources of one replica."""

    gpus_per_replica: int = Field(
        default=1,
        ge=0,
        le=512,
        description=(
            "GPUs one replica uses; must equal parallelism.tensor x parallelism.pipeline, or 0 to run on CPU "
            "(tensor ranks share a pod). With pipeline > 1 each stage is one pod, with `tensor` GPUs."
        ),
    )
    gpu_product: GpuProduct | None = Field(
        default=None,
        description="Required value of the node label nvidia.com/gpu.product (e.g. NVIDIA-H100-80GB-HBM3).",
    )
    cpu: Quantity | None = Field(default=None, description="CPU request and limit per pod (e.g. 4, 500m).")
    memory: Quantity | None = Field(default=None, description="Memory request and limit per pod (e.g. 32Gi).")


class ResourceOverrides(ApiModel):
    """Per-pool changes to `spec.resources` (GPU count stays global: it follows parallelism)."""

    gpu_product: GpuProduct | None = Field(default=None, description="Overrides resources.gpuProduct for this pool.")
    cpu: Quantity | None = Field(default=None, description="Overrides resources.cpu for this pool.")
    memory: Quantity | None = Field(default=None, description="Overrides resources.memory for this pool.")


class PoolSpec(ApiModel):
    """One pool of identical engine replicas."""

    replicas: ReplicaCount = Field(
        default=1,
        description=(
            "Replicas when the autoscaler is off. For the scaled pool (unified, or decode when disaggregated) "
            "spec.replicas wins when set."
        ),
    )
    min_replicas: ReplicaCount = Field(default=1, description="Lower bound for the autoscaler (0 needs scaleToZero).")
    max_replicas: ReplicaCount = Field(default=4, description="Upper bound for the autoscaler.")
    resources: ResourceOverrides | None = Field(default=None, description="Overrides of spec.resources for this pool.")
    pod: PoolPodOverrides | None = Field(
        default=None,
        description="Merged over spec.pod for this pool (maps merge, lists append, scalars replace): spec.pod's "
        "fields (documented there) but volumes, which spec.pod declares for every pool (volumeMounts may name them).",
    )
    disruption_budget: DisruptionBudget | None = Field(
        default=None,
        description=(
            "This pool's PodDisruptionBudget (exactly one of maxUnavailable or minAvailable); unset: maxUnavailable "
            "1 if the pool can exceed 1 replica, else none (minAvailable: 1 on one replica blocks the drain)."
        ),
    )


class Pools(ApiModel):
    """The engine pools: `unified` alone, or `prefill` + `decode` (disaggregated serving)."""

    unified: PoolSpec | None = Field(default=None, description="The only pool in unified mode.")
    prefill: PoolSpec | None = Field(default=None, description="Prompt-processing pool in disaggregated mode.")
    decode: PoolSpec | None = Field(default=None, description="Token-generation pool in disaggregated mode.")


class Slo(ApiModel):
    """Latency objectives the autoscaler defends."""

    ttft_p95_ms: int | None = Field(default=None, ge=1, le=600_000, description="Target p95 time to first token (ms).")
    itl_p95_ms: int | None = Field(default=None, ge=1, le=60_000, description="Target p95 inter-token latency (ms).")


class ScaleToZero(ApiModel):
    """Scale every pool to zero replicas after a quiet period."""

    enabled: bool = Field(default=False, description="Allow scaling to zero (needs minReplicas 0 on every pool).")
    idle_seconds: int = Field(
        default=300, ge=30, le=86_400, description="Seconds without requests before scaling to zero (or sleeping)."
    )


class Stabilization(ApiModel):
    """Windows over which a scaling direction must persist before acting (fast up, slow down)."""

    up_seconds: int = Field(default=0, ge=0, le=3600, description="Scale-up stabilization window in seconds.")
    down_seconds: int = Field(default=300, ge=0, le=3600, description="Scale-down stabilization window in seconds.")


class PrefillDecodeRatio(ApiModel):
    """Bounds on prefill replicas / decode replicas the autoscaler keeps in disaggregated mode."""

    min: float = Field(default=0.1, gt=0.0, le=100.0, description="Lowest prefill:decode replica ratio.")
    max: float = Field(default=4.0, gt=0.0, le=100.0, description="Highest prefill:decode replica ratio.")


class AutoscalingSpec(ApiModel):
    """Tidepool's SLO-driven autoscaler."""

    enabled: bool = Field(default=False, description="Run Tidepool's autoscaler for this service.")
    mode: Literal["active", "advisory", "external"] = Field(
        default="active",
        description="active: scale the pools; advisory: decide and report in status, never act; external: no "
        "scrape, no decision: HPA/KEDA drive the scale subresource (spec.replicas: unified, or decode pool).",
    )
    slo: Slo = Field(default_factory=Slo, description="Latency objectives.")
    kv_cache_target: float = Field(
        default=0.8, gt=0.0, le=1.0, description="Target KV-cache occupancy per replica (fraction)."
    )
    queue_depth_target: int = Field(
        default=4, ge=0, le=10_000, description="Target waiting requests per replica (vllm:num_requests_waiting)."
    )
    scale_to_zero: ScaleToZero = Field(default_factory=ScaleToZero, description="Scale-to-zero behaviour.")
    idle: Literal["scaleToZero", "sleep"] = Field(
        default="scaleToZero",
        description="After scaleToZero.idleSeconds without requests: scaleToZero (if enabled), or sleep: keep the "
        "replicas, engines asleep (memory stays on the node) until the router holds a request.",
    )
    stabilization: Stabilization = Field(default_factory=Stabilization, description="Stabilization windows.")
    max_step_percent: int = Field(
        default=100, ge=1, le=1000, description="Largest change in one decision, in percent of current replicas."
    )
    prefill_decode_ratio: PrefillDecodeRatio = Field(
        default_factory=PrefillDecodeRatio,
        description="Disaggregated mode: the prefill and decode pools scale separately within this replica ratio.",
    )


class RolloutSpec(ApiModel):
    """Rolling-update bounds of the engine pools."""

    max_surge: IntOrPercent = Field(default=1, description="Extra replicas (count or %) during a rollout.")
    max_unavailable: IntOrPercent = Field(default=0, description="Replicas (count or %) that may be down in a rollout.")


class InferenceServiceSpec(ApiModel):
    """Desired state of an InferenceService: one model served by engine pools behind a router."""

    model: ModelSource = Field(description="The model to serve.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Engine settings.")
    parallelism: Parallelism = Field(default_factory=Parallelism, description="Parallelism of one replica.")
    resources: Resources = Field(default_factory=Resources, description="Resources of one replica.")
    accelerator: Accelerator | None = Field(
        default=None, description="The device-plugin resource the GPUs are requested as; unset: nvidia.com/gpu."
    )
    mode: Mode = Field(default="unified", description="unified: one pool; disaggregated: prefill + decode pools.")
    pools: Pools = Field(
        default_factory=lambda: Pools(unified=PoolSpec()),
        description="Engine pools; must match mode (unified alone, or prefill and decode).",
    )
    replicas: ReplicaCount | None = Field(
        default=None,
        description=(
            "Scale-subresource replicas: the unified pool's in unified mode, the decode pool's in disaggregated mode. "
            "Wins over that pool's replicas when set."
        ),
    )
    router: RouterSpec = Field(default_factory=RouterSpec, description="Router.")
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec, description="Autoscaler settings.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Rollout bounds.")
    pod: PodOverrides = Field(default_factory=PodOverrides, description="Pod-level overrides.")
    model_cache: ModelCache | None = Field(
        default=None, description="Where pods keep downloaded weights; unset: a per-pod emptyDir (default sizeLimit)."
    )
    inference_pool: InferencePoolSpec | None = Field(
        default=None, description="A Gateway API Inference Extension InferencePool over the serving pods; unset: none."
    )
    lora: LoraSpec | None = Field(
        default=None,
        description="LoRA adapters on the base model, added and removed without restarting pods; unset: no LoRA.",
    )
    auth: AuthSpec | None = Field(
        default=None, description="API keys required on the engine and router endpoints; unset: no authentication."
    )
    network_policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec, description="Ingress NetworkPolicies on the engine and router pods."
    )

    def pool_names(self) -> tuple[str, ...]:
        """The pools this spec's mode runs, in a stable order."""
        return (POOL_UNIFIED,) if self.mode == "unified" else (POOL_PREFILL, POOL_DECODE)

    def scaled_pool(self) -> str:
        """The pool `spec.replicas` (the scale subresource) controls."""
        return POOL_UNIFIED if self.mode == "unified" else POOL_DECODE

    def pool(self, name: str) -> PoolSpec:
        """The named pool's spec; KeyError when this mode does not run it or it is missing."""
        spec = getattr(self.pools, name, None) if name in self.pool_names() else None
        if spec is None:
            raise KeyError(f"pool {name!r} is not part of this {self.mode} InferenceService")
        return spec

    def pool_replicas(self, name: str) -> int:
        """Declared replicas of a pool, honouring the scale contract (spec.replicas wins for the scaled pool)."""
        if name == self.scaled_pool() and self.replicas is not None:
            return self.replicas
        return self.pool(name).replicas

    def can_exceed_one_replica(self, name: str) -> bool:
        """May the pool run more than one replica under this spec: declared above 1, or scaled by Tidepool's
        autoscaler (active) or HPA/KEDA (external) up to a maxReplicas above 1."""
        scaled = self.autoscaling.enabled and self.autoscaling.mode != "advisory"
        return self.pool_replicas(name) > 1 or (scaled and self.pool(name).max_replicas > 1)

    def router_replicas(self) -> int:
        """Router replicas: 0 when disabled; router.replicas when set; else 2 where any pool can exceed one replica
        (or disaggregated mode), so the router is never the weaker link, and 1 for a single-replica service."""
        if not self.router.enabled:
            return 0
        if self.router.replicas is not None:
            return self.router.replicas
        many = self.mode == "disaggregated" or any(self.can_exceed_one_replica(p) for p in self.pool_names())
        return 2 if many else 1

    def pool_resources(self, name: str) -> Resources:
        """spec.resources with the pool's overrides applied."""
        overrides = self.pool(name).resources
        if overrides is None:
            return self.resources
        return self.resources.model_copy(update=overrides.model_dump(exclude_none=True))

    def pods_per_replica(self) -> int:
        """Pods one replica spans: one per pipeline stage (multi-node when > 1)."""
        return self.parallelism.pipeline

    def accelerator_resource(self) -> str:
        """The extended resource the engine pods request their GPUs as (spec.accelerator.resourceName)."""
        return self.accelerator.resource_name if self.accelerator else DEFAULT_ACCELERATOR

    def gpus_per_pod(self) -> int:
        """GPUs requested by each pod of a replica (tensor-parallel degree; 0 when running on CPU)."""
        return 0 if self.resources.gpus_per_replica == 0 else self.parallelism.tensor
