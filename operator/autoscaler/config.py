"""Map an InferenceService spec (its camelCase wire dict) to the policy's `AutoscaleConfig` (pure).

Reads only the field names of the API contract (issue #5), so the policy never depends on how
`tidepool.operator.api` nests its pydantic classes. Defaults equal the API's defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .policy_types import DECODE, PREFILL, UNIFIED, AutoscaleConfig, PoolBounds


def pool_names(spec: Mapping[str, Any]) -> tuple[str, ...]:
    return (PREFILL, DECODE) if spec.get("mode") == "disaggregated" else (UNIFIED,)


def is_enabled(spec: Mapping[str, Any]) -> bool:
    return bool((spec.get("autoscaling") or {}).get("enabled"))


def config_from_spec(spec: Mapping[str, Any]) -> AutoscaleConfig:
    auto = spec.get("autoscaling") or {}
    slo = auto.get("slo") or {}
    zero = auto.get("scaleToZero") or {}
    stab = auto.get("stabilization") or {}
    ratio = auto.get("prefillDecodeRatio") or {}
    pools_spec = spec.get("pools") or {}
    pools = {}
    for name in pool_names(spec):
        pool = pools_spec.get(name) or {}
        pools[name] = PoolBounds(int(pool.get("minReplicas", 1)), int(pool.get("maxReplicas", 4)))

    def seconds(ms: Any) -> float | None:
        return None if ms is None else float(ms) / 1000.0

    return AutoscaleConfig(
        pools=pools,
        is_advisory=auto.get("mode", "active") == "advisory",
        ttft_p95_s=seconds(slo.get("ttftP95Ms")),
        itl_p95_s=seconds(slo.get("itlP95Ms")),
        kv_cache_target=float(auto.get("kvCacheTarget", 0.8)),
        # 0 would divide by zero; a target of "no waiting at all" is the smallest positive depth.
        queue_depth_target=max(float(auto.get("queueDepthTarget", 4)), 0.1),
        scale_to_zero=bool(zero.get("enabled", False)),
        idle_seconds=float(zero.get("idleSeconds", 300)),
        up_seconds=float(stab.get("upSeconds", 0)),
        down_seconds=float(stab.get("downSeconds", 300)),
        max_step_percent=float(auto.get("maxStepPercent", 100)),
        pd_ratio_min=float(ratio.get("min", 0.1)),
        pd_ratio_max=float(ratio.get("max", 4.0)),
    )
