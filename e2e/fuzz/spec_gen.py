"""Random InferenceService specs for the fuzzers: edits of the samples guided by the CRD's own schema.

Each spec is a sample (examples/inferenceservice-*.yaml) with one to four of its fields replaced by values
drawn from that field's schema: mostly plausible (an enum member, a string matching the pattern, a number in
bounds), sometimes just outside (a bound +-1, a string one longer than allowed), rarely of the wrong type.
Three modes choose the fields: "" (any field, half of the time outside spec.pod), "pod" (pod overrides and the
router), "leaf" (strings, numbers and booleans only: whole objects are rarely accepted). Deterministic for a
given `random.Random`.
"""

from __future__ import annotations

import copy
import itertools
import random
import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "tidepool.dev_inferenceservices.yaml"
SAMPLES = ("unified", "disaggregated", "pod-overrides")
MODES = ("", "pod", "leaf")
Path_ = tuple[str | int, ...]

STRINGS = [
    "", " ", "a", "abc", "my-model", "A", "a.b", "a/b", "1", "0", "500m", "1Gi", "2", "-1", "x" * 64, "x" * 254,
    "a_b", "ü", "pvc://models/tiny", "hf://org/model", "s3://bucket/key", "oci://reg/img:tag", "https://h/x",
    "nvidia.com/gpu", "NoSchedule", "Exists", "Equal", "In", "kubernetes.io/hostname", "10", "1.5", "1e3", "true",
    "$(VAR)", "a=b", "0.5", "100Mi", "3", "8080", "Always", "a-b-c", "-a", "a-", "FOO", "abc\n", "a b", "::1",
    "metadata.name", "metadata.labels['a']", "spec.nodeName", "../x", "./x", "limits.cpu",
]  # fmt: skip
QUANTITIES: list[Any] = ["1", "0", "-1", "1Gi", "500m", "1.5", "1e3", "abc", "1Ki", "0.0001m", "16Gi", 3, 0, -2, 1.5]
SIMPLE = ("string", "integer", "number", "boolean")


def load_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_FILE.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def load_samples() -> list[dict[str, Any]]:
    return [yaml.safe_load((REPO / "examples" / f"inferenceservice-{n}.yaml").read_text()) for n in SAMPLES]


def paths(node: dict[str, Any], prefix: Path_ = ()) -> list[tuple[Path_, dict[str, Any]]]:
    """Every (path, schema) below `node`; list items appear as index 0."""
    out = [(prefix, node)] if prefix else []
    for key, sub in node.get("properties", {}).items():
        out += paths(sub, (*prefix, key))
    if isinstance(node.get("items"), dict):
        out += paths(node["items"], (*prefix, 0))
    return out


class SpecGen:
    def __init__(self, rng: random.Random, mode: str = "") -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.rng, self.mode = rng, mode
        self.samples = load_samples()
        self.paths = paths(load_schema())

    # ---- values --------------------------------------------------------------------------------
    def string(self, node: dict[str, Any]) -> str:
        if "enum" in node and self.rng.random() < 0.97:
            return self.rng.choice(node["enum"])
        candidates = list(STRINGS)
        low, high = node.get("minLength", 0), node.get("maxLength")
        if high:
            candidates += ["a" * high, "a" * (high + 1)]
        pattern = node.get("pattern")
        if pattern and self.rng.random() < 0.92:
            fitting = [c for c in candidates if re.search(pattern, c) and low <= len(c) <= (high or len(c))]
            if fitting:
                return self.rng.choice(fitting)
        return self.rng.choice(candidates)

    def number(self, node: dict[str, Any], integer: bool) -> int | float:
        low, high = node.get("minimum"), node.get("maximum")
        if low is not None and high is not None and self.rng.random() < 0.75:
            value = self.rng.uniform(low, high)
            return int(value) if integer else round(value, 3)
        candidates: list[int | float] = [0, 1, -1, 2, 3, 8, 16, 100, 2**31, 2**53]
        if not integer:
            candidates += [0.5, 0.0001, 0.99, 1.01, 2.5]
        step = 1 if integer else 0.001
        candidates += [b + d for b in (low, high) if b is not None for d in (-step, 0, step)]
        return self.rng.choice(candidates)

    def value(self, node: dict[str, Any], depth: int = 0) -> Any:
        if node.get("x-kubernetes-int-or-string"):
            return self.rng.choice(QUANTITIES)
        if self.rng.random() < 0.01:
            return self.rng.choice([None, "str", 1, [], {}, True])  # the wrong type
        kind = node.get("type")
        if kind == "string":
            return self.string(node)
        if kind in ("integer", "number"):
            return self.number(node, kind == "integer")
        if kind == "boolean":
            return self.rng.random() < 0.5
        if kind == "array":
            count = self.rng.choice([0, 1, 1, 2, min(node.get("maxItems", 3), 3)])
            return [self.value(node.get("items", {}), depth + 1) for _ in range(count)]
        props, required = node.get("properties", {}), set(node.get("required", []))
        out = {k: self.value(sub, depth + 1) for k, sub in props.items() if k in required or self.rng.random() < 0.35}
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and self.rng.random() < 0.7:
            for key in self.rng.sample(["a", "app", "example.com/k", "K", "a b", "x" * 70, "-x"], 2):
                out[key] = self.value(extra, depth + 1)
        return out

    # ---- specs ---------------------------------------------------------------------------------
    def _candidates(self) -> list[tuple[Path_, dict[str, Any]]]:
        if self.mode == "pod":
            return [p for p in self.paths if "pod" in p[0] or "router" in p[0]]
        if self.mode == "leaf":
            return [p for p in self.paths if p[1].get("type") in SIMPLE or p[1].get("x-kubernetes-int-or-string")]
        if self.rng.random() < 0.5:
            return [p for p in self.paths if p[0][0] != "pod"]
        return self.paths

    def body(self, name: str, namespace: str) -> dict[str, Any]:
        """A sample with 1-4 fields replaced, named `name` in `namespace`."""
        body = copy.deepcopy(self.rng.choice(self.samples))
        body["metadata"] = {"name": name, "namespace": namespace}
        candidates = self._candidates()
        for _ in range(self.rng.choice([1, 1, 2, 3, 4])):
            where, node = self.rng.choice(candidates)
            self.set_field(body["spec"], where, self.value(node))
        return body

    def set_field(self, spec: dict[str, Any], where: Path_, value: Any) -> None:
        node: Any = spec
        for key, following in itertools.pairwise(where):
            if isinstance(key, int):  # a list: edit its first item
                if not isinstance(node, list) or not node:
                    return
                node = node[0]
                continue
            if not isinstance(node, dict):
                return
            if not isinstance(node.get(key), (dict, list)):
                node[key] = [{}] if isinstance(following, int) else {}
            node = node[key]
        leaf = where[-1]
        if isinstance(leaf, int):
            if isinstance(node, list):
                node[:] = [value]
        elif isinstance(node, dict):
            if value is None and self.rng.random() < 0.5:
                node.pop(leaf, None)
            else:
                node[leaf] = value
