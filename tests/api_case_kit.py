"""The pieces of an InferenceService validation case: a valid sample, an edit that breaks it, the message expected.

Shared by tests/operator/test_api_cases.py (the models must refuse each case), tests/api_cases_pod.py (cases
for what Kubernetes refuses in pods) and tests/controlplane/test_cp_crd.py (the API server must refuse each
case itself, with the message).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tidepool.operator.api import rules

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


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


def set_path(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(body: dict[str, Any]) -> None:
        node = body
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    return apply


def both(*steps: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def apply(body: dict[str, Any]) -> None:
        for step in steps:
            step(body)

    return apply


def rule_message(message_prefix: str) -> str:
    matches = [r.message for r in rules.SPEC_RULES if r.message.startswith(message_prefix)]
    assert len(matches) == 1, f"{message_prefix!r} matches {matches}"
    return matches[0]
