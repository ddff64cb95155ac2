"""`spec.inferencePool`: the Gateway API Inference Extension's `InferencePool` an InferenceService owns.

Shapes only, like spec.py. The published v1 schema (inference.networking.k8s.io/v1) requires
`endpointPickerRef`: a gateway hands every request to that Endpoint Picker (EPP, e.g. llm-d's
inference scheduler), which picks one of the pool's pods. Tidepool does not run an EPP, so the pool is
created only when this field names one (and the InferencePool CRD is installed); `enabled: false`
removes the pool while keeping the settings.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tidepool.operator.api.base import ApiModel
from tidepool.operator.api.types import DnsLabel

DEFAULT_EPP_PORT = 9002  # the port of the Inference Extension's reference EPP (gRPC ext-proc)


class EndpointPicker(ApiModel):
    """The Endpoint Picker Service a gateway asks which pod of the pool serves a request."""

    name: DnsLabel = Field(description="Name of the Endpoint Picker's Service, in this namespace.")
    port: int = Field(
        default=DEFAULT_EPP_PORT, ge=1, le=65535, description="The Endpoint Picker Service's port (the Service port)."
    )
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        default="FailClose",
        description="What the gateway does when the Endpoint Picker does not answer: FailOpen routes anyway.",
    )


class InferencePoolSpec(ApiModel):
    """An `InferencePool` (same name as the InferenceService) selecting the serving pods: the unified pool's,
    or the decode pool's when disaggregated; in multi-node pools only the rank-0 pods, which serve HTTP."""

    enabled: bool = Field(default=True, description="Create the InferencePool (when its CRD is installed).")
    endpoint_picker: EndpointPicker = Field(
        description="The Endpoint Picker the pool's endpointPickerRef names (required by the v1 schema)."
    )
