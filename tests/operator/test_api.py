"""Unit tests of the InferenceService pydantic models: wire names, defaults, helpers, status semantics."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from tidepool.operator.api import (
    CONDITION_TYPES,
    EngineSpec,
    InferenceService,
    InferenceServiceSpec,
    InferenceServiceStatus,
    status_patch,
)

MINIMAL = {"model": {"uri": "hf://org/name"}}


def _disaggregated(**extra) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate(
        {
            **MINIMAL,
            "mode": "disaggregated",
            "pools": {
                "prefill": {"replicas": 1, "maxReplicas": 2},
                "decode": {"replicas": 2, "resources": {"memory": "96Gi"}},
            },
            "resources": {"gpusPerReplica": 2, "cpu": 8, "memory": "64Gi", "gpuProduct": "H100"},
            "parallelism": {"tensor": 2},
            **extra,
        }
    )


def test_wire_names_are_exactly_the_issues() -> None:
    wire = InferenceServiceSpec.model_validate(MINIMAL).to_wire()
    assert list(wire) == [
        "model",
        "engine",
        "parallelism",
        "resources",
        "mode",
        "pools",
        "router",
        "autoscaling",
        "rollout",
        "pod",
        "networkPolicy",
    ]
    assert "image" in EngineSpec.model_fields and "image" not in wire["engine"]  # unset: the operator's default
    assert set(wire["engine"]) >= {
        "dtype",
        "maxNumSeqs",
        "blockSize",
        "gpuMemoryUtilization",
        "prefixCaching",
        "chunkedPrefill",
        "extraArgs",
    }
    assert set(wire["autoscaling"]) == {
        "enabled",
        "mode",
        "slo",
        "kvCacheTarget",
        "queueDepthTarget",
        "scaleToZero",
        "idle",
        "stabilization",
        "maxStepPercent",
        "prefillDecodeRatio",
    }
    assert set(wire["autoscaling"]["scaleToZero"]) == {"enabled", "idleSeconds"}
    assert set(wire["autoscaling"]["stabilization"]) == {"upSeconds", "downSeconds"}
    assert wire["autoscaling"]["prefillDecodeRatio"] == {"min": 0.1, "max": 4.0}
    assert set(wire["rollout"]) == {"maxSurge", "maxUnavailable"}
    assert set(wire["pools"]["unified"]) == {"replicas", "minReplicas", "maxReplicas"}
    slo = InferenceServiceSpec.model_validate({**MINIMAL, "autoscaling": {"slo": {"ttftP95Ms": 1, "itlP95Ms": 2}}})
    assert slo.to_wire()["autoscaling"]["slo"] == {"ttftP95Ms": 1, "itlP95Ms": 2}
    spec = _disaggregated(
        engine={"maxModelLen": 64, "maxNumBatchedTokens": 512, "speculative": {"method": "ngram"}},
        pod={"serviceAccountName": "sa", "priorityClassName": "high", "nodeSelector": {"a": "b"}},
        modelCache={"persistentVolumeClaim": {"claimName": "c", "size": "10Gi", "storageClassName": "fast"}},
    )
    wire = spec.to_wire()
    assert wire["engine"]["speculative"] == {"method": "ngram", "numSpeculativeTokens": 4}
    assert set(wire["pod"]) == {
        "nodeSelector",
        "tolerations",
        "labels",
        "annotations",
        "resourceClaims",
        "serviceAccountName",
        "priorityClassName",
        "imagePullSecrets",
        "env",
        "envFrom",
        "volumes",
        "volumeMounts",
        "topologySpreadConstraints",
    }  # lists and maps default to empty; unset scalars and objects are left out
    assert wire["modelCache"] == {
        "persistentVolumeClaim": {
            "claimName": "c",
            "size": "10Gi",
            "storageClassName": "fast",
            "reclaimPolicy": "Retain",  # defaulted: the wire carries it like the API server's defaulting
        }
    }
    assert wire["resources"] == {"gpusPerReplica": 2, "gpuProduct": "H100", "cpu": "8", "memory": "64Gi"}


def test_snake_case_names_are_accepted_too() -> None:
    spec = InferenceServiceSpec.model_validate({**MINIMAL, "engine": {"max_num_seqs": 8}})
    assert spec.engine.max_num_seqs == 8


def test_unknown_and_out_of_bound_fields_are_refused() -> None:
    with pytest.raises(ValidationError, match="extra_forbidden"):
        InferenceServiceSpec.model_validate({**MINIMAL, "engine": {"maxNumSeq": 8}})
    with pytest.raises(ValidationError, match="maxNumSeqs"):
        InferenceServiceSpec.model_validate({**MINIMAL, "engine": {"maxNumSeqs": 0}})
    with pytest.raises(ValidationError, match="policy"):
        InferenceServiceSpec.model_validate({**MINIMAL, "router": {"policy": "random"}})
    with pytest.raises(ValidationError, match="uri"):
        InferenceServiceSpec.model_validate({"model": {}})


def test_pool_helpers_follow_the_scale_contract() -> None:
    unified = InferenceServiceSpec.model_validate(MINIMAL)
    assert unified.pool_names() == ("unified",) and unified.scaled_pool() == "unified"
    assert unified.pool_replicas("unified") == 1
    assert unified.model_copy(update={"replicas": 3}).pool_replicas("unified") == 3
    with pytest.raises(KeyError, match="decode"):
        unified.pool("decode")

    spec = _disaggregated(replicas=3)
    assert spec.pool_names() == ("prefill", "decode") and spec.scaled_pool() == "decode"
    assert spec.pool_replicas("decode") == 3 and spec.pool_replicas("prefill") == 1
    with pytest.raises(KeyError, match="unified"):
        spec.pool("unified")  # the default unified pool is not part of a disaggregated spec
    decode, prefill = spec.pool_resources("decode"), spec.pool_resources("prefill")
    assert (decode.memory, decode.cpu, decode.gpu_product) == ("96Gi", "8", "H100")
    assert prefill == spec.resources


def test_parallelism_helpers() -> None:
    spec = _disaggregated(parallelism={"tensor": 4, "pipeline": 2}, resources={"gpusPerReplica": 8})
    assert spec.pods_per_replica() == 2 and spec.gpus_per_pod() == 4
    cpu = InferenceServiceSpec.model_validate({**MINIMAL, "resources": {"gpusPerReplica": 0}})
    assert cpu.pods_per_replica() == 1 and cpu.gpus_per_pod() == 0


def test_quantities_accept_ints_and_strings_and_refuse_nonsense() -> None:
    spec = InferenceServiceSpec.model_validate({**MINIMAL, "resources": {"cpu": 4, "memory": "1.5Gi"}})
    assert (spec.resources.cpu, spec.resources.memory) == ("4", "1.5Gi")
    for bad in ("4 cores", "-1", "1.5.2Gi", True):
        with pytest.raises(ValidationError, match="Kubernetes quantity"):
            InferenceServiceSpec.model_validate({**MINIMAL, "resources": {"cpu": bad}})


def test_from_body_reads_a_kopf_body_and_ignores_framework_status() -> None:
    body = {
        "apiVersion": "tidepool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "a", "namespace": "b", "generation": 2},
        "spec": MINIMAL,
        "status": {"observedGeneration": 1, "replicas": 1, "kopf": {"progress": {}}},
    }
    spec, status = InferenceService.from_body(body)
    assert spec.model.uri == "hf://org/name" and status.observed_generation == 1 and status.replicas == 1
    assert InferenceService.parse(body).to_wire()["status"] == {
        "observedGeneration": 1,
        "conditions": [],
        "pools": {},
        "replicas": 1,
    }
    assert InferenceService.from_body({"spec": MINIMAL})[1] == InferenceServiceStatus()


def test_set_condition_moves_transition_time_only_on_status_change() -> None:
    status = InferenceServiceStatus()
    assert status.set_condition("Ready", "False", "PodsPending", "0/1 ready", 1, now="2026-01-01T00:00:00Z")
    assert not status.set_condition("Ready", "False", "PodsPending", "0/1 ready", 1, now="2026-01-01T00:05:00Z")
    assert status.set_condition("Ready", "False", "PodsPending", "0/2 ready", 2, now="2026-01-01T00:06:00Z")
    ready = status.condition("Ready")
    assert ready is not None and ready.last_transition_time == "2026-01-01T00:00:00Z" and ready.message == "0/2 ready"
    assert status.set_condition("Ready", "True", "AllReady", "", 2, now="2026-01-01T00:07:00Z")
    assert status.condition("Ready").last_transition_time == "2026-01-01T00:07:00Z"
    status.set_condition("Degraded", "False", "AsExpected", "", 2, now="2026-01-01T00:07:00Z")
    status.set_condition("Progressing", "False", "Done", "", 2, now="2026-01-01T00:07:00Z")
    assert [c.type for c in status.conditions] == ["Ready", "Progressing", "Degraded"]
    with pytest.raises(ValueError, match="unknown condition type"):
        status.set_condition("Happy", "True", "Yes", "")
    assert set(CONDITION_TYPES) == {"Ready", "Progressing", "Degraded", "ScalingLimited", "Reconciling", "Stalled"}
    patch = status_patch(status)
    assert patch["conditions"][0] == {
        "type": "Ready",
        "status": "True",
        "reason": "AllReady",
        "message": "",
        "lastTransitionTime": "2026-01-01T00:07:00Z",
        "observedGeneration": 2,
    }


def test_status_autoscaling_shape() -> None:
    status = InferenceServiceStatus.model_validate(
        {
            "autoscaling": {
                "mode": "advisory",
                "lastScaleTime": "2026-01-01T00:00:00Z",
                "lastDecision": "ttft p95 1200ms > 800ms SLO: decode 2 -> 3",
                "pools": {"decode": {"desiredReplicas": 3, "inputs": {"ttftP95Ms": 1200.0, "queueDepth": 7}}},
            },
            "pools": {"decode": {"replicas": 2, "readyReplicas": 2, "desiredReplicas": 3}},
        }
    )
    assert status.autoscaling.pools["decode"].inputs["queueDepth"] == 7.0
    assert status.to_wire()["pools"]["decode"] == {"replicas": 2, "readyReplicas": 2, "desiredReplicas": 3}


def test_api_package_imports_without_torch() -> None:
    """The operator image has no torch: it reads the engine's tables from tidepool.contract, never the engine."""
    code = (
        "import sys; import tidepool.operator.api, tidepool.operator.crdgen, tidepool.operator.builders; "
        "import tidepool.operator.autoscaler.config, tidepool.operator.main; "
        "bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or "
        "m.startswith('tidepool.engine') or m.startswith('tidepool.router')]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert result.returncode == 0, result.stderr + result.stdout


def test_every_exported_name_exists() -> None:
    import tidepool.operator.api as api

    assert [name for name in api.__all__ if not hasattr(api, name)] == []
