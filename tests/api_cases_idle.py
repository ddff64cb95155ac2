"""`autoscaling.idle` specs and what must be said about them (operator/api/idle_rules.py).

`IDLE_CASES` join tests/operator/test_api_cases.py's INVALID_CASES: the models refuse each one there, and
tests/controlplane/test_cp_crd.py sends each to a real API server, which must refuse it with the message
(so every CEL rule here is proven to compile and agree with its Python twin). `VALID_IDLE_EDITS` are accepted
by both (the unified sample autoscales in active mode with a router).
"""

from __future__ import annotations

from api_case_kit import Case, both, set_path

from tidepool.operator.api import idle_rules

IDLE_CASES: tuple[Case, ...] = (
    Case(
        "idle-sleep-with-scale-to-zero",
        both(
            set_path("spec.autoscaling.idle", "sleep"),
            set_path("spec.autoscaling.scaleToZero", {"enabled": True}),
            set_path("spec.pools.unified.minReplicas", 0),
        ),
        idle_rules.SLEEP_REPLACES_ZERO,
        "rule",
    ),
    Case(
        "idle-sleep-autoscaler-off",
        both(set_path("spec.autoscaling.idle", "sleep"), set_path("spec.autoscaling.enabled", False)),
        idle_rules.SLEEP_NEEDS_AUTOSCALER,
        "rule",
    ),
    Case(
        "idle-sleep-external",
        both(
            set_path("spec.autoscaling.idle", "sleep"),
            set_path("spec.autoscaling.mode", "external"),
            set_path("spec.replicas", 1),
        ),
        idle_rules.SLEEP_NEEDS_AUTOSCALER,
        "rule",
    ),
    Case(
        "idle-sleep-no-router",
        both(set_path("spec.autoscaling.idle", "sleep"), set_path("spec.router", {"enabled": False})),
        idle_rules.SLEEP_NEEDS_ROUTER,
        "rule",
    ),
    Case(
        "idle-unknown",
        set_path("spec.autoscaling.idle", "hibernate"),
        'supported values: "scaleToZero", "sleep"',
        "field",
    ),
)

VALID_IDLE_EDITS = (
    ("idle-sleep", set_path("spec.autoscaling.idle", "sleep")),
    (
        "idle-sleep-advisory-idle-seconds",
        both(
            set_path("spec.autoscaling.idle", "sleep"),
            set_path("spec.autoscaling.mode", "advisory"),
            set_path("spec.autoscaling.scaleToZero", {"idleSeconds": 60}),
        ),
    ),
    (
        "idle-scale-to-zero-explicit",
        both(
            set_path("spec.autoscaling.idle", "scaleToZero"),
            set_path("spec.autoscaling.scaleToZero", {"enabled": True}),
            set_path("spec.pools.unified.minReplicas", 0),
        ),
    ),
)
