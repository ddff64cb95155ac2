"""Map an InferenceService's parsed spec (`ServiceView`) to the policy's `AutoscaleConfig` (pure).

Every value comes from `ServiceView` (tidepool.operator.api.view), i.e. from the validated pydantic
spec with the API's defaults: nothing here has a default of its own, and nothing parses the spec again.
"""

from __future__ import annotations

from tidepool.operator.api import ServiceView

from .policy_types import AutoscaleConfig, PoolBounds


def config_from_view(view: ServiceView) -> AutoscaleConfig:
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
        sleep_when_idle=auto.idle == "sleep",
        up_seconds=float(auto.stabilization.up_seconds),
        down_seconds=float(auto.stabilization.down_seconds),
        max_step_percent=float(auto.max_step_percent),
        pd_ratio_min=auto.prefill_decode_ratio.min,
        pd_ratio_max=auto.prefill_decode_ratio.max,
    )
