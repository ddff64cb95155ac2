"""Shared pydantic base for the InferenceService API models.

Invariants: Python attributes are snake_case, the wire names (CRD, YAML, kopf bodies) are the
camelCase aliases; both are accepted on input (`populate_by_name`). Unknown fields are refused
because the API server prunes them anyway: a model that sees one was handed a body that never
went through the CRD (a typo in a test or a sample), and should say so.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class ApiModel(BaseModel):
    """Base of every spec/status model: camelCase aliases, strict about unknown fields."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_assignment=True)

    def to_wire(self) -> dict[str, Any]:
        """The camelCase dict the API server stores (None fields left out, as the CRD prunes them)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")
