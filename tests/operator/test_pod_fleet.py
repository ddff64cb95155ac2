"""Pod overrides for real GPU fleets (#39 item 6) in the rendered children: spec.accelerator.resourceName, extended
resources, DRA resource claims, pod labels/annotations, schedulerName and priorityClassName, and the
InferenceService's own labels inherited by every child (GitOps tracking labels excluded, the operator's never
overridden, the spec hash moving with them)."""

from __future__ import annotations

from typing import Any

import pytest
from test_builders import DISAGG, MULTI_NODE, UNIFIED, build, by_key, pod_specs, spec

from tidepool.operator.api import InferenceServiceSpec, validate_spec
from tidepool.operator.api import pod as api_pod
from tidepool.operator.builders import ClusterFeatures, ServiceView, desired_state
from tidepool.operator.builders.common import (
    INHERIT_EXCLUDED_KEYS,
    LABEL_SPEC_HASH,
    inherited_labels,
    labels,
    selector_labels,
)
from tidepool.operator.builders.engine import gpu_taint_keys

FORMS = {
    "deployment": (UNIFIED, ClusterFeatures()),
    "statefulset": (MULTI_NODE, ClusterFeatures()),
    "leaderworkerset": (MULTI_NODE, ClusterFeatures(has_lws=True)),
    "disaggregated": (DISAGG, ClusterFeatures()),
}
FLEET_POD = {
    "labels": {"kueue.x-k8s.io/queue-name": "team-a", "cost-center": "ml"},
    "annotations": {"example.com/owner": "platform"},
    "schedulerName": "volcano",
    "priorityClassName": "inference-high",
    "resourceClaims": [
        {"name": "nic", "resourceClaimName": "shared-nic"},
        {"name": "gpus", "resourceClaimTemplateName": "h100-pair"},
    ],
    "resources": {"limits": {"rdma/hca": "1"}, "claims": [{"name": "nic"}]},
}


def engine_templates(children: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t for t in pod_specs(children) if t["metadata"]["labels"]["tidepool.dev/pool"] != "router"]


