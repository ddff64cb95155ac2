"""`spec.router`: the data-plane router in front of the pools, and the one rule on its own fields.

Shapes plus the rule that belongs to them (a CEL expression plus its Python twin, rules.py's way). How many
routers run is derived from the whole spec (`InferenceServiceSpec.router_replicas()`: 0 when `enabled` is
false, `replicas` when set, else 2 where any pool can exceed one replica and 1 otherwise); the rule needing the
whole spec (a router is required in disaggregated mode and with scale-to-zero) lives in rules.py.

Invariants: `enabled: false` is the one way to run without a router (`replicas: 0`, which once meant it, is
refused with a message saying so); unset `replicas` means automatic, never 0.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tidepool.operator.api.base import ApiModel
from tidepool.operator.api.pod import ContainerResources, NodeSelectorMap, Toleration
from tidepool.operator.api.rule import Rule
from tidepool.operator.api.types import ReplicaCount

RouterPolicy = Literal["prefix-aware", "least-load", "round-robin"]
ROUTER_REPLICAS_MESSAGE = (
    "router.replicas must be at least 1 (unset: automatic); to run without a router set router.enabled: false"
)


class RouterSpec(ApiModel):
    """The data-plane router in front of the pools."""

    enabled: bool = Field(
        default=True,
        description=(
            "Run the router. false (unified mode without scaleToZero only): no router objects; status.url is the "
            "pool's Service, which selects the serving pods directly (route with an InferencePool/gateway)."
        ),
    )
    replicas: ReplicaCount | None = Field(
        default=None,
        description=(
            "Router replicas (at least 1; none: enabled false). Unset: 2 where a pool can exceed 1 replica "
            "(replicas, or maxReplicas under an autoscaler, above 1; disaggregated), else 1. Spread over nodes; "
            "from 2 a PodDisruptionBudget keeps one up."
        ),
    )
    policy: RouterPolicy = Field(default="prefix-aware", description="How the router picks an engine replica.")
    node_selector: NodeSelectorMap = Field(
        default_factory=dict, max_length=32, description="Node selector of the router pods (spec.pod's is not used)."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Router tolerations, after spec.pod.tolerations."
    )
    resources: ContainerResources | None = Field(
        default=None, description="Router container requests/limits, replacing the defaults per key."
    )


ROUTER_RULES: tuple[Rule, ...] = (
    Rule(
        RouterSpec,
        "!has(self.replicas) || self.replicas >= 1",
        ROUTER_REPLICAS_MESSAGE,
        lambda r: r.replicas is None or r.replicas >= 1,
        ".replicas",
    ),
)
