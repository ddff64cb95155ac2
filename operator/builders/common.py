"""Names, labels, the spec hash and the Pod Security "restricted" contexts shared by all builders.

The InferenceService's own labels reach every child and pod template (`inherited_labels`, `inherit_labels`),
minus GitOps tools' tracking labels and the other documented exclusions.

Invariants: pure functions; selector labels (`tidepool.dev/inferenceservice`, `tidepool.dev/pool`)
never change for a child, so selectors stay immutable; the spec hash is a digest of a canonical JSON
dump (sorted keys), so equal inputs always give equal hashes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from tidepool.operator.api import DEFAULT_ENGINE_IMAGE, ServiceView

GROUP = "tidepool.dev"
LABEL_SERVICE = f"{GROUP}/inferenceservice"
LABEL_POOL = f"{GROUP}/pool"
LABEL_SPEC_HASH = f"{GROUP}/spec-hash"
LABEL_GROUP_INDEX = f"{GROUP}/group-index"
LABEL_COMPONENT = "app.kubernetes.io/component"  # engine, router, ...: which part of the service
MANAGED_BY = "tidepool-operator"
ROUTER_POOL = "router"
DEFAULT_ROUTER_CLUSTER_ROLE = "tidepool-router"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "LeaderWorkerSet")  # the kinds that run pods
ENGINE_PORT = 8000
ROUTER_PORT = 8080
KV_PORT = 14579
MASTER_PORT = 29500
RUN_AS_ID = 1000
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
# llm-d's inference scheduler (an Endpoint Picker) routes prefill and decode by this pod label; "both"
# marks a unified replica, which it treats as able to do either (llm-d-inference-scheduler's filters).
LLMD_ROLE_LABEL = "llm-d.ai/role"
LLMD_ROLES = {"unified": "both", "prefill": "prefill", "decode": "decode"}


@dataclass(frozen=True, slots=True)
class Collector:
    """The operator's metrics collector as a NetworkPolicy peer (--collector-* flags): its pods (labels in a
    namespace) and/or address blocks; the services' NetworkPolicies let it reach /metrics. Empty: no rule."""

    namespace: str | None = None  # the pods' namespace; None: pod_labels are not used (no namespace to scope them)
    pod_labels: tuple[tuple[str, str], ...] = ()  # sorted (key, value) pairs
    ip_blocks: tuple[str, ...] = ()  # CIDRs (an operator running outside the cluster)


@dataclass(frozen=True, slots=True)
class ClusterFeatures:
    """What the cluster offers and how the operator is configured (detected or flagged at runtime)."""

    has_lws: bool = False  # the LeaderWorkerSet CRD is installed
    has_service_monitor: bool = False  # the Prometheus operator's ServiceMonitor CRD is installed
    has_inference_pool: bool = False  # the Gateway API Inference Extension's InferencePool (v1) CRD is installed
    gpus_per_node: int = 8
    engine_image: str = DEFAULT_ENGINE_IMAGE  # for services without spec.engine.image (--engine-image)
    router_image: str | None = None  # default: the engine image (it ships `tidepool router`)
    hf_download_image: str | None = None  # default: the engine image (it ships `tidepool download`)
    s3_download_image: str = "amazon/aws-cli:2.22.35"
    collector: Collector = Collector()  # who scrapes the pods (NetworkPolicies let it in: netpol.py)
    # The chart-shipped ClusterRole (endpointslices get/list/watch) each router's RoleBinding names
    # (--router-cluster-role; the chart's `<fullname>-router`, so release "tidepool" gives this default).
    router_cluster_role: str = DEFAULT_ROUTER_CLUSTER_ROLE


def engine_image(view: ServiceView, features: ClusterFeatures) -> str:
    """The engine pods' image: the service's own, else the operator's default."""
    return view.engine.image or features.engine_image


def spec_hash(obj: Any) -> str:
    """A short, stable digest of any JSON-serialisable object."""
    raw = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def child_name(service: str, part: str) -> str:
    return f"{service}-{part}"


def selector_labels(service: str, pool: str) -> dict[str, str]:
    return {LABEL_SERVICE: service, LABEL_POOL: pool}


def labels(service: str, pool: str, component: str) -> dict[str, str]:
    """Labels of every child; engine children (and so engine pods) also carry llm-d's role label."""
    out = {
        "app.kubernetes.io/name": "tidepool",
        "app.kubernetes.io/instance": service,
        LABEL_COMPONENT: component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **selector_labels(service, pool),
    }
    if component == "engine" and pool in LLMD_ROLES:
        out[LLMD_ROLE_LABEL] = LLMD_ROLES[pool]
    return out


