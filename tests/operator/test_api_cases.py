"""Invalid InferenceServices and what must be said about them; checked here against the models.

`INVALID_CASES` is shared with tests/controlplane/test_cp_crd.py (loaded by path), which sends
each one to a real API server and asserts its rejection carries `message`. Here, a `rule` case
must be reported by `validate_spec` with that exact message (the CEL and Python mirror agree),
and a `field` case must be refused by pydantic itself (a bound, enum or single-value rule).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from tidepool.operator.api import InferenceService, rules, types, validate_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def sample(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / f"inferenceservice-{name}.yaml").read_text())


@dataclass(frozen=True)
class Case:
    id: str
    mutate: Callable[[dict[str, Any]], None]  # edits a copy of a valid sample body in place
    message: str  # must appear in the API server's rejection
    kind: str  # "rule": a cross-field rule (validate_spec); "field": refused by pydantic
    base: str = "unified"

    def body(self) -> dict[str, Any]:
        body = copy.deepcopy(sample(self.base))
        body["metadata"]["name"] = f"bad-{self.id}"[:40]
        self.mutate(body)
        return body


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(body: dict[str, Any]) -> None:
        node = body
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    return apply


def _both(*steps: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def apply(body: dict[str, Any]) -> None:
        for step in steps:
            step(body)

    return apply


def _rule(message_prefix: str) -> str:
    matches = [r.message for r in rules.SPEC_RULES if r.message.startswith(message_prefix)]
    assert len(matches) == 1, f"{message_prefix!r} matches {matches}"
    return matches[0]


INVALID_CASES: tuple[Case, ...] = (
    Case("unified-with-prefill", _set("spec.pools.prefill", {}), _rule("mode unified needs"), "rule"),
    Case(
        "disagg-without-decode",
        _both(_set("spec.mode", "disaggregated"), _set("spec.pools", {"prefill": {}})),
        _rule("mode disaggregated needs"),
        "rule",
    ),
    Case("min-above-max", _set("spec.pools.unified.minReplicas", 5), _rule("minReplicas must not"), "rule"),
    Case("replicas-above-max", _set("spec.pools.unified.replicas", 9), _rule("replicas must lie between"), "rule"),
    Case(
        "scale-replicas-out-of-bounds",
        _set("spec.replicas", 7),
        _rule("spec.replicas must lie within"),
        "rule",
        base="disaggregated",
    ),
    Case(
        "external-without-replicas",
        _set("spec.autoscaling", {"enabled": False, "mode": "external"}),
        _rule("autoscaling.mode external needs"),
        "rule",
    ),
    Case("tp-vs-gpus", _set("spec.parallelism.tensor", 2), _rule("resources.gpusPerReplica must equal"), "rule"),
    Case("uri-scheme", _set("spec.model.uri", "http://example.com/model"), _rule("model.uri must be"), "rule"),
    Case("file-uri", _set("spec.model.uri", "file:///models/tiny"), _rule("model.uri file://"), "rule"),
    Case("catalogue-unknown", _set("spec.model.uri", "catalogue://no-such-model"), _rule("model.uri must be"), "rule"),
    Case(
        "revision-not-hf",
        _both(_set("spec.model.uri", "pvc://weights/llama"), _set("spec.model.revision", "v1")),
        _rule("model.revision applies only"),
        "rule",
    ),
    Case(
        "draft-without-model",
        _set("spec.engine.speculative", {"method": "draft"}),
        _rule("speculative.method draft needs"),
        "rule",
    ),
    Case(
        "scale-to-zero-min-one",
        _set("spec.autoscaling.scaleToZero", {"enabled": True}),
        _rule("autoscaling.scaleToZero.enabled needs"),
        "rule",
    ),
    Case(
        "disagg-no-router",
        _set("spec.router.replicas", 0),
        _rule("router.replicas must be at least 1"),
        "rule",
        base="disaggregated",
    ),
    Case(
        "batched-below-seqs",
        _set("spec.engine.maxNumBatchedTokens", 64),
        _rule("engine.maxNumBatchedTokens must be at least engine.maxNumSeqs"),
        "rule",
    ),
    Case(
        "no-chunked-prefill-short-budget",
        _both(_set("spec.engine.chunkedPrefill", False), _set("spec.engine.maxNumBatchedTokens", 2048)),
        _rule("without chunkedPrefill"),
        "rule",
    ),
    Case(
        "extra-arg-managed", _set("spec.engine.extraArgs", ["--port=9000"]), _rule("engine.extraArgs must not"), "rule"
    ),
    Case("extra-arg-shape", _set("spec.engine.extraArgs", ["seed=3"]), _rule("engine.extraArgs entries"), "rule"),
    # Flags the builder sets that the hand-written list used to miss: the operator's value must not be overridden.
    Case(
        "extra-arg-role", _set("spec.engine.extraArgs", ["--role=decode"]), _rule("engine.extraArgs must not"), "rule"
    ),
    Case(
        "extra-arg-negated",
        _set("spec.engine.extraArgs", ["--seed=3", "--no-enable-prefix-caching"]),
        _rule("engine.extraArgs must not"),
        "rule",
    ),
    Case(
        "drain-too-long",
        _set("spec.engine.drainTimeoutSeconds", 7200),
        "should be less than or equal to 3600",
        "field",
    ),
    Case(
        "rollout-stuck",
        _set("spec.rollout", {"maxSurge": 0, "maxUnavailable": "0%"}),
        _rule("rollout.maxSurge"),
        "rule",
    ),
    Case(
        "toleration-exists-value",
        _set("spec.pod.tolerations", [{"key": "gpu", "operator": "Exists", "value": "yes"}]),
        _rule("a toleration with operator Exists"),
        "rule",
    ),
    Case(
        "storage-class-without-size",
        _set("spec.modelCache", {"persistentVolumeClaim": {"claimName": "w", "storageClassName": "fast"}}),
        _rule("modelCache.persistentVolumeClaim.storageClassName needs"),
        "rule",
    ),
    Case(
        "access-modes-without-size",
        _set("spec.modelCache", {"persistentVolumeClaim": {"claimName": "w", "accessModes": ["ReadWriteOnce"]}}),
        _rule("modelCache.persistentVolumeClaim.accessModes needs"),
        "rule",
    ),
    Case(
        "cache-two-kinds",
        _set("spec.modelCache", {"persistentVolumeClaim": {"claimName": "w"}, "emptyDir": {"sizeLimit": "1Gi"}}),
        _rule("modelCache must set exactly one"),
        "rule",
    ),
    Case("cache-no-kind", _set("spec.modelCache", {}), _rule("modelCache must set exactly one"), "rule"),
    Case(
        "cache-size-limit",
        _set("spec.modelCache", {"emptyDir": {"sizeLimit": "lots"}}),
        types.QUANTITY_MESSAGE,
        "field",
    ),
    Case(
        "credentials-on-pvc",
        _both(_set("spec.model.uri", "pvc://weights/m"), _set("spec.model.credentials", {"secretName": "s"})),
        _rule("model.credentials applies only"),
        "rule",
    ),
    Case(
        "credentials-secret-name",
        _set("spec.model.credentials", {"secretName": "Not_A_Name"}),
        "should match",
        "field",
    ),
    Case(
        "ngram-with-draft-model",
        _set("spec.engine.speculative", {"method": "ngram", "draftModel": "hf://org/tiny"}),
        _rule("speculative.draftModel is only used"),
        "rule",
    ),
    Case(
        "draft-model-uri",
        _set("spec.engine.speculative", {"method": "draft", "draftModel": "ftp://host/tiny"}),
        _rule("speculative.draftModel must be"),
        "rule",
    ),
    Case(
        "toleration-seconds-no-execute",
        _set(
            "spec.pod.tolerations",
            [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 5}],
        ),
        _rule("tolerationSeconds applies only"),
        "rule",
    ),
    Case(
        "pd-ratio-inverted",
        _set("spec.autoscaling.prefillDecodeRatio", {"min": 2, "max": 1}),
        _rule("autoscaling.prefillDecodeRatio.min"),
        "rule",
        base="disaggregated",
    ),
    # Pod overrides (pod_rules.py): what an override may never do, refused at admission with what to fix.
    Case(
        "env-operator-name",
        _set("spec.pod.env", [{"name": "TIDEPOOL_NODE_RANK", "value": "3"}]),
        _rule("pod.env must not set a variable the operator sets"),
        "rule",
    ),
    Case(
        "env-value-and-from",
        _set("spec.pod.env", [{"name": "A", "value": "x", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]),
        _rule("a pod.env entry sets value or valueFrom"),
        "rule",
    ),
    Case(
        "env-two-sources",
        _set(
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
        _rule("pod.env valueFrom needs exactly one"),
        "rule",
    ),
    Case(
        "env-from-two-sources",
        _set("spec.pod.envFrom", [{"secretRef": {"name": "a"}, "configMapRef": {"name": "b"}}]),
        _rule("pod.envFrom entries need exactly one"),
        "rule",
    ),
    Case(
        "pool-hostpath-volume",
        _set("spec.pools.unified.pod", {"volumes": [{"name": "data", "hostPath": {"path": "/data"}}]}),
        _rule("pod.volumes: hostPath volumes are refused"),
        "rule",
    ),
    Case("volume-no-source", _set("spec.pod.volumes", [{"name": "data"}]), _rule("pod.volumes entries need"), "rule"),
    # The API server prunes a source its schema does not know: the volume is left without one.
    Case(
        "nfs-volume",
        _set("spec.pod.volumes", [{"name": "data", "nfs": {"server": "nfs.example.com", "path": "/"}}]),
        _rule("pod.volumes entries need"),
        "field",
    ),
    Case(
        "volume-operator-name",
        _set("spec.pod.volumes", [{"name": "model-cache", "emptyDir": {}}]),
        _rule("pod.volumes must not use a volume name"),
        "rule",
    ),
    Case(
        "mount-relative",
        _both(
            _set("spec.pod.volumes", [{"name": "data", "emptyDir": {}}]),
            _set("spec.pod.volumeMounts", [{"name": "data", "mountPath": "data"}]),
        ),
        _rule("pod.volumeMounts mountPath must be an absolute"),
        "rule",
    ),
    Case(
        "mount-under-models",
        _both(
            _set("spec.pod.volumes", [{"name": "data", "emptyDir": {}}]),
            _set("spec.pod.volumeMounts", [{"name": "data", "mountPath": "/models/extra"}]),
        ),
        _rule("pod.volumeMounts must not mount at or under"),
        "rule",
    ),
    Case(
        "mount-unknown-volume",
        _set("spec.pools.unified.pod", {"volumeMounts": [{"name": "nope", "mountPath": "/data"}]}),
        _rule("every pod.volumeMounts name must be a volume"),
        "rule",
    ),
    Case(
        "duplicate-env",
        _set("spec.pod.env", [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]),
        _rule("pod.env names must be unique"),
        "rule",
    ),
    Case(
        "duplicate-volume",
        _set("spec.pod.volumes", [{"name": "d", "emptyDir": {}}, {"name": "d", "secret": {"secretName": "s"}}]),
        _rule("pod.volumes names and pod.volumeMounts mountPaths must be unique"),
        "rule",
    ),
    Case(
        "resources-gpu",
        _set("spec.pod.resources", {"limits": {"nvidia.com/gpu": 2}}),
        _rule("pod.resources and router.resources may set only"),
        "rule",
    ),
    Case(
        "router-resources-gpu",
        _set("spec.router.resources", {"requests": {"nvidia.com/gpu": 1}}),
        _rule("pod.resources and router.resources may set only"),
        "rule",
    ),
    Case("host-network", _set("spec.pod.hostNetwork", True), _rule("pod.hostNetwork, hostPID and hostIPC"), "rule"),
    Case("cpu-not-quantity", _set("spec.resources.cpu", "four"), types.QUANTITY_MESSAGE, "field"),
    Case("surge-not-percent", _set("spec.rollout.maxSurge", "half"), types.INT_OR_PERCENT_MESSAGE, "field"),
    Case("quantization-enum", _set("spec.model.quantization", "fp8"), 'supported values: "none", "int8"', "field"),
    Case(
        "gpu-memory-above-one",
        _set("spec.engine.gpuMemoryUtilization", 1.5),
        "should be less than or equal to 1",
        "field",
    ),
)
NAME_CASE = Case("name-too-long", _set("metadata.name", "x" * 41), rules.NAME_RULE_MESSAGE, "name")


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
