"""`spec.lora` and `status.lora`: LoRA adapters served on the base model, declared in the InferenceService.

Shapes only (cross-field rules live in lora_rules.py, beside their CEL). The engine-side numbers take
their defaults and bounds from the engine's flag table (`--max-loras`, `--max-lora-rank`,
`--max-cpu-loras`), so the API and `tidepool serve` cannot drift.

Invariants: the pod template depends on `spec.lora`'s settings (maxAdapters, maxRank,
maxCpuAdapters, credentials) but never on the adapter list, so adding or removing an adapter never
rolls the engine pods (builders/lora.py); credentials are a Secret *reference*, never a value
(the same shape as spec.model.credentials).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints

from tidepool.contract.serve_flags import FLAGS
from tidepool.operator.api.base import ApiModel
from tidepool.operator.api.model import ModelCredentials
from tidepool.operator.api.types import ShortString

# What clients send as `model` (and what the engine's metrics join with commas): no commas, no spaces.
ADAPTER_NAME_RE = r"^[A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?$"
MAX_ADAPTERS_LISTED = 64  # declared adapters per InferenceService (the CEL uniqueness check is quadratic)
AdapterName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=ADAPTER_NAME_RE)]


def _flag_bounds(name: str) -> dict[str, int]:
    """The numeric bounds of a serve flag, for the integer field that passes it through."""
    return {k: int(v) for k, v in FLAGS[name].bounds.items()}


class LoraAdapter(ApiModel):
    """One adapter: a PEFT folder (adapter_config.json + adapter_model.safetensors) served under `name`."""

    name: AdapterName = Field(
        description=(
            "The model id clients send (`model` in a request) to use this adapter; unique within spec.lora.adapters "
            "and different from the InferenceService's name (the base model's id). Letters, digits, '.', '_', '-', '/'."
        )
    )
    source: Annotated[str, StringConstraints(min_length=1, max_length=2048)] = Field(
        description=(
            "Where the adapter's files are: hf://org/name (Hugging Face Hub) or s3://bucket/prefix (the objects "
            "prefix/adapter_config.json and prefix/adapter_model.safetensors), each fetched by every engine pod into "
            "its model cache with spec.lora.credentials; or pvc://claim/path on a claim the engine pods already "
            "mount (spec.model's pvc:// claim or spec.modelCache's claim)."
        )
    )
    revision: ShortString | None = Field(
        default=None, description="Hugging Face revision (branch, tag or commit) for hf:// sources; unset means main."
    )


class LoraSpec(ApiModel):
    """LoRA adapters on the base model: loaded and unloaded on every ready replica without restarting it."""

    adapters: list[LoraAdapter] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS_LISTED,
        description=(
            "The adapters every engine replica serves. Editing this list loads/unloads adapters on the running "
            "replicas (no pod restarts); status.lora reports each adapter per pool."
        ),
    )
    max_adapters: int = Field(
        default=FLAGS["max-loras"].default,
        **_flag_bounds("max-loras"),
        description="Adapters resident on the accelerator at once (`--max-loras`): the adapters one step can mix.",
    )
    max_rank: int = Field(
        default=FLAGS["max-lora-rank"].default,
        **_flag_bounds("max-lora-rank"),
        description="Largest adapter rank a replica accepts (`--max-lora-rank`); a higher-rank adapter fails to load.",
    )
    max_cpu_adapters: int | None = Field(
        default=FLAGS["max-cpu-loras"].default,
        **_flag_bounds("max-cpu-loras"),
        description=(
            "Adapters a replica keeps in host memory (`--max-cpu-loras`, LRU); unset: maxAdapters. Declared adapters "
            "beyond it stay loaded but are re-read from the model cache when a request needs them."
        ),
    )
    credentials: ModelCredentials | None = Field(
        default=None,
        description=(
            "Secret the engine pods read when they fetch hf:// and s3:// adapters (HF_TOKEN, HF_ENDPOINT, "
            "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL, as for "
            "spec.model.credentials; no AWS keys: unsigned requests). One Secret for every adapter: a running pod "
            "cannot gain a Secret, so a per-adapter Secret would restart pods. Changing it rolls the pools once; "
            "unset: anonymous downloads."
        ),
    )
