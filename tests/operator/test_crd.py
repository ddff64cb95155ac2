"""The generated CRD: in sync with the models (both copies), structural, CEL-ready, deterministic."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel

from tidepool.operator import crdgen
from tidepool.operator.api import SPEC_RULES, InferenceServiceSpec, PodOverrides, PoolSpec
from tidepool.operator.api.pod import PoolPodOverrides

REPO = Path(__file__).resolve().parents[2]
COPIES = (REPO / "crds" / crdgen.CRD_FILENAME, REPO / "charts" / "tidepool" / "crds" / crdgen.CRD_FILENAME)


def test_crds_are_in_sync_with_the_models(tmp_path: Path) -> None:
    out, chart = tmp_path / "crds", tmp_path / "chart-crds"
    assert crdgen.main(["--out", str(out), "--chart-crds", str(chart)]) == 0
    fresh = (out / crdgen.CRD_FILENAME).read_text()
    assert (chart / crdgen.CRD_FILENAME).read_text() == fresh
    for copy in COPIES:
        assert copy.read_text() == fresh, f"{copy} is stale: run `tidepool crds` from the repository root"
    assert crdgen.render_crd() == fresh  # deterministic


def test_check_mode_reports_stale_files(tmp_path: Path, capsys) -> None:
    assert crdgen.main(["--out", str(tmp_path), "--chart-crds", "", "--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert crdgen.main(["--out", str(tmp_path), "--chart-crds", ""]) == 0
    assert crdgen.main(["--out", str(tmp_path), "--chart-crds", "", "--check"]) == 0
    (tmp_path / crdgen.CRD_FILENAME).write_text("edited by hand")
    assert crdgen.main(["--out", str(tmp_path), "--chart-crds", "", "--check"]) == 1


def _schemas(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _schemas(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _schemas(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _schemas(node["additionalProperties"], f"{path}{{}}")


def _version() -> dict[str, Any]:
    crd = yaml.safe_load(COPIES[0].read_text())
    assert crd["spec"]["group"] == "tidepool.dev" and crd["metadata"]["name"] == "inferenceservices.tidepool.dev"
    (version,) = crd["spec"]["versions"]
    return version


def _kubernetes_fields(model: type[BaseModel], path: str) -> Iterator[str]:
    """Schema paths of our fields that hold a Kubernetes core type (below them, Kubernetes documents the fields)."""
    for name, field in model.model_fields.items():
        here = f"{path}.{field.alias or name}"
        for nested in crdgen._nested_models(field.annotation):
            if crdgen.is_kubernetes_type(nested):
                yield here
            else:
                yield from _kubernetes_fields(nested, here + _container_suffix(field.annotation))


def _container_suffix(annotation: Any) -> str:
    """How `_schemas` names an item of this field: `[]` for a list, `{}` for a map (Optional unwrapped)."""
    options = [a for a in get_args(annotation) if a is not type(None)] if get_origin(annotation) is not None else []
    if get_origin(annotation) not in (list, dict) and len(options) == 1:
        annotation = options[0]
    origin = get_origin(annotation)
    return "[]" if origin is list else "{}" if origin is dict else ""


def _documented_elsewhere(path: str, kubernetes: set[str]) -> bool:
    """Below a Kubernetes type, or in a pool's pod (documented once, at spec.pod, whose shape it shares)."""
    if re.match(r"^\.spec\.pools\.[a-z]+\.pod[.\[{]", path):
        return True
    return any(path.startswith(k) and path[len(k)] in ".[{" for k in kubernetes if len(path) > len(k))


def test_schema_is_structural_and_bounded_for_cel() -> None:
    root = _version()["schema"]["openAPIV3Schema"]
    kubernetes = set(_kubernetes_fields(InferenceServiceSpec, ".spec"))
    assert ".spec.pod.affinity" in kubernetes and ".spec.router.tolerations" in kubernetes
    forbidden = ("$ref", "anyOf", "allOf", "oneOf", "title", "$defs", "const")
    for path, node in _schemas(root):
        assert not set(node) & set(forbidden), f"{path}: {set(node) & set(forbidden)}"
        assert node.get("additionalProperties") is not False, path
        if not path.startswith((".spec", ".status")):
            continue
        # List items and map values are described by their field; Kubernetes' types by Kubernetes.
        if not path.endswith(("[]", "{}")) and not _documented_elsewhere(path, kubernetes):
            assert node.get("description"), f"{path} has no description"
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        if isinstance(node.get("exclusiveMinimum"), (int, float)) and not isinstance(node["exclusiveMinimum"], bool):
            raise AssertionError(f"{path}: numeric exclusiveMinimum is not OpenAPI v3.0")
        # CEL cost estimation needs every string, list and map bounded.
        if node.get("type") == "string" and "enum" not in node:
            assert "maxLength" in node, f"{path}: string without maxLength"
        if node.get("type") == "array":
            assert "maxItems" in node, f"{path}: list without maxItems"
        if node.get("type") == "object" and "additionalProperties" in node:
            assert "maxProperties" in node, f"{path}: map without maxProperties"
    assert "x-kubernetes-preserve-unknown-fields" not in COPIES[0].read_text()


def _occurrences(model: type[BaseModel], cls: type[BaseModel]) -> int:
    """How many places of the schema tree under `model` have the class `cls` or a subclass (each carries its rules)."""
    nested = [m for field in model.model_fields.values() for m in crdgen._nested_models(field.annotation)]
    return issubclass(model, cls) + sum(_occurrences(m, cls) for m in nested)


def test_every_rule_is_in_the_crd_once() -> None:
    text = COPIES[0].read_text()
    crd_rules = [
        v
        for _, node in _schemas(_version()["schema"]["openAPIV3Schema"])
        for v in node.get("x-kubernetes-validations", [])
    ]
    messages = [r["message"] for r in crd_rules]
    for rule in SPEC_RULES:
        # Once per place the class (or a subclass) is used: PoolSpec's once per pool, PoolPodOverrides' in spec.pod
        # (a PodOverrides) and each pool's pod.
        expected = _occurrences(InferenceServiceSpec, rule.where)
        assert expected >= 1 and messages.count(rule.message) == expected, rule.message
    assert _occurrences(InferenceServiceSpec, PoolSpec) == 3 and _occurrences(InferenceServiceSpec, PodOverrides) == 1
    assert _occurrences(InferenceServiceSpec, PoolPodOverrides) == 4
    assert "metadata.name must be at most" in text


def test_defaults_expand_to_what_pydantic_builds() -> None:
    spec = _version()["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["pools"]["default"] == {"unified": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4}}
    assert spec["engine"]["default"]["extraArgs"] == [] and spec["engine"]["default"]["maxNumSeqs"] == 256
    assert spec["autoscaling"]["default"]["scaleToZero"] == {"enabled": False, "idleSeconds": 300}
    assert "default" not in spec["model"] and "default" not in spec["replicas"]
    assert spec["rollout"]["properties"]["maxSurge"]["x-kubernetes-int-or-string"] is True


def test_names_printer_columns_and_subresources() -> None:
    crd = yaml.safe_load(COPIES[0].read_text())
    names = crd["spec"]["names"]
    assert names["shortNames"] == ["tpisvc"] and "isvc" not in names["shortNames"]
    assert names["kind"] == "InferenceService" and names["plural"] == "inferenceservices"
    version = _version()
    assert [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")] == [
        "Mode",
        "Ready",
        "Replicas",
        "URL",
        "Age",
    ]
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    conditions = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map" and conditions["x-kubernetes-list-map-keys"] == ["type"]
