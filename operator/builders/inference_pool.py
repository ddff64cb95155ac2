"""The Gateway API Inference Extension's `InferencePool` (inference.networking.k8s.io/v1) of one service.

A gateway (Envoy Gateway, kgateway, Istio, GKE) routing an HTTPRoute to an InferencePool asks the
pool's Endpoint Picker which of the selected pods takes each request; the picker scrapes those pods'
`/metrics` (the model-server protocol: `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, ...).

Invariants: pure; built only when the CRD is installed (`ClusterFeatures.has_inference_pool`) and
`spec.inferencePool` is set and enabled (the v1 schema requires an endpointPickerRef, and Tidepool runs
no picker); named like the InferenceService; its selector is exactly the serving selector of the
pool's Service (`network.serving_selector`: the scaled pool, unified or decode, and in multi-node
pools only rank 0, the one pod per replica that serves HTTP); one target port, the engine's HTTP port.
The prefill pool is never selected: a disaggregated request enters at decode, which fetches its KV
from prefill through Tidepool's own hand-off.
"""

from __future__ import annotations

from typing import Any

from tidepool.operator.api.view import ServiceView

from .common import ENGINE_PORT, ClusterFeatures, labels, metadata
from .engine import topology
from .network import serving_selector

API_VERSION = "inference.networking.k8s.io/v1"
KIND = "InferencePool"
COMPONENT = "inference-pool"
POOL_LABEL_VALUE = "gateway"  # its tidepool.dev/pool label: not an engine pool, so never "replaced" on a mode switch


def inference_pool(name: str, namespace: str, view: ServiceView, features: ClusterFeatures) -> dict[str, Any] | None:
    """The InferencePool manifest, or None when the service should not have one."""
    spec = view.inference_pool
    if not features.has_inference_pool or spec is None or not spec.enabled:
        return None
    picker = spec.endpoint_picker
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata(name, namespace, labels(name, POOL_LABEL_VALUE, COMPONENT)),
        "spec": {
            "selector": {"matchLabels": serving_selector(name, view.scaled_pool, topology(view, features))},
            "targetPorts": [{"number": ENGINE_PORT}],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": picker.name,
                "port": {"number": picker.port},
                "failureMode": picker.failure_mode,
            },
        },
    }
