"""`spec.model` and `spec.modelCache`: where the weights come from and where pods keep them.

Shapes only, like spec.py (cross-field rules live in rules.py). `Quantization` takes its choices from
the engine's flag table, so the API and `tidepool serve --quantization` cannot drift.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from tidepool.engine.serve_flags import FLAGS
from tidepool.operator.api.base import ApiModel
from tidepool.operator.api.types import DnsSubdomain, Quantity, ShortString

Quantization = Literal[("none", *FLAGS["quantization"].choices)]  # type: ignore[valid-type]


class ModelSource(ApiModel):
    """Where the weights come from and how they are stored."""

    uri: Annotated[str, StringConstraints(min_length=1, max_length=2048)] = Field(
        description=(
            "Model location: hf://org/name (Hugging Face Hub), pvc://claim/path (a folder on a PersistentVolumeClaim "
            "in this namespace; for a folder already on a node, bind a local or hostPath PersistentVolume to a "
            "claim), or s3://bucket/prefix."
        )
    )
    revision: ShortString | None = Field(
        default=None, description="Hugging Face revision (branch, tag or commit) for hf:// URIs; unset means main."
    )
    quantization: Quantization = Field(
        default="none",
        description=(
            "Weight quantization: none; int8/int4 (Tidepool weight-only, quantized at load); gptq/awq "
            "(checkpoint already quantized with that method); gguf (a GGUF model's Q8_0/Q4_0/Q4_1 weights kept "
            "quantized; without it a GGUF model is dequantized)."
        ),
    )


class ModelCache(ApiModel):
    """A PersistentVolumeClaim shared by the replicas to hold downloaded weights."""

    claim_name: DnsSubdomain = Field(description="Name of the PersistentVolumeClaim (in this namespace).")
    size: Quantity | None = Field(
        default=None, description="Set to have the operator create the claim with this size; unset: it must exist."
    )
    storage_class_name: DnsSubdomain | None = Field(
        default=None, description="StorageClass of a claim the operator creates (needs size); unset: default class."
    )
