"""`spec.networkPolicy`: the NetworkPolicies the operator creates per service (builders/netpol.py), and their rules.

Shapes only, plus two rules (CEL for the API server, the same check in Python, rules.py's way). A peer is a pair
of label selectors in NetworkPolicy's own form, restricted to `matchLabels` (the CRD's size budget is tight):
`namespaceSelector` alone picks whole namespaces, `podSelector` alone pods of the service's namespace, both
together pods of the picked namespaces. `clients` unset: every pod of the service's namespace; `[]`: none.

Invariants: a peer names at least one selector (NetworkPolicy refuses an empty peer); selector keys are label
keys and values label values, so every peer the API server accepts becomes a valid NetworkPolicy peer.
"""

from __future__ import annotations

from pydantic import Field

from tidepool.operator.api import kube as k
from tidepool.operator.api.base import ApiModel
from tidepool.operator.api.kube import LabelValue
from tidepool.operator.api.rule import Rule

MAX_CLIENTS = 32
MAX_MATCH_LABELS = 16


class LabelMatch(ApiModel):
    """A label selector (matchLabels only): an empty one selects everything."""

    match_labels: dict[str, LabelValue] = Field(
        default_factory=dict, max_length=MAX_MATCH_LABELS, description="Labels required."
    )

    def to_selector(self) -> dict[str, dict[str, str]]:
        """NetworkPolicy's form of this selector; `{}` when empty (the API server drops an empty matchLabels, and
        the reconcile compares against what it stores)."""
        return {"matchLabels": dict(sorted(self.match_labels.items()))} if self.match_labels else {}


class NetworkPeer(ApiModel):
    """A NetworkPolicy peer."""

    namespace_selector: LabelMatch | None = Field(default=None, description="Namespaces; unset: the service's.")
    pod_selector: LabelMatch | None = Field(default=None, description="Pods; unset: all.")

    def to_peer(self) -> dict[str, dict[str, dict[str, str]]]:
        """NetworkPolicy's form of this peer."""
        out: dict[str, dict[str, dict[str, str]]] = {}
        if self.namespace_selector is not None:
            out["namespaceSelector"] = self.namespace_selector.to_selector()
        if self.pod_selector is not None:
            out["podSelector"] = self.pod_selector.to_selector()
        return out

    def label_keys(self) -> list[str]:
        """The keys of both selectors (one rule checks them all)."""
        return [key for sel in (self.namespace_selector, self.pod_selector) if sel for key in sel.match_labels]


class NetworkPolicySpec(ApiModel):
    """Ingress NetworkPolicies on the service's pods: engines from their router, ranks and the operator only."""

    enabled: bool = Field(default=True, description="false: no NetworkPolicies.")
    clients: list[NetworkPeer] | None = Field(
        default=None,
        max_length=MAX_CLIENTS,
        description="Who may call the router (or engines, without one); unset: the namespace; []: nobody.",
    )


# The keys of both selectors, as one CEL list (one copy of the label-key pattern in the CRD: its size is budgeted).
_KEYS_CEL = " + ".join(
    f"(has(self.{sel}) ? self.{sel}.matchLabels.map(k, k) : [])" for sel in ("namespaceSelector", "podSelector")
)
NETPOL_RULES: tuple[Rule, ...] = (
    Rule(
        NetworkPeer,
        "has(self.namespaceSelector) || has(self.podSelector)",
        "networkPolicy.clients: a peer needs namespaceSelector or podSelector (podSelector: {} is the whole namespace)",
        lambda p: p.namespace_selector is not None or p.pod_selector is not None,
    ),
    Rule(
        NetworkPeer,
        f"({_KEYS_CEL}).all(k, size(k) <= {k.QUALIFIED_NAME_MAX} && k.matches('{k.QUALIFIED_NAME_RE}'))",
        "networkPolicy.clients: matchLabels keys must be label keys (name or prefix/name)",
        lambda p: all(k.is_label_key(key) for key in p.label_keys()),
    ),
)
