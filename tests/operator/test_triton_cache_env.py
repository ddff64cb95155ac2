"""Triton's kernel cache on the model cache claim (issue #43): GPU engine pods on a persistentVolumeClaim cache get
TRITON_CACHE_DIR under /models, so a pod scaled from zero reuses the kernels the first pod compiled; CPU pods and
pods on a per-pod emptyDir cache keep Triton's default ($HOME/.triton on /tmp) and their templates unchanged."""

from __future__ import annotations

from typing import Any

import pytest
from test_builders import UNIFIED, build, pod_specs, spec

PVC = {"persistentVolumeClaim": {"claimName": "models", "size": "50Gi"}}


def _env(s: dict[str, Any]) -> list[dict[str, str]]:
    (engine,) = [c for t in pod_specs(build(s)) for c in t["spec"]["containers"] if c["name"] == "engine"]
    return engine["env"]


def test_gpu_pods_on_a_persistent_cache_keep_triton_kernels_on_the_claim() -> None:
    env = {e["name"]: e.get("value") for e in _env(spec(UNIFIED, modelCache=PVC))}
    assert env["TRITON_CACHE_DIR"] == "/models/.triton-cache"
    names = [e["name"] for e in _env(spec(UNIFIED, modelCache=PVC))]
    assert names == sorted(names)  # the operator's env stays sorted by name


@pytest.mark.parametrize(
    "changes",
    [
        {},  # the default per-pod emptyDir cache
        {"modelCache": {"emptyDir": {"sizeLimit": "20Gi"}}},
        {"modelCache": PVC, "resources": {"gpusPerReplica": 0}},  # CPU: no Triton
    ],
)
def test_other_pods_leave_triton_at_its_default(changes: dict[str, Any]) -> None:
    assert "TRITON_CACHE_DIR" not in {e["name"] for e in _env(spec(UNIFIED, **changes))}
