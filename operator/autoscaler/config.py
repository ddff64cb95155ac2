"""Map an InferenceService spec to the policy's `AutoscaleConfig` through the one spec view (pure).

Every value comes from `ServiceView` (tidepool.operator.api.view), i.e. from the validated pydantic
spec with the API's defaults: nothing here has a default of its own. The helpers accept the view,
the pydantic spec, or the wire dict of a kopf body (validated on the way in).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from tidepool.operator.api import InferenceServiceSpec, ServiceView, SpecError

from .policy_types import AutoscaleConfig, PoolBounds

SpecLike = ServiceView | InferenceServiceSpec | Mapping[str, Any]


def pool_names(spec: SpecLike) -> tuple[str, ...]:
    return ServiceView.from_spec(spec).pool_names


def is_enabled(spec: SpecLike) -> bool:
    """Tidepool's autoscaler runs for a valid spec with autoscaling.enabled, unless mode is external (HPA/KEDA
    scale it); an invalid one is never autoscaled (reconcile reports it Degraded)."""
    try:
        auto = ServiceView.from_spec(spec).autoscaling
    except (ValidationError, SpecError):
        return False
    return auto.enabled and auto.mode != "external"


def declared_replicas(spec: SpecLike) -> dict[str, int]:
    """Replicas per pool as the spec declares them, spec.replicas (the scale subresource) included."""
    return ServiceView.from_spec(spec).declared_replicas


def config_from_spec(spec: SpecLike) -> AutoscaleConfig:
    view = ServiceView.from_spec(spec)
    auto = view.autoscaling

    def seconds(ms: int | None) -> float | None:
        return None if ms is None else ms / 1000.0

    return AutoscaleConfig(
        pools={name: PoolBounds(pool.min_replicas, pool.max_replicas) for name, pool in view.pools.items()},
        is_advisory=auto.mode == "advisory",
        ttft_p95_s=seconds(auto.slo.ttft_p95_ms),
        itl_p95_s=seconds(auto.slo.itl_p95_ms),
        kv_cache_target=auto.kv_cache_target,
        # 0 would divide by zero; a target of "no waiting at all" is the smallest positive depth.
        queue_depth_target=max(float(auto.queue_depth_target), 0.1),
        scale_to_zero=auto.scale_to_zero.enabled,
        idle_seconds=float(auto.scale_to_zero.idle_seconds),
        up_seconds=float(auto.stabilization.up_seconds),
        down_seconds=float(auto.stabilization.down_seconds),
        max_step_percent=float(auto.max_step_percent),
        pd_ratio_min=auto.prefill_decode_ratio.min,
        pd_ratio_max=auto.prefill_decode_ratio.max,
    )
