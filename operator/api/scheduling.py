"""Kubernetes scheduling shapes that `spec.pod` copies onto the engine pods: affinity and topology spread.

The Kubernetes types of the same names and wire names, every string, list and map bounded (the API
server's CEL cost estimator needs it). Shapes only; the builders pass them through (overrides.py), and a
topology spread constraint without labelSelector selects the pods of its own pool.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from tidepool.operator.api.base import ApiModel
from tidepool.operator.api.kube import Key, Labels, labels_field
from tidepool.operator.api.types import DnsLabel

Values = list[Annotated[str, StringConstraints(max_length=253)]]


class LabelSelectorRequirement(ApiModel):
    """key operator values."""

    key: Key = Field(description="Label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(description="In, NotIn, Exists, DoesNotExist.")
    values: Values = Field(default_factory=list, max_length=32, description="Values (In, NotIn).")


class LabelSelector(ApiModel):
    """A Kubernetes label selector."""

    match_labels: Labels = labels_field("Labels that must match.")
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, max_length=8, description="Expressions that must all match."
    )


class NodeSelectorRequirement(ApiModel):
    """key operator values, on node labels or fields."""

    key: Key = Field(description="Node label (or field) key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"] = Field(description="Operator.")
    values: Values = Field(default_factory=list, max_length=32, description="Values.")


class NodeSelectorTerm(ApiModel):
    """Requirements that must all match."""

    match_expressions: list[NodeSelectorRequirement] = Field(
        default_factory=list, max_length=8, description="On node labels."
    )
    match_fields: list[NodeSelectorRequirement] = Field(
        default_factory=list, max_length=4, description="On node fields."
    )


class NodeSelector(ApiModel):
    """Terms of which one must match."""

    node_selector_terms: list[NodeSelectorTerm] = Field(max_length=8, description="ORed terms.")


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
    topology_key: Key = Field(description="Node label that defines the domain (e.g. kubernetes.io/hostname).")
    match_label_keys: list[Key] = Field(default_factory=list, max_length=8, description="Keys matched by value.")
    mismatch_label_keys: list[Key] = Field(default_factory=list, max_length=8, description="Keys mismatched.")


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
    topology_key: Key = Field(description="Node label that defines the domains (e.g. topology.kubernetes.io/zone).")
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = Field(description="Hard or soft.")
    label_selector: LabelSelector | None = Field(default=None, description="Pods counted; unset: this pool's pods.")
    min_domains: int | None = Field(default=None, ge=1, le=10_000, description="Least eligible domains.")
    node_affinity_policy: Literal["Honor", "Ignore"] | None = Field(default=None, description="Honor or Ignore.")
    node_taints_policy: Literal["Honor", "Ignore"] | None = Field(default=None, description="Honor or Ignore.")
    match_label_keys: list[Key] = Field(default_factory=list, max_length=8, description="Keys matched by value.")
