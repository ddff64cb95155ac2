"""The rules of `autoscaling.idle: sleep` (a pool kept asleep instead of scaled to zero), rules.py's way.

Each is a CEL expression for the API server and the same check in Python (`Rule`), with a message that says
what to fix. `idle: sleep` replaces scale-to-zero rather than refining it: the pools keep their replicas and
their engines sleep, so `scaleToZero.enabled` must be false (its `idleSeconds` still sets the quiet period).
Tidepool's autoscaler decides when to sleep and wake, so it must run (active or advisory), and the router
must run: it holds the requests that arrive while the pools sleep, which is what wakes them.

Invariants: with the default `idle: scaleToZero` every rule here holds, so existing specs are unaffected.
"""

from __future__ import annotations

from tidepool.operator.api import spec as s
from tidepool.operator.api.rule import Rule

SLEEP_REPLACES_ZERO = (
    "autoscaling.idle sleep keeps idle pools' replicas (asleep) instead of scaling them to zero: set "
    "autoscaling.scaleToZero.enabled false (scaleToZero.idleSeconds still sets when they sleep)"
)
SLEEP_NEEDS_AUTOSCALER = (
    "autoscaling.idle sleep needs autoscaling.enabled true and mode active or advisory (Tidepool's autoscaler "
    "decides when pools sleep and wake)"
)
SLEEP_NEEDS_ROUTER = (
    "autoscaling.idle sleep needs router.enabled true (the router holds requests while a sleeping pool wakes)"
)

IDLE_RULES: tuple[Rule, ...] = (
    Rule(
        s.AutoscalingSpec,
        "self.idle != 'sleep' || !self.scaleToZero.enabled",
        SLEEP_REPLACES_ZERO,
        lambda a: a.idle != "sleep" or not a.scale_to_zero.enabled,
        ".idle",
    ),
    Rule(
        s.AutoscalingSpec,
        "self.idle != 'sleep' || (self.enabled && self.mode != 'external')",
        SLEEP_NEEDS_AUTOSCALER,
        lambda a: a.idle != "sleep" or (a.enabled and a.mode != "external"),
        ".idle",
    ),
    Rule(
        s.InferenceServiceSpec,
        "self.autoscaling.idle != 'sleep' || self.router.enabled",
        SLEEP_NEEDS_ROUTER,
        lambda x: x.autoscaling.idle != "sleep" or x.router.enabled,
        ".router.enabled",
    ),
)
