"""Invalid `spec.lora` sections and what must be said about them (operator/api/lora_rules.py).

`LORA_CASES` join tests/operator/test_api_cases.py's INVALID_CASES: the models refuse each one there, and
tests/controlplane/test_cp_crd.py sends each to a real API server, which must refuse it with the message
(so every CEL rule here is proven to compile, fit the cost budget and agree with its Python twin).
`VALID_LORA` is a spec.lora the models and the API server accept.
"""

from __future__ import annotations

from typing import Any

from api_case_kit import Case, both, rule_message, set_path

from tidepool.operator.api import lora_rules

VALID_LORA: dict[str, Any] = {
    "adapters": [
        {"name": "sql", "source": "hf://org/sql-lora", "revision": "v2"},
        {"name": "org/chat", "source": "hf://org/chat-lora"},
    ],
    "maxAdapters": 2,
    "maxRank": 32,
    "maxCpuAdapters": 4,
}


def _lora(**changes: Any) -> dict[str, Any]:
    return {**VALID_LORA, **changes}


LORA_CASES: tuple[Case, ...] = (
    Case(
        "lora-duplicate-names",
        set_path(
            "spec.lora", _lora(adapters=[{"name": "a", "source": "hf://o/a"}, {"name": "a", "source": "hf://o/b"}])
        ),
        rule_message("spec.lora.adapters[].name must be unique"),
        "rule",
    ),
    Case(
        "lora-cpu-below-slots",
        set_path("spec.lora", _lora(maxAdapters=4, maxCpuAdapters=2)),
        rule_message("spec.lora.maxCpuAdapters must be at least"),
        "rule",
    ),
    Case(
        "lora-gs-scheme",
        set_path("spec.lora", _lora(adapters=[{"name": "a", "source": "gs://bucket/adapters/a"}])),
        rule_message("spec.lora.adapters[].source must be"),
        "rule",
    ),
    Case(
        "lora-revision-not-hf",
        set_path("spec.lora", _lora(adapters=[{"name": "a", "source": "s3://bucket/a", "revision": "main"}])),
        rule_message("spec.lora.adapters[].revision applies only"),
        "rule",
    ),
    Case(
        "lora-pvc-not-mounted",
        set_path("spec.lora", _lora(adapters=[{"name": "a", "source": "pvc://other-claim/a"}])),
        lora_rules.PVC_CLAIM_MESSAGE,
        "rule",
    ),
    Case(
        "lora-pvc-other-than-model-claim",
        both(
            set_path("spec.model.uri", "pvc://weights/base"),
            set_path("spec.lora", _lora(adapters=[{"name": "a", "source": "pvc://weight/a"}])),
        ),
        lora_rules.PVC_CLAIM_MESSAGE,
        "rule",
    ),
    Case(
        "lora-named-like-the-service",
        set_path("spec.lora", _lora(adapters=[{"name": "bad-lora-named-like-the-service", "source": "hf://o/a"}])),
        lora_rules.ROOT_RULE_MESSAGE,
        "rule",
    ),
    Case(
        "lora-modules-in-extra-args",
        both(
            set_path("spec.lora", VALID_LORA),
            set_path("spec.engine.extraArgs", ["--lora-modules=extra=/models/extra"]),
        ),
        rule_message("spec.lora takes no --lora-modules"),
        "rule",
    ),
    Case(
        "lora-name-with-comma",
        set_path("spec.lora", _lora(adapters=[{"name": "a,b", "source": "hf://o/a"}])),
        "should match",
        "field",
    ),
    Case(
        "lora-zero-slots", set_path("spec.lora", _lora(maxAdapters=0)), "should be greater than or equal to 1", "field"
    ),
    Case(
        "lora-rank-too-big", set_path("spec.lora", _lora(maxRank=2048)), "should be less than or equal to 1024", "field"
    ),
)

# Accepted: hf:// and s3:// adapters; adapters on the model's own claim and on the model-cache claim (both mounted
# by every pod).
VALID_LORA_EDITS = (
    ("lora-hf", set_path("spec.lora", VALID_LORA)),
    ("lora-s3", set_path("spec.lora", _lora(adapters=[{"name": "a", "source": "s3://my-bucket/adapters/a v1"}]))),
    (
        "lora-pvc-on-model-claim",
        both(
            set_path("spec.model.uri", "pvc://weights/base"),
            set_path("spec.lora", _lora(adapters=[{"name": "a", "source": "pvc://weights/adapters/a"}])),
        ),
    ),
    (
        "lora-pvc-on-cache-claim",
        both(
            set_path("spec.modelCache", {"persistentVolumeClaim": {"claimName": "cache"}}),
            set_path("spec.lora", _lora(adapters=[{"name": "a", "source": "pvc://cache/adapters/a"}])),
        ),
    ),
)
