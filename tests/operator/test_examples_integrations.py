"""The integration samples (KEDA ScaledObjects, the Gateway API HTTPRoute) name things that exist.

Each KEDA sample targets the disaggregated sample's scale subresource within the scaled pool's bounds,
and every metric its PromQL names is one the engine exports (contract/metrics_names.py, the metrics
contract) or the operator exports (its prometheus_client families). The HTTPRoute's backend is the
InferencePool the operator builds for that sample once it asks for one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tidepool.contract import metrics_names as names
from tidepool.operator.autoscaler import handlers
from tidepool.operator.builders import SCALED_POOL, ClusterFeatures, ServiceView, desired_state
from tidepool.operator.builders.inference_pool import API_VERSION

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
KEDA_SAMPLES = ("keda-scaledobject.yaml", "keda-scaledobject-kv.yaml", "keda-scaledobject-advisory.yaml")
PROMQL_NAME = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{")


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def exported_names() -> set[str]:
    """Sample names a scrape of an engine pod or of the operator shows."""
    engine = {*names.GAUGES, *(names.sample_total(c) for c in names.COUNTERS)}
    engine |= {f"{h}_{part}" for h in names.HISTOGRAMS for part in ("bucket", "sum", "count")}
    operator = set()
    for metric in (handlers.DESIRED, handlers.CURRENT, handlers.READY, handlers.DECISIONS):
        for family in metric.describe():
            operator.add(family.name + ("_total" if family.type == "counter" else ""))
    return engine | operator


@pytest.mark.parametrize("sample", KEDA_SAMPLES)
def test_keda_samples_target_the_scaled_pool_with_real_metric_names(sample: str) -> None:
    scaled = load(sample)
    service = load("inferenceservice-disaggregated.yaml")
    target = scaled["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        service["apiVersion"],
        service["kind"],
        service["metadata"]["name"],
    )
    pool = service["spec"]["pools"][SCALED_POOL[service["spec"]["mode"]]]
    assert pool["minReplicas"] <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    assert scaled["spec"]["maxReplicaCount"] <= pool["maxReplicas"]
    assert service["spec"].get("replicas") is not None  # GET .../scale, which KEDA's HPA reads, needs it
    known = exported_names()
    for trigger in scaled["spec"]["triggers"]:
        used = set(PROMQL_NAME.findall(trigger["metadata"]["query"]))
        assert used and used <= known, used - known


def test_kv_sample_scales_on_kv_usage_and_advisory_sample_on_the_operators_decision() -> None:
    service = load("inferenceservice-disaggregated.yaml")
    (kv,) = load("keda-scaledobject-kv.yaml")["spec"]["triggers"]
    assert names.KV_CACHE_USAGE_PERC in kv["metadata"]["query"] and 0 < float(kv["metadata"]["threshold"]) < 1
    (advisory,) = load("keda-scaledobject-advisory.yaml")["spec"]["triggers"]
    query = advisory["metadata"]["query"]
    (family,) = handlers.DESIRED.describe()
    assert family.name in query and float(advisory["metadata"]["threshold"]) == 1  # replicas = the decision
    name, scaled_pool = service["metadata"]["name"], SCALED_POOL[service["spec"]["mode"]]
    assert f'name="{name}"' in query and f'pool="{scaled_pool}"' in query
    assert service["spec"]["autoscaling"]["mode"] == "advisory"


def test_httproute_backend_is_the_pool_the_operator_builds() -> None:
    route = load("gateway-httproute.yaml")
    service = load("inferenceservice-disaggregated.yaml")
    spec = {**service["spec"], "inferencePool": {"endpointPicker": {"name": "llama-8b-epp"}}}
    children = desired_state(
        service["metadata"]["name"], "default", ServiceView.from_spec(spec), ClusterFeatures(has_inference_pool=True)
    ).children
    (pool,) = [c for c in children if c["kind"] == "InferencePool"]
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        API_VERSION.split("/")[0],
        pool["kind"],
        pool["metadata"]["name"],
    )
    assert "endpointPicker: {name: llama-8b-epp, port: 9002}" in (EXAMPLES / "gateway-httproute.yaml").read_text()
