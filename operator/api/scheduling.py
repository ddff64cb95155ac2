"""Kubernetes scheduling shapes that `spec.pod` copies onto the engine pods: affinity, topology spread and DRA
resource claims (`resourceClaims` on the pod, `resources.claims` on the engine container).

The Kubernetes types of the same names and wire names, every string, list and map bounded (the API
server's CEL cost estimator needs it). Shapes only; the builders pass them through (overrides.py), and a
topology spread constraint without labelSelector selects the pods of its own pool.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tidepool.operator.api.base import ApiModel
from tidepool.operator.api.kube import LabelKey, Labels, LabelValue, labels_field
from tidepool.operator.api.types import DnsLabel, DnsSubdomain


class LabelSelectorRequirement(ApiModel):
    """key operator values."""

    key: LabelKey = Field(description="Label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(description="In, NotIn, Exists, DoesNotExist.")
    values: list[LabelValue] = Field(
        default_factory=list, max_length=32, description="Values: at least one with In or NotIn, none otherwise."
    )


class LabelSelector(ApiModel):
    """A Kubernetes label selector."""

    match_labels: Labels = labels_field("Labels that must match.")
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, max_length=8, description="Expressions that must all match."
    )


class NodeSelectorRequirement(ApiModel):
    """key operator values, on node labels."""

    key: LabelKey = Field(description="Node label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"] = Field(description="Operator.")
    values: list[LabelValue] = Field(
        default_factory=list,
        max_length=32,
        description="Values: at least one with In or NotIn, exactly one (an integer) with Gt or Lt, none otherwise.",
    )


class NodeFieldSelectorRequirement(ApiModel):
    """A requirement on a node field: Kubernetes supports only metadata.name, with In or NotIn and one node name."""

    key: Literal["metadata.name"] = Field(description="metadata.name (the only node field selectors support).")
    operator: Literal["In", "NotIn"] = Field(description="In or NotIn.")
    values: list[DnsSubdomain] = Field(min_length=1, max_length=1, description="One node name.")


class NodeSelectorTerm(ApiModel):
    """Requirements that must all match."""

    match_expressions: list[NodeSelectorRequirement] = Field(
        default_factory=list, max_length=8, description="On node labels."
    )
    match_fields: list[NodeFieldSelectorRequirement] = Field(
        default_factory=list, max_length=4, description="On node fields."
    )


class NodeSelector(ApiModel):
    """Terms of which one must match."""

    node_selector_terms: list[NodeSelectorTerm] = Field(min_length=1, max_length=8, description="ORed terms.")


class PreferredSchedulingTerm(ApiModel):
    """A weighted preference for nodes."""

    weight: int = Field(ge=1, le=100, description="1-100.")
    preference: NodeSelectorTerm = Field(description="The nodes preferred.")


class NodeAffinity(ApiModel):
    """Which nodes the pods may and prefer to run on."""

    required_during_scheduling_ignored_during_execution: NodeSelector | None = Field(
        default=None, description="Hard requirement."
    )
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] = Field(
        default_factory=list, max_length=8, description="Soft preferences."
    )


class PodAffinityTerm(ApiModel):
    """Pods (selected by labels) that must or must not share a topology domain with these pods."""

    label_selector: LabelSelector | None = Field(default=None, description="The other pods.")
    namespace_selector: LabelSelector | None = Field(default=None, description="Namespaces of the other pods.")
    namespaces: list[DnsLabel] = Field(default_factory=list, max_length=16, description="Namespaces.")
    topology_key: LabelKey = Field(description="Node label that defines the domain (e.g. kubernetes.io/hostname).")
    match_label_keys: list[LabelKey] = Field(
        default_factory=list, max_length=8, description="Keys matched by value (needs labelSelector)."
    )
    mismatch_label_keys: list[LabelKey] = Field(
        default_factory=list, max_length=8, description="Keys mismatched (needs labelSelector)."
    )


class WeightedPodAffinityTerm(ApiModel):
    """A weighted pod (anti-)affinity preference."""

    weight: int = Field(ge=1, le=100, description="1-100.")
    pod_affinity_term: PodAffinityTerm = Field(description="The term.")


class PodAffinity(ApiModel):
    """Pod affinity or anti-affinity."""

    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] = Field(
        default_factory=list, max_length=8, description="Hard terms."
    )
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] = Field(
        default_factory=list, max_length=8, description="Soft terms."
    )


class Affinity(ApiModel):
    """Kubernetes pod affinity."""

    node_affinity: NodeAffinity | None = Field(default=None, description="Node affinity.")
    pod_affinity: PodAffinity | None = Field(default=None, description="Pod affinity.")
    pod_anti_affinity: PodAffinity | None = Field(default=None, description="Pod anti-affinity.")


class TopologySpreadConstraint(ApiModel):
    """Spread the pods across a topology; labelSelector unset selects the pods of the same pool."""

    max_skew: int = Field(ge=1, le=10_000, description="Largest allowed difference between domains.")
    topology_key: LabelKey = Field(
        description="Node label that defines the domains (e.g. topology.kubernetes.io/zone)."
    )
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = Field(description="Hard or soft.")
    label_selector: LabelSelector | None = Field(default=None, description="Pods counted; unset: this pool's pods.")
    min_domains: int | None = Field(
        default=None, ge=1, le=10_000, description="Least eligible domains (only with DoNotSchedule)."
    )
    node_affinity_policy: Literal["Honor", "Ignore"] | None = Field(default=None, description="Honor or Ignore.")
    node_taints_policy: Literal["Honor", "Ignore"] | None = Field(default=None, description="Honor or Ignore.")
    match_label_keys: list[LabelKey] = Field(default_factory=list, max_length=8, description="Keys matched by value.")


class PodResourceClaim(ApiModel):
    """A DRA claim of the pod (resource.k8s.io): a ResourceClaim by name, or one made per pod from a template."""

    name: DnsLabel = Field(description="Name the containers' resources.claims use.")
    resource_claim_name: DnsSubdomain | None = Field(default=None, description="An existing ResourceClaim.")
    resource_claim_template_name: DnsSubdomain | None = Field(
        default=None, description="A ResourceClaimTemplate: one claim per pod."
    )


class ResourceClaimRef(ApiModel):
    """A container's use of one of the pod's resourceClaims."""

    name: DnsLabel = Field(description="A pod resourceClaims name.")
    request: DnsLabel | None = Field(default=None, description="One request of the claim; unset: all of it.")
