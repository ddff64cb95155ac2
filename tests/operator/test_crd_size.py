"""The generated CRD fits client-side `kubectl apply` (and Argo CD without ServerSideApply=true).

Client-side apply stores the whole object, as JSON, in the annotation
`kubectl.kubernetes.io/last-applied-configuration`; the API server refuses an object whose annotations
total more than 256 KiB (262144 bytes, apimachinery's TotalAnnotationSizeLimitB). kubectl writes that JSON
with Go's encoding/json: compact, UTF-8, and `<`, `>`, `&` escaped as `\\u003c`, `\\u003e`, `\\u0026` (the CEL
rules are full of `&&`), which `go_json_size` reproduces. The bound asserted here, 240 KiB, leaves room for
the fields still to come; the control-plane test test_cp_gitops_health.py applies the file for real.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tidepool.operator import crdgen
from tidepool.operator.api import CATEGORIES

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / crdgen.CRD_FILENAME
ANNOTATION_LIMIT = 262_144  # bytes, key and value of every annotation together
BUDGET = 240 * 1024
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def go_json_size(obj: Any) -> int:
    """Bytes of `obj` as Go's json.Marshal writes it (HTML-safe escaping, UTF-8, no spaces)."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    text = text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
    text = text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    return len(text.encode())


def test_go_json_size_escapes_like_go() -> None:
    assert go_json_size({"rule": "a && b < c"}) == len('{"rule":"a \\u0026\\u0026 b \\u003c c"}')
    assert go_json_size({"k": "é"}) == len('{"k":"é"}'.encode())


def test_the_crd_fits_the_last_applied_annotation_with_room_to_grow() -> None:
    # The committed file (what `kubectl apply -f crds/` sends) and what the models generate now (test_crd.py
    # checks that they are the same bytes; here a stale file must not hide a model that grew).
    size = max(go_json_size(yaml.safe_load(CRD_FILE.read_text())), go_json_size(crdgen.build_crd()))
    annotation = len(LAST_APPLIED) + size + 1  # kubectl's encoder ends the value with a newline
    assert size <= BUDGET, f"the CRD is {size} bytes of JSON, over the {BUDGET}-byte budget"
    assert annotation < ANNOTATION_LIMIT


def test_pools_share_the_pod_shape_without_a_copy_of_the_volume_sources() -> None:
    spec = crdgen.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    pod = spec["properties"]["pod"]
    assert "volumes" in pod["properties"] and "persistentVolumeClaim" in json.dumps(pod["properties"]["volumes"])
    for name, pool in spec["properties"]["pools"]["properties"].items():
        shared = pool["properties"]["pod"]
        assert set(shared["properties"]) == set(pod["properties"]) - {"volumes"}, name
        assert "spec.pod" in shared["description"]  # documented once, there
        # The same rules hold in a pool (every field's validations are spec.pod's).
        for field, schema in shared["properties"].items():
            assert crdgen.strip_descriptions(schema) == crdgen.strip_descriptions(pod["properties"][field]), field


def test_kubernetes_types_leave_their_docs_to_kubernetes_and_ours_keep_them() -> None:
    pod = crdgen.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "pod"
    ]
    affinity = pod["properties"]["affinity"]
    assert affinity["description"]  # our field's own description
    assert "description" not in json.dumps(affinity["properties"])  # Kubernetes' NodeAffinity etc.
    assert all(field.get("description") for field in pod["properties"].values())


def test_delete_all_does_not_reach_inference_services() -> None:
    """`kubectl delete all --all` deletes every kind in the `all` category: never services and their caches."""
    names = crdgen.build_crd()["spec"]["names"]
    assert "all" not in names["categories"] and list(CATEGORIES) == names["categories"] == ["tidepool"]
