"""What Kubernetes itself refuses in a pod, refused already in the InferenceService that would make it.

`POD_CASES` join tests/operator/test_api_cases.py's INVALID_CASES (the models refuse each one; the API server
refuses it at admission, tests/controlplane/test_cp_crd.py). Without these checks the API server accepted such
an InferenceService and then refused every pod template the operator applied (Degraded, ApplyFailed): found by a
fuzz of the CRD against a real API server. `VALID_POD_EDITS` are the edge cases Kubernetes does accept: the
models and the API server must accept them, and so must the API server the children built from them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from api_case_kit import Case, both, rule_message, set_path

from tidepool.operator.api import quantity

Edit = Callable[[dict[str, Any]], None]


def _anti_affinity(term: dict[str, Any]) -> Edit:
    return set_path(
        "spec.pod.affinity", {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    )


def _node_terms(*terms: dict[str, Any]) -> Edit:
    return set_path(
        "spec.pod.affinity",
        {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}},
    )


def _spread(*constraints: dict[str, Any]) -> Edit:
    base = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}
    return set_path("spec.pod.topologySpreadConstraints", [{**base, **c} for c in constraints])


def _claim(spec: dict[str, Any]) -> Edit:
    return set_path("spec.pod.volumes", [{"name": "scratch", "ephemeral": {"volumeClaimTemplate": {"spec": spec}}}])


def _files(*items: dict[str, Any]) -> Edit:
    return set_path("spec.pod.volumes", [{"name": "info", "downwardAPI": {"items": list(items)}}])


_HOST = "kubernetes.io/hostname"

POD_CASES: tuple[Case, ...] = (
    Case(
        "toleration-no-key-equal",
        set_path("spec.pod.tolerations", [{"key": "", "operator": "Equal", "value": "x"}]),
        rule_message("a toleration without key"),
        "rule",
    ),
    Case(
        "node-selector-key",
        set_path("spec.pod.nodeSelector", {"gpu type": "a100"}),
        rule_message("pod.nodeSelector and pod.annotations keys"),
        "rule",
    ),
    Case(
        "annotation-key",
        set_path("spec.pod.annotations", {"https://example.com/x": "1"}),
        rule_message("pod.nodeSelector and pod.annotations keys"),
        "rule",
    ),
    Case(
        "router-node-selector-key",
        set_path("spec.router.nodeSelector", {"-edge": "true"}),
        rule_message("router.nodeSelector keys"),
        "rule",
    ),
    Case(
        "match-labels-key",
        _anti_affinity({"topologyKey": _HOST, "labelSelector": {"matchLabels": {"app name": "x"}}}),
        rule_message("a label selector's matchLabels keys"),
        "rule",
    ),
    Case(
        "claim-label-key",
        set_path(
            "spec.pod.volumes",
            [
                {
                    "name": "scratch",
                    "ephemeral": {
                        "volumeClaimTemplate": {
                            "metadata": {"labels": {"a/b/c": "x"}},
                            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
                        }
                    },
                }
            ],
        ),
        rule_message("an ephemeral volume claim's labels"),
        "rule",
    ),
    Case(
        "label-selector-in-without-values",
        _anti_affinity({"topologyKey": _HOST, "labelSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}),
        rule_message("a label selector's matchExpressions need values"),
        "rule",
    ),
    Case(
        "label-selector-exists-with-values",
        _anti_affinity(
            {
                "topologyKey": _HOST,
                "labelSelector": {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]},
            }
        ),
        rule_message("a label selector's matchExpressions need values"),
        "rule",
    ),
    Case(
        "node-selector-gt-not-integer",
        _node_terms({"matchExpressions": [{"key": "gpu-count", "operator": "Gt", "values": ["many"]}]}),
        rule_message("a node selector's matchExpressions need values"),
        "rule",
    ),
    Case(
        "node-selector-in-without-values",
        _node_terms({"matchExpressions": [{"key": "zone", "operator": "NotIn"}]}),
        rule_message("a node selector's matchExpressions need values"),
        "rule",
    ),
    Case(
        "match-label-keys-without-selector",
        _anti_affinity({"topologyKey": _HOST, "matchLabelKeys": ["app"]}),
        rule_message("a pod (anti-)affinity term with matchLabelKeys"),
        "rule",
    ),
    Case(
        "label-key-matched-and-mismatched",
        _anti_affinity(
            {
                "topologyKey": _HOST,
                "labelSelector": {"matchLabels": {"x": "y"}},
                "matchLabelKeys": ["a"],
                "mismatchLabelKeys": ["a"],
            }
        ),
        rule_message("a pod (anti-)affinity term must not list a key in both"),
        "rule",
    ),
    Case(
        "spread-min-domains-anyway",
        _spread({"whenUnsatisfiable": "ScheduleAnyway", "minDomains": 2}),
        rule_message("a topology spread constraint's minDomains"),
        "rule",
    ),
    Case("spread-repeated", _spread({}, {}), rule_message("pod.topologySpreadConstraints must not repeat"), "rule"),
    Case(
        "env-field-path",
        set_path("spec.pod.env", [{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeNam"}}}]),
        rule_message("pod.env valueFrom.fieldRef.fieldPath"),
        "rule",
    ),
    Case(
        "env-field-path-all-labels",
        set_path("spec.pod.env", [{"name": "L", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels"}}}]),
        rule_message("pod.env valueFrom.fieldRef.fieldPath"),
        "rule",
    ),
    Case("file-no-source", _files({"path": "x"}), rule_message("a downwardAPI item needs exactly one"), "rule"),
    Case(
        "file-resource-no-container",
        _files({"path": "cpu", "resourceFieldRef": {"resource": "limits.cpu"}}),
        rule_message("a downwardAPI item's resourceFieldRef needs containerName"),
        "rule",
    ),
    # Refused by the schema itself (patterns, enums, bounds): the API server's message names the field.
    Case("memory-negative", set_path("spec.resources.memory", "-1Gi"), quantity.QUANTITY_MESSAGE, "field"),
    Case(
        "cache-claim-size-zero",
        set_path("spec.modelCache", {"persistentVolumeClaim": {"claimName": "w", "size": 0}}),
        quantity.POSITIVE_QUANTITY_MESSAGE,
        "field",
    ),
    Case(
        "claim-storage-zero",
        _claim({"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "0Gi"}}}),
        "storage in body should match",
        "field",
    ),
    Case(
        "claim-without-access-modes",
        _claim({"resources": {"requests": {"storage": "1Gi"}}}),
        "accessModes: Required value",
        "field",
    ),
    Case("image-blank", set_path("spec.engine.image", " "), "image in body should match", "field"),
    Case(
        "gpu-product", set_path("spec.resources.gpuProduct", "NVIDIA H100"), "gpuProduct in body should match", "field"
    ),
    Case("topology-key", _anti_affinity({"topologyKey": "https://h/x"}), "topologyKey in body should match", "field"),
    Case("spread-topology-key", _spread({"topologyKey": "zone "}), "topologyKey in body should match", "field"),
    Case("node-selector-value", set_path("spec.pod.nodeSelector", {"zone": "a-"}), "should match", "field"),
    Case(
        "toleration-key",
        set_path("spec.pod.tolerations", [{"key": "a b", "operator": "Exists"}]),
        "key in body should match",
        "field",
    ),
    Case(
        "node-field-operator",
        _node_terms({"matchFields": [{"key": "metadata.name", "operator": "Exists"}]}),
        'supported values: "In", "NotIn"',
        "field",
    ),
    Case(
        "node-field-key",
        _node_terms({"matchFields": [{"key": "spec.unschedulable", "operator": "In", "values": ["n"]}]}),
        'supported values: "metadata.name"',
        "field",
    ),
    Case(
        "node-field-two-values",
        _node_terms({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["a", "b"]}]}),
        "must have at most 1 item",
        "field",
    ),
    Case("node-no-terms", _node_terms(), "should have at least 1 items", "field"),
    Case(
        "secret-key",
        set_path("spec.pod.env", [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "a b"}}}]),
        "key in body should match",
        "field",
    ),
    Case(
        "item-path-up",
        set_path(
            "spec.pod.volumes", [{"name": "c", "configMap": {"name": "c", "items": [{"key": "k", "path": "../x"}]}}]
        ),
        "path in body should match",
        "field",
    ),
    Case(
        "sub-path-absolute",
        both(
            set_path("spec.pod.volumes", [{"name": "data", "emptyDir": {}}]),
            set_path("spec.pod.volumeMounts", [{"name": "data", "mountPath": "/data", "subPath": "/etc"}]),
        ),
        "subPath in body should match",
        "field",
    ),
    Case(
        "env-resource",
        set_path("spec.pod.env", [{"name": "C", "valueFrom": {"resourceFieldRef": {"resource": "limits.gpu"}}}]),
        "resource in body should match",
        "field",
    ),
    Case(
        "env-from-prefix",
        set_path("spec.pod.envFrom", [{"prefix": "A=", "configMapRef": {"name": "c"}}]),
        "prefix in body should match",
        "field",
    ),
    Case(
        "file-field-path",
        _files({"path": "node", "fieldRef": {"fieldPath": "spec.nodeName"}}),
        "fieldPath in body should match",
        "field",
    ),
)

_LABELS = {"app": "chat", "tier": "gpu"}
VALID_POD_EDITS: tuple[tuple[str, Edit], ...] = (
    (
        "tolerations",
        set_path(
            "spec.pod.tolerations",
            [
                {"operator": "Exists"},
                {"key": "", "operator": "Exists", "effect": "NoSchedule"},
                {
                    "key": "nvidia.com/gpu",
                    "operator": "Equal",
                    "value": "",
                    "effect": "NoExecute",
                    "tolerationSeconds": 60,
                },
            ],
        ),
    ),
    (
        "affinity",
        set_path(
            "spec.pod.affinity",
            {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "nvidia.com/gpu.count", "operator": "Gt", "values": ["3"]},
                                    {"key": "zone", "operator": "In", "values": ["a", "b"]},
                                    {"key": "example.com/spot", "operator": "DoesNotExist"},
                                ]
                            },
                            {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["node-1.x"]}]},
                        ]
                    }
                },
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 50,
                            "podAffinityTerm": {
                                "topologyKey": _HOST,
                                "labelSelector": {"matchLabels": _LABELS},
                                "matchLabelKeys": ["pod-template-hash"],
                                "mismatchLabelKeys": ["tenant"],
                            },
                        }
                    ]
                },
            },
        ),
    ),
    (
        "spread",
        _spread(
            {"minDomains": 2, "matchLabelKeys": ["pod-template-hash"]},
            {"whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {"matchLabels": {"example.com/x": ""}}},
        ),
    ),
    (
        "env-and-files",
        both(
            set_path(
                "spec.pod.env",
                [
                    {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                    {"name": "TEAM", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['example.com/team']"}}},
                    {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory"}}},
                    {"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token.v2_a"}}},
                ],
            ),
            set_path("spec.pod.envFrom", [{"prefix": "CFG_", "configMapRef": {"name": "c"}}]),
            set_path(
                "spec.pod.volumes",
                [
                    {
                        "name": "info",
                        "downwardAPI": {
                            "items": [
                                {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                                {"path": "x/..y/.z", "fieldRef": {"fieldPath": "metadata.annotations['a']"}},
                                {
                                    "path": "cpu",
                                    "resourceFieldRef": {"resource": "requests.cpu", "containerName": "engine"},
                                },
                            ]
                        },
                    },
                    {
                        "name": "scratch",
                        "ephemeral": {
                            "volumeClaimTemplate": {
                                "metadata": {"labels": {"example.com/purpose": "scratch"}},
                                "spec": {
                                    "accessModes": ["ReadWriteOnce"],
                                    "resources": {"requests": {"storage": "0.5Gi"}},
                                },
                            }
                        },
                    },
                ],
            ),
            set_path("spec.pod.volumeMounts", [{"name": "info", "mountPath": "/etc/info", "subPath": "x"}]),
            set_path("spec.pod.annotations", {"example.com/owner": "team-a", "note": "free text: anything"}),
            set_path("spec.pod.nodeSelector", {"node.kubernetes.io/instance-type": "gpu_large.8x", "empty": ""}),
        ),
    ),
)
