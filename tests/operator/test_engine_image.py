"""The engine image: a service's own `spec.engine.image`, else the operator's default (`--engine-image`).

One source per level: the CRD carries no image default (so the API server fills in none), the
operator's flag (the chart's `engineImage`) sets `ClusterFeatures.engine_image`, whose own default
is the API's `DEFAULT_ENGINE_IMAGE`. Engine pods, the router (without `--router-image`) and the
hf:// download init container (without `--hf-download-image`) all use the resolved image.
"""

from __future__ import annotations

from typing import Any

from tidepool.cli import build_parser as tidepool_parser
from tidepool.operator.api import DEFAULT_ENGINE_IMAGE, ServiceView
from tidepool.operator.builders import ClusterFeatures, desired_state
from tidepool.operator.crdgen import build_crd
from tidepool.operator.main import build_parser as operator_parser


def images(spec: dict[str, Any], features: ClusterFeatures) -> dict[str, set[str]]:
    """Container and init-container images by workload name."""
    out: dict[str, set[str]] = {}
    for child in desired_state("svc", "ns", ServiceView.from_spec(spec), features).children:
        if child["kind"] != "Deployment":
            continue
        pod = child["spec"]["template"]["spec"]
        out[child["metadata"]["name"]] = {c["image"] for c in pod["containers"] + pod.get("initContainers", [])}
    return out


SPEC = {"model": {"uri": "hf://org/m"}}


def test_the_operator_default_applies_when_the_service_sets_none() -> None:
    got = images(SPEC, ClusterFeatures(engine_image="registry.local/engine:1"))
    assert got == {"svc-unified": {"registry.local/engine:1"}, "svc-router": {"registry.local/engine:1"}}
    assert images(SPEC, ClusterFeatures())["svc-unified"] == {DEFAULT_ENGINE_IMAGE}


def test_the_services_own_image_wins() -> None:
    spec = {**SPEC, "engine": {"image": "mine/engine:2"}}
    got = images(spec, ClusterFeatures(engine_image="registry.local/engine:1", router_image="r/router:3"))
    assert got == {"svc-unified": {"mine/engine:2"}, "svc-router": {"r/router:3"}}


def test_the_crd_has_no_image_default_and_the_flag_reaches_the_features() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    image = schema["properties"]["spec"]["properties"]["engine"]["properties"]["image"]
    assert "default" not in image  # else the API server would fill it in and the operator's never applies
    top = tidepool_parser().parse_args(["operator", "--engine-image=registry.local/engine:1"])
    assert operator_parser().parse_args(top.args).engine_image == "registry.local/engine:1"
    assert operator_parser().parse_args([]).engine_image is None  # OperatorOptions then uses the API's default
