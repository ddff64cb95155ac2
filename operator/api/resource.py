"""The whole InferenceService object and helpers to read kopf/API-server bodies.

`InferenceService.from_body(body)` turns the dict kopf hands a handler (or the API returns) into
typed (spec, status); `status_patch(status)` is the inverse for writing status back. Group,
version and names are constants here so the CRD, the chart and the operator agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tidepool.operator.api.spec import InferenceServiceSpec
from tidepool.operator.api.status import InferenceServiceStatus

GROUP = "tidepool.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
# Not `isvc`: KServe's InferenceService owns that short name, and both CRDs may live in one cluster.
SHORT_NAMES = ("tpisvc",)
# Not `all`: `kubectl delete all --all` must not reach services (and, through owner references, their caches).
CATEGORIES = ("tidepool",)
CRD_NAME = f"{PLURAL}.{GROUP}"


class InferenceService(BaseModel):
    """A full InferenceService object (metadata kept as the raw dict the API server returned)."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    api_version: str = Field(default=API_VERSION, alias="apiVersion")
    kind: str = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: InferenceServiceSpec
    status: InferenceServiceStatus = Field(default_factory=InferenceServiceStatus)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> tuple[InferenceServiceSpec, InferenceServiceStatus]:
        """(spec, status) of a kopf body or API object; raises pydantic.ValidationError naming bad fields."""
        spec = InferenceServiceSpec.model_validate(dict(body.get("spec") or {}))
        status = InferenceServiceStatus.model_validate(dict(body.get("status") or {}))
        return spec, status

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> InferenceService:
        """The whole object, typed."""
        return cls.model_validate(dict(body))

    def to_wire(self) -> dict[str, Any]:
        """camelCase dict ready to send to the API server (status left out when empty)."""
        out: dict[str, Any] = {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "metadata": self.metadata,
            "spec": self.spec.to_wire(),
        }
        status = self.status.to_wire()
        if status:
            out["status"] = status
        return out


def status_patch(status: InferenceServiceStatus) -> dict[str, Any]:
    """The `status` body of a status-subresource patch (camelCase, None fields left out)."""
    return status.to_wire()
