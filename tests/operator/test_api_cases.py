"""Invalid InferenceServices and what must be said about them; checked here against the models.

`INVALID_CASES` (these plus tests/api_cases_pod.py's) is shared with tests/controlplane/test_cp_crd.py (which
loads this file by path), which sends
each one to a real API server and asserts its rejection carries `message`. Here, a `rule` case
must be reported by `validate_spec` with that exact message (the CEL and Python mirror agree),
and a `field` case must be refused by pydantic itself (a bound, enum or single-value rule).
"""

from __future__ import annotations

import pytest
from api_case_kit import Case, both, rule_message, sample, set_path
from api_cases_idle import IDLE_CASES, VALID_IDLE_EDITS
from api_cases_lora import LORA_CASES, VALID_LORA_EDITS
from api_cases_netpol import NETPOL_CASES, VALID_NETPOL_EDITS
from api_cases_pod import POD_CASES, VALID_POD_EDITS
from api_cases_resources import RESOURCE_CASES, VALID_RESOURCE_EDITS
from pydantic import ValidationError

from tidepool.operator.api import InferenceService, ServiceView, rules, types, validate_spec
from tidepool.operator.builders import ClusterFeatures, desired_state

# Real GPU fleets (#39 item 6): other vendors' and MIG resources, RDMA, DRA claims, Kueue labels, schedulers.
VALID_FLEET_EDITS = (
    ("accelerator-amd", set_path("spec.accelerator", {"resourceName": "amd.com/gpu"})),
    (
        "mig-and-rdma",
        both(
            set_path("spec.accelerator", {"resourceName": "nvidia.com/mig-1g.10gb"}),
            set_path("spec.pod.resources", {"limits": {"rdma/hca": 1}}),
            set_path(
                "spec.pools.unified.pod",
                {"resources": {"requests": {"example.com/fpga": 2}, "limits": {"example.com/fpga": "2"}}},
            ),
        ),
    ),
    (
        "dra-claims",
        both(
            set_path(
                "spec.pod.resourceClaims",
                [
                    {"name": "nic", "resourceClaimName": "shared-nic"},
                    {"name": "gpus", "resourceClaimTemplateName": "t"},
                ],
            ),
            set_path("spec.pod.resources", {"claims": [{"name": "nic"}]}),
            set_path(
                "spec.pools.unified.pod",
                {
                    "resourceClaims": [{"name": "extra", "resourceClaimTemplateName": "t2"}],
                    "resources": {"claims": [{"name": "gpus", "request": "gpu"}, {"name": "extra"}]},
                },
            ),
        ),
    ),
    (
        "labels-and-scheduling",
        both(
            set_path("spec.pod.labels", {"kueue.x-k8s.io/queue-name": "team-a", "cost-center": "ml"}),
            set_path("spec.pod.annotations", {"example.com/owner": "ml-platform"}),
            set_path("spec.pod.schedulerName", "volcano"),
            set_path("spec.pod.priorityClassName", "inference-high"),
        ),
    ),
)
VALID_EDITS = (
    *VALID_POD_EDITS,
    *VALID_RESOURCE_EDITS,
    *VALID_LORA_EDITS,
    *VALID_FLEET_EDITS,
    *VALID_IDLE_EDITS,
    *VALID_NETPOL_EDITS,
)
INVALID_CASES: tuple[Case, ...] = (
    *POD_CASES,
    *IDLE_CASES,
    *NETPOL_CASES,
    *RESOURCE_CASES,
    *LORA_CASES,
    Case("unified-with-prefill", set_path("spec.pools.prefill", {}), rule_message("mode unified needs"), "rule"),
    Case(
        "disagg-without-decode",
        both(set_path("spec.mode", "disaggregated"), set_path("spec.pools", {"prefill": {}})),
        rule_message("mode disaggregated needs"),
        "rule",
    ),
    Case("min-above-max", set_path("spec.pools.unified.minReplicas", 5), rule_message("minReplicas must not"), "rule"),
    Case(
        "replicas-above-max",
        set_path("spec.pools.unified.replicas", 9),
        rule_message("replicas must lie between"),
        "rule",
    ),
    Case(
        "scale-replicas-out-of-bounds",
        set_path("spec.replicas", 7),
        rule_message("spec.replicas must lie within"),
        "rule",
        base="disaggregated",
    ),
    Case(
        "external-without-replicas",
        set_path("spec.autoscaling", {"enabled": False, "mode": "external"}),
        rule_message("autoscaling.mode external needs"),
        "rule",
    ),
    Case(
        "tp-vs-gpus",
        set_path("spec.parallelism.tensor", 2),
        rule_message("resources.gpusPerReplica must equal"),
        "rule",
    ),
    Case(  # the engine splits only unquantized layers across tensor ranks (the sample runs tensor: 2)
        "tp-quantized",
        set_path("spec.model.quantization", "int8"),
        rule_message("parallelism.tensor > 1 needs model.quantization none"),
        "rule",
        base="disaggregated",
    ),
    Case(
        "uri-scheme", set_path("spec.model.uri", "http://example.com/model"), rule_message("model.uri must be"), "rule"
    ),
    Case("file-uri", set_path("spec.model.uri", "file:///models/tiny"), rule_message("model.uri file://"), "rule"),
    Case(
        "catalogue-unknown",
        set_path("spec.model.uri", "catalogue://no-such-model"),
        rule_message("model.uri must be"),
        "rule",
    ),
    Case(
        "revision-not-hf",
        both(set_path("spec.model.uri", "pvc://weights/llama"), set_path("spec.model.revision", "v1")),
        rule_message("model.revision applies only"),
        "rule",
    ),
    Case(
        "draft-without-model",
        set_path("spec.engine.speculative", {"method": "draft"}),
        rule_message("speculative.method draft needs"),
        "rule",
    ),
    Case(
        "scale-to-zero-min-one",
        set_path("spec.autoscaling.scaleToZero", {"enabled": True}),
        rule_message("autoscaling.scaleToZero.enabled needs"),
        "rule",
    ),
    Case(
        "router-replicas-zero",
        set_path("spec.router.replicas", 0),
        rule_message("router.replicas must be at least 1 (unset: automatic); to run without a router set"),
        "rule",
    ),
    Case(
        "disagg-no-router",
        set_path("spec.router.enabled", False),
        rule_message("router.enabled: false needs mode unified"),
        "rule",
        base="disaggregated",
    ),
    Case(
        "batched-below-seqs",
        set_path("spec.engine.maxNumBatchedTokens", 64),
        rule_message("engine.maxNumBatchedTokens must be at least engine.maxNumSeqs"),
        "rule",
    ),
    Case(
        "no-chunked-prefill-short-budget",
        both(set_path("spec.engine.chunkedPrefill", False), set_path("spec.engine.maxNumBatchedTokens", 2048)),
        rule_message("without chunkedPrefill"),
        "rule",
    ),
    Case(
        "extra-arg-managed",
        set_path("spec.engine.extraArgs", ["--port=9000"]),
        rule_message("engine.extraArgs must not"),
        "rule",
    ),
    Case(
        "extra-arg-shape",
        set_path("spec.engine.extraArgs", ["seed=3"]),
        rule_message("engine.extraArgs entries"),
        "rule",
    ),
    # Flags the builder sets that the hand-written list used to miss: the operator's value must not be overridden.
    Case(
        "extra-arg-role",
        set_path("spec.engine.extraArgs", ["--role=decode"]),
        rule_message("engine.extraArgs must not"),
        "rule",
    ),
    Case(
        "extra-arg-negated",
        set_path("spec.engine.extraArgs", ["--seed=3", "--no-enable-prefix-caching"]),
        rule_message("engine.extraArgs must not"),
        "rule",
    ),
    Case(
        "drain-too-long",
        set_path("spec.engine.drainTimeoutSeconds", 7200),
        "should be less than or equal to 3600",
        "field",
    ),
    Case(
        "rollout-stuck",
        set_path("spec.rollout", {"maxSurge": 0, "maxUnavailable": "0%"}),
        rule_message("rollout.maxSurge"),
        "rule",
    ),
    Case(
        "pdb-both-bounds",
        set_path("spec.pools.unified.disruptionBudget", {"maxUnavailable": 1, "minAvailable": "50%"}),
        rule_message("disruptionBudget must set exactly one"),
        "rule",
    ),
    Case(
        "pdb-no-bound",
        set_path("spec.pools.unified.disruptionBudget", {}),
        rule_message("disruptionBudget must set exactly one"),
        "rule",
    ),
    Case(
        "pdb-not-percent",
        set_path("spec.pools.unified.disruptionBudget", {"minAvailable": "half"}),
        types.INT_OR_PERCENT_MESSAGE,
        "field",
    ),
    Case("auth-no-secret", set_path("spec.auth", {}), "apiKeySecretRef", "field"),
    Case(
        "auth-dot-key",
        set_path("spec.auth", {"apiKeySecretRef": {"name": "keys", "key": ".."}}),
        rule_message("auth.apiKeySecretRef.key must not be"),
        "rule",
    ),
    Case(
        "auth-bad-key",
        set_path("spec.auth", {"apiKeySecretRef": {"name": "keys", "key": "a key"}}),
        "should match",
        "field",
    ),
    Case(
        "toleration-exists-value",
        set_path("spec.pod.tolerations", [{"key": "gpu", "operator": "Exists", "value": "yes"}]),
        rule_message("a toleration with operator Exists"),
        "rule",
    ),
    Case(
        "storage-class-without-size",
        set_path("spec.modelCache", {"persistentVolumeClaim": {"claimName": "w", "storageClassName": "fast"}}),
        rule_message("modelCache.persistentVolumeClaim.storageClassName needs"),
        "rule",
    ),
    Case(
        "access-modes-without-size",
        set_path("spec.modelCache", {"persistentVolumeClaim": {"claimName": "w", "accessModes": ["ReadWriteOnce"]}}),
        rule_message("modelCache.persistentVolumeClaim.accessModes needs"),
        "rule",
    ),
    Case(
        "reclaim-delete-without-size",
        set_path("spec.modelCache", {"persistentVolumeClaim": {"claimName": "w", "reclaimPolicy": "Delete"}}),
        rule_message("modelCache.persistentVolumeClaim.reclaimPolicy Delete needs size"),
        "rule",
    ),
    Case(
        "reclaim-policy-unknown",
        set_path("spec.modelCache.persistentVolumeClaim.reclaimPolicy", "Recycle"),
        'supported values: "Retain", "Delete"',
        "field",
    ),
    Case(
        "cache-two-kinds",
        set_path("spec.modelCache", {"persistentVolumeClaim": {"claimName": "w"}, "emptyDir": {"sizeLimit": "1Gi"}}),
        rule_message("modelCache must set exactly one"),
        "rule",
    ),
    Case("cache-no-kind", set_path("spec.modelCache", {}), rule_message("modelCache must set exactly one"), "rule"),
    Case(
        "cache-size-limit",
        set_path("spec.modelCache", {"emptyDir": {"sizeLimit": "lots"}}),
        types.QUANTITY_MESSAGE,
        "field",
    ),
    Case(
        "credentials-on-pvc",
        both(set_path("spec.model.uri", "pvc://weights/m"), set_path("spec.model.credentials", {"secretName": "s"})),
        rule_message("model.credentials applies only"),
        "rule",
    ),
    Case(
        "credentials-secret-name",
        set_path("spec.model.credentials", {"secretName": "Not_A_Name"}),
        "should match",
        "field",
    ),
    Case(
        "ngram-with-draft-model",
        set_path("spec.engine.speculative", {"method": "ngram", "draftModel": "hf://org/tiny"}),
        rule_message("speculative.draftModel is only used"),
        "rule",
    ),
    Case(
        "suffix-with-draft-model",
        set_path("spec.engine.speculative", {"method": "suffix", "draftModel": "hf://org/tiny"}),
        rule_message("speculative.draftModel is only used"),
        "rule",
    ),
    Case(
        "draft-model-uri",
        set_path("spec.engine.speculative", {"method": "draft", "draftModel": "ftp://host/tiny"}),
        rule_message("speculative.draftModel must be"),
        "rule",
    ),
    Case(
        "toleration-seconds-no-execute",
        set_path(
            "spec.pod.tolerations",
            [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 5}],
        ),
        rule_message("tolerationSeconds applies only"),
        "rule",
    ),
    Case(
        "pd-ratio-inverted",
        set_path("spec.autoscaling.prefillDecodeRatio", {"min": 2, "max": 1}),
        rule_message("autoscaling.prefillDecodeRatio.min"),
        "rule",
        base="disaggregated",
    ),
    # Pod overrides (pod_rules.py): what an override may never do, refused at admission with what to fix.
    Case(
        "env-operator-name",
        set_path("spec.pod.env", [{"name": "TIDEPOOL_NODE_RANK", "value": "3"}]),
        rule_message("pod.env must not set a variable the operator sets"),
        "rule",
    ),
    Case(
        "env-value-and-from",
        set_path(
            "spec.pod.env", [{"name": "A", "value": "x", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
        ),
        rule_message("a pod.env entry sets value or valueFrom"),
        "rule",
    ),
    Case(
        "env-two-sources",
        set_path(
            "spec.pod.env",
            [
                {
                    "name": "A",
                    "valueFrom": {
                        "fieldRef": {"fieldPath": "metadata.name"},
                        "secretKeyRef": {"name": "s", "key": "k"},
                    },
                }
            ],
        ),
        rule_message("pod.env valueFrom needs exactly one"),
        "rule",
    ),
    Case(
        "env-from-two-sources",
        set_path("spec.pod.envFrom", [{"secretRef": {"name": "a"}, "configMapRef": {"name": "b"}}]),
        rule_message("pod.envFrom entries need exactly one"),
        "rule",
    ),
    Case(  # a pool declares no volumes of its own (pod.PoolPodOverrides): spec.pod's are the only ones
        "hostpath-volume",
        set_path("spec.pod.volumes", [{"name": "data", "hostPath": {"path": "/data"}}]),
        rule_message("pod.volumes: hostPath volumes are refused"),
        "rule",
    ),
    Case(
        "volume-no-source",
        set_path("spec.pod.volumes", [{"name": "data"}]),
        rule_message("pod.volumes entries need"),
        "rule",
    ),
    # The API server prunes a source its schema does not know: the volume is left without one.
    Case(
        "nfs-volume",
        set_path("spec.pod.volumes", [{"name": "data", "nfs": {"server": "nfs.example.com", "path": "/"}}]),
        rule_message("pod.volumes entries need"),
        "field",
    ),
    Case(
        "volume-operator-name",
        set_path("spec.pod.volumes", [{"name": "model-cache", "emptyDir": {}}]),
        rule_message("pod.volumes must not use a volume name"),
        "rule",
    ),
    Case(
        "mount-relative",
        both(
            set_path("spec.pod.volumes", [{"name": "data", "emptyDir": {}}]),
            set_path("spec.pod.volumeMounts", [{"name": "data", "mountPath": "data"}]),
        ),
        rule_message("pod.volumeMounts mountPath must be an absolute"),
        "rule",
    ),
    Case(
        "mount-under-models",
        both(
            set_path("spec.pod.volumes", [{"name": "data", "emptyDir": {}}]),
            set_path("spec.pod.volumeMounts", [{"name": "data", "mountPath": "/models/extra"}]),
        ),
        rule_message("pod.volumeMounts must not mount at or under"),
        "rule",
    ),
    Case(
        "mount-unknown-volume",
        set_path("spec.pools.unified.pod", {"volumeMounts": [{"name": "nope", "mountPath": "/data"}]}),
        rule_message("every pod.volumeMounts name must be a volume"),
        "rule",
    ),
    Case(
        "duplicate-env",
        set_path("spec.pod.env", [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]),
        rule_message("pod.env names must be unique"),
        "rule",
    ),
    Case(
        "duplicate-volume",
        set_path("spec.pod.volumes", [{"name": "d", "emptyDir": {}}, {"name": "d", "secret": {"secretName": "s"}}]),
        rule_message("pod.volumes names must be unique"),
        "rule",
    ),
    Case(
        "duplicate-pool-mount",
        both(
            set_path("spec.pod.volumes", [{"name": "d", "emptyDir": {}}]),
            set_path(
                "spec.pools.unified.pod",
                {"volumeMounts": [{"name": "d", "mountPath": "/data"}, {"name": "d", "mountPath": "/data"}]},
            ),
        ),
        rule_message("pod.volumeMounts mountPaths must be unique"),
        "rule",
    ),
    Case(
        "resources-gpu",
        set_path("spec.pod.resources", {"limits": {"nvidia.com/gpu": 2}}),
        rule_message("pod.resources must not set spec.accelerator.resourceName"),
        "rule",
    ),
    Case(
        "pool-resources-accelerator",
        both(
            set_path("spec.accelerator", {"resourceName": "amd.com/gpu"}),
            set_path("spec.pools.unified.pod", {"resources": {"limits": {"amd.com/gpu": 4}}}),
        ),
        rule_message("pod.resources must not set spec.accelerator.resourceName"),
        "rule",
    ),
    Case(
        "router-resources-native-domain",
        set_path("spec.router.resources", {"limits": {"example.kubernetes.io/x": 1}}),
        rule_message("pod.resources and router.resources may set only"),
        "rule",
    ),
    Case(
        "resources-not-a-name",
        set_path("spec.pod.resources", {"limits": {"gpu": 1}}),
        rule_message("pod.resources and router.resources may set only"),
        "rule",
    ),
    Case(
        "extended-request-without-limit",
        set_path("spec.pod.resources", {"requests": {"rdma/hca": 1}}),
        rule_message("pod.resources: an extended resource"),
        "rule",
    ),
    Case(
        "extended-request-not-limit",
        set_path("spec.pod.resources", {"requests": {"rdma/hca": 1}, "limits": {"rdma/hca": 2}}),
        rule_message("pod.resources: an extended resource"),
        "rule",
    ),
    Case(
        "accelerator-native-domain",
        set_path("spec.accelerator", {"resourceName": "kubernetes.io/gpu"}),
        rule_message("accelerator.resourceName must be"),
        "rule",
    ),
    Case(
        "accelerator-not-prefixed",
        set_path("spec.accelerator", {"resourceName": "gpu"}),
        "should match",
        "field",
    ),
    Case(
        "claim-not-declared",
        set_path("spec.pod.resources", {"claims": [{"name": "gpus"}]}),
        rule_message("pod.resources.claims must name"),
        "rule",
    ),
    Case(
        "pool-claim-not-declared",
        both(
            set_path("spec.pod.resourceClaims", [{"name": "a", "resourceClaimTemplateName": "t"}]),
            set_path("spec.pools.unified.pod", {"resources": {"claims": [{"name": "b"}]}}),
        ),
        rule_message("pod.resources.claims must name"),
        "rule",
    ),
    Case(
        "resource-claim-two-sources",
        set_path(
            "spec.pod.resourceClaims", [{"name": "a", "resourceClaimName": "c", "resourceClaimTemplateName": "t"}]
        ),
        rule_message("pod.resourceClaims entries need exactly one"),
        "rule",
    ),
    Case(
        "resource-claim-no-source",
        set_path("spec.pod.resourceClaims", [{"name": "a"}]),
        rule_message("pod.resourceClaims entries need exactly one"),
        "rule",
    ),
    Case(
        "resource-claims-unique",
        set_path(
            "spec.pod.resourceClaims",
            [{"name": "a", "resourceClaimName": "c"}, {"name": "a", "resourceClaimTemplateName": "t"}],
        ),
        rule_message("pod.resourceClaims names must be unique"),
        "rule",
    ),
    Case(
        "label-selector-key",
        set_path("spec.pod.labels", {"tidepool.dev/pool": "x"}),
        rule_message("pod.labels must not set a label the operator sets"),
        "rule",
    ),
    Case(
        "label-recommended-key",
        set_path("spec.pools.unified.pod", {"labels": {"app.kubernetes.io/instance": "other"}}),
        rule_message("pod.labels must not set a label the operator sets"),
        "rule",
    ),
    Case(
        "label-key-invalid",
        set_path("spec.pod.labels", {"-bad": "x"}),
        rule_message("pod.labels keys must be label keys"),
        "rule",
    ),
    Case(
        "annotation-operator-prefix",
        set_path("spec.pod.annotations", {"tidepool.dev/paused": "true"}),
        rule_message("pod.annotations must not use the operator's prefix"),
        "rule",
    ),
    Case("scheduler-name-invalid", set_path("spec.pod.schedulerName", "Volcano Scheduler"), "should match", "field"),
    Case(
        "host-network",
        set_path("spec.pod.hostNetwork", True),
        rule_message("pod.hostNetwork, hostPID and hostIPC"),
        "rule",
    ),
    Case("cpu-not-quantity", set_path("spec.resources.cpu", "four"), types.QUANTITY_MESSAGE, "field"),
    Case("surge-not-percent", set_path("spec.rollout.maxSurge", "half"), types.INT_OR_PERCENT_MESSAGE, "field"),
    Case("quantization-enum", set_path("spec.model.quantization", "fp8"), 'supported values: "none", "int8"', "field"),
    Case(
        "gpu-memory-above-one",
        set_path("spec.engine.gpuMemoryUtilization", 1.5),
        "should be less than or equal to 1",
        "field",
    ),
)
NAME_CASE = Case("name-too-long", set_path("metadata.name", "x" * 41), rules.NAME_RULE_MESSAGE, "name")


@pytest.mark.parametrize("case", INVALID_CASES, ids=lambda c: c.id)
def test_models_refuse_what_the_api_server_refuses(case: Case) -> None:
    body = case.body()
    if case.kind == "field":
        with pytest.raises(ValidationError):
            InferenceService.from_body(body)
        return
    spec, _ = InferenceService.from_body(body)
    assert case.message in validate_spec(spec, body["metadata"]["name"])


def test_name_rule() -> None:
    body = NAME_CASE.body()
    spec, _ = InferenceService.from_body(body)
    assert validate_spec(spec, body["metadata"]["name"]) == [rules.NAME_RULE_MESSAGE]
    assert validate_spec(spec, "x" * rules.MAX_NAME_LENGTH) == []


@pytest.mark.parametrize("name", ["unified", "disaggregated"])
def test_samples_are_valid(name: str) -> None:
    body = sample(name)
    spec, status = InferenceService.from_body(body)
    assert validate_spec(spec, body["metadata"]["name"]) == []
    assert status.conditions == []


def test_every_rule_has_a_case() -> None:
    covered = {c.message for c in INVALID_CASES if c.kind == "rule"}
    assert [r.message for r in rules.SPEC_RULES if r.message not in covered] == []


@pytest.mark.parametrize(("name", "edit"), VALID_EDITS, ids=[e[0] for e in VALID_EDITS])
def test_what_kubernetes_accepts_in_a_pod_is_accepted(name: str, edit) -> None:
    """The edge cases Kubernetes accepts stay accepted: no rule above is stricter than the pods need."""
    body = sample("unified")
    edit(body)
    body["metadata"].update(namespace="ns", uid="00000000-0000-0000-0000-000000000001")
    spec, _ = InferenceService.from_body(body)
    assert validate_spec(spec, body["metadata"]["name"]) == []
    assert desired_state("svc", "ns", ServiceView.from_body(body), ClusterFeatures()).children  # builds