@pytest.mark.parametrize("form", FORMS)
def test_accelerator_resource_name_is_requested_and_tolerated(form: str) -> None:
    base, features = FORMS[form]
    for name, taints in (
        ("amd.com/gpu", ["amd.com/gpu"]),
        ("nvidia.com/mig-1g.10gb", ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb"]),
    ):
        templates = engine_templates(build(spec(base, accelerator={"resourceName": name}), features))
        assert templates
        for template in templates:
            resources = template["spec"]["containers"][0]["resources"]
            gpus = str(InferenceServiceSpec.model_validate(base).gpus_per_pod())
            assert resources["requests"][name] == resources["limits"][name] == gpus
            assert "nvidia.com/gpu" not in resources["limits"] or name.startswith("nvidia.com/gpu")
            keys = [t["key"] for t in template["spec"]["tolerations"] if t.get("effect") == "NoSchedule"]
            assert keys[: len(taints)] == taints == gpu_taint_keys(name)


def test_default_accelerator_is_nvidia_and_cpu_pools_request_none() -> None:
    (template,) = engine_templates(build(spec(UNIFIED)))
    assert template["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    cpu = spec(UNIFIED, resources={"gpusPerReplica": 0}, accelerator={"resourceName": "amd.com/gpu"})
    (template,) = engine_templates(build(cpu))
    assert not any("/" in k for k in template["spec"]["containers"][0]["resources"]["limits"])
    assert "tolerations" not in template["spec"]


@pytest.mark.parametrize("form", FORMS)
def test_fleet_overrides_land_in_every_engine_pod_and_not_the_router(form: str) -> None:
    base, features = FORMS[form]
    children = build(spec(base, pod=FLEET_POD), features)
    for template in engine_templates(children):
        pod, engine = template["spec"], template["spec"]["containers"][0]
        meta = template["metadata"]
        assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "team-a" and meta["labels"]["cost-center"] == "ml"
        assert meta["annotations"]["example.com/owner"] == "platform"
        assert meta["annotations"]["prometheus.io/scrape"] == "true"  # the operator's own stay
        assert pod["schedulerName"] == "volcano" and pod["priorityClassName"] == "inference-high"
        assert pod["resourceClaims"] == sorted(FLEET_POD["resourceClaims"], key=lambda c: c["name"])
        assert engine["resources"]["claims"] == [{"name": "nic"}]
        assert engine["resources"]["limits"]["rdma/hca"] == "1"
    router = by_key(children)[("Deployment", "svc-router")]["spec"]["template"]
    assert "kueue.x-k8s.io/queue-name" not in router["metadata"]["labels"]
    assert not {"schedulerName", "resourceClaims"} & set(router["spec"])
    assert "claims" not in router["spec"]["containers"][0]["resources"]


def test_a_pool_merges_claims_and_labels_over_spec_pod() -> None:
    pool_pod = {
        "labels": {"cost-center": "prefill"},
        "resourceClaims": [{"name": "gpus", "resourceClaimName": "prefill-gpus"}],
        "resources": {"claims": [{"name": "gpus", "request": "gpu"}]},
        "schedulerName": "kai-scheduler",
    }
    s = spec(DISAGG, pod=FLEET_POD, pools__prefill__pod=pool_pod)
    assert validate_spec(InferenceServiceSpec.model_validate(s)) == []
    by_pool = {t["metadata"]["labels"]["tidepool.dev/pool"]: t for t in engine_templates(build(s))}
    prefill, decode = by_pool["prefill"]["spec"], by_pool["decode"]["spec"]
    assert prefill["resourceClaims"] == [
        {"name": "gpus", "resourceClaimName": "prefill-gpus"},  # the pool's entry replaces spec.pod's by name
        {"name": "nic", "resourceClaimName": "shared-nic"},
    ]
    assert prefill["containers"][0]["resources"]["claims"] == [{"name": "gpus", "request": "gpu"}, {"name": "nic"}]
    assert prefill["schedulerName"] == "kai-scheduler" and decode["schedulerName"] == "volcano"
    assert by_pool["prefill"]["metadata"]["labels"]["cost-center"] == "prefill"
    assert by_pool["decode"]["metadata"]["labels"]["cost-center"] == "ml"


SERVICE_LABELS = {
    "team": "search",
    "cost-center": "ml-42",
    "app.kubernetes.io/instance": "argocd-app",  # Argo CD's default tracking label
    "argocd.argoproj.io/instance": "argocd-app",
    "kustomize.toolkit.fluxcd.io/name": "apps",
    "kubectl.kubernetes.io/last-applied": "x",
    "kueue.x-k8s.io/queue-name": "team-a",
    "tidepool.dev/pool": "hijack",
    "app.kubernetes.io/name": "not-tidepool",  # the operator's own wins
}
INHERITED = {"team": "search", "cost-center": "ml-42"}


@pytest.mark.parametrize("form", FORMS)
def test_service_labels_reach_every_child_and_pod_template_but_tracking_labels(form: str) -> None:
    base, features = FORMS[form]
    view = ServiceView.from_spec(spec(base))
    desired = desired_state("svc", "ns", view, features, service_labels=SERVICE_LABELS)
    plain = desired_state("svc", "ns", view, features)
    for child in desired.children:
        lbls = child["metadata"]["labels"]
        if child["kind"] == "PersistentVolumeClaim":
            continue
        assert {k: lbls.get(k) for k in INHERITED} == INHERITED, child["kind"]
        assert lbls["app.kubernetes.io/name"] == "tidepool" and lbls["app.kubernetes.io/instance"] == "svc"
        assert not any(k.startswith(("argocd.", "kustomize.", "kubectl.", "kueue.")) for k in lbls)
    for template in pod_specs(desired.children):
        lbls = template["metadata"]["labels"]
        assert {k: lbls.get(k) for k in INHERITED} == INHERITED
        assert lbls["tidepool.dev/pool"] != "hijack"
    # The spec hash moves with the labels (a rollout the budget sees), the same in every group of a pool.
    hashes = {t["metadata"]["labels"][LABEL_SPEC_HASH] for t in engine_templates(desired.children)}
    before = {t["metadata"]["labels"][LABEL_SPEC_HASH] for t in engine_templates(plain.children)}
    assert len(hashes) == len(before) and not hashes & before
    assert {layout.spec_hash for layout in desired.pools} <= hashes
    for child in desired.children:
        if child["kind"] in ("Deployment", "StatefulSet"):
            assert (
                child["metadata"]["labels"][LABEL_SPEC_HASH]
                == child["spec"]["template"]["metadata"]["labels"][LABEL_SPEC_HASH]
            )


def test_no_service_labels_change_nothing() -> None:
    view = ServiceView.from_spec(spec(UNIFIED))
    only_excluded = {k: "x" for k in INHERIT_EXCLUDED_KEYS} | {"argocd.argoproj.io/instance": "a"}
    assert inherited_labels(only_excluded) == {}
    assert desired_state("svc", "ns", view, service_labels=only_excluded) == desired_state("svc", "ns", view)


def test_reserved_pod_labels_are_every_label_the_operator_sets() -> None:
    for component, pool in (("engine", "unified"), ("engine", "prefill"), ("router", "router")):
        assert all(api_pod.reserved_label(k) for k in labels("svc", pool, component))
    assert all(api_pod.reserved_label(k) for k in selector_labels("svc", "unified"))
    assert all(api_pod.reserved_label(k) for k in (LABEL_SPEC_HASH, "tidepool.dev/group-index"))
    assert not api_pod.reserved_label("kueue.x-k8s.io/queue-name")