# The InferenceService's own labels reach every child and pod template (cost labels, team, environment), except
# these: tracking labels of GitOps tools and kubectl (copied, they would make Argo CD or Flux think it owns or
# should prune the children: app.kubernetes.io/instance is Argo CD's default tracking label), Helm's, Kueue's
# (a queue name on the router or the Services would have Kueue gate them: pod.labels puts one on engine pods),
# and the operator's own prefix. The operator's own labels are never overridden.
INHERIT_EXCLUDED_PREFIXES: tuple[str, ...] = (
    f"{GROUP}/", "kubectl.kubernetes.io/", "argocd.argoproj.io/", "kustomize.toolkit.fluxcd.io/",
    "helm.toolkit.fluxcd.io/", "kueue.x-k8s.io/",
)  # fmt: skip
INHERIT_EXCLUDED_KEYS: tuple[str, ...] = ("app.kubernetes.io/instance", "app.kubernetes.io/managed-by", "helm.sh/chart")
# Where a child kind keeps its pod templates (a path of keys from the object).
TEMPLATE_PATHS: dict[str, tuple[tuple[str, ...], ...]] = {
    "Deployment": (("spec", "template"),),
    "StatefulSet": (("spec", "template"),),
    "LeaderWorkerSet": (
        ("spec", "leaderWorkerTemplate", "workerTemplate"),
        ("spec", "leaderWorkerTemplate", "leaderTemplate"),
    ),
}


def inherited_labels(service_labels: dict[str, str] | None) -> dict[str, str]:
    """The labels of an InferenceService that its children carry too (see INHERIT_EXCLUDED_*)."""
    return {
        k: v
        for k, v in sorted((service_labels or {}).items())
        if k not in INHERIT_EXCLUDED_KEYS and not k.startswith(INHERIT_EXCLUDED_PREFIXES)
    }


def inherit_labels(child: dict[str, Any], inherited: dict[str, str]) -> None:
    """Add `inherited` (from `inherited_labels`) to a child's labels and its pod templates' (in place), under
    the operator's own. A template's spec hash then covers them (a digest of the old hash and the labels, the
    same for every group of a pool), so the rollout budget and the current-template counts see the change; with
    no inherited labels nothing changes, hash included."""
    if not inherited:
        return
    meta = child["metadata"]
    meta["labels"] = dict(sorted({**inherited, **meta.get("labels", {})}.items()))
    for path in TEMPLATE_PATHS.get(child["kind"], ()):
        node: Any = child
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if not node:
            continue
        tmpl_meta = node.setdefault("metadata", {})
        tmpl_labels = {**inherited, **tmpl_meta.get("labels", {})}
        if LABEL_SPEC_HASH in tmpl_labels:
            tmpl_labels[LABEL_SPEC_HASH] = spec_hash([tmpl_labels[LABEL_SPEC_HASH], inherited])
            meta["labels"][LABEL_SPEC_HASH] = tmpl_labels[LABEL_SPEC_HASH]
        tmpl_meta["labels"] = dict(sorted(tmpl_labels.items()))


def metadata(name: str, namespace: str, lbls: dict[str, str], annotations: dict[str, str] | None = None) -> dict:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(sorted(lbls.items()))}
    if annotations:
        meta["annotations"] = dict(sorted(annotations.items()))
    return meta


def pod_security_context() -> dict[str, Any]:
    """Pod-level half of the "restricted" profile (numeric ids: runAsNonRoot needs no image USER)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_ID,
        "runAsGroup": RUN_AS_ID,
        "fsGroup": RUN_AS_ID,
        # Chown a volume only when its root's owner differs: a big model-cache claim is not walked at every start.
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def sorted_env(env: dict[str, Any]) -> list[dict[str, Any]]:
    """Env entries sorted by name; a str value becomes `value`, a dict is a `valueFrom` source."""
    out = []
    for name in sorted(env):
        value = env[name]
        out.append({"name": name, "value": value} if isinstance(value, str) else {"name": name, "valueFrom": value})
    return out


def flags_to_args(flags: dict[str, Any]) -> list[str]:
    """`{"--port": 8000, "--x": True}` -> sorted `["--port", "8000", "--x"]` (True: bare flag, None: omitted)."""
    args: list[str] = []
    for flag in sorted(flags):
        value = flags[flag]
        if value is None or value is False:
            continue
        args.append(flag)
        if value is not True:
            args.append(str(value))
    return args
