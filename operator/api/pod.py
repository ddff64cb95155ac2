"""`spec.pod`: settings copied onto the engine and router pods (scheduling, identity, annotations).

Shapes only, like spec.py; what the builders may never let an override change (the restricted Pod
Security Standard's fields) is enforced where the override is applied.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from tidepool.operator.api.base import ApiModel
from tidepool.operator.api.types import DnsSubdomain


class Toleration(ApiModel):
    """A Kubernetes pod toleration."""

    key: Annotated[str, StringConstraints(max_length=316)] | None = Field(
        default=None, description="Taint key; unset with operator Exists matches every taint."
    )
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: Annotated[str, StringConstraints(max_length=63)] | None = Field(
        default=None, description="Taint value to match (only with Equal)."
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; unset matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="How long a NoExecute taint is tolerated before eviction."
    )


class PodOverrides(ApiModel):
    """Settings copied onto every engine and router pod."""

    node_selector: dict[str, Annotated[str, StringConstraints(max_length=63)]] = Field(
        default_factory=dict, max_length=32, description="Extra node selector labels."
    )
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32, description="Pod tolerations.")
    annotations: dict[str, Annotated[str, StringConstraints(max_length=4096)]] = Field(
        default_factory=dict, max_length=64, description="Extra pod annotations."
    )
    service_account_name: DnsSubdomain | None = Field(
        default=None, description="ServiceAccount of the engine pods; unset uses the namespace default."
    )
    priority_class_name: DnsSubdomain | None = Field(default=None, description="PriorityClass of the engine pods.")
