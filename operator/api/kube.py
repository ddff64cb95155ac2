"""Kubernetes core shapes that `spec.pod` copies onto pods: env, volumes, mounts (scheduling.py: the rest).

Each model is the Kubernetes type of the same name, with the wire names Kubernetes uses, cut down to
what an override needs and what Pod Security "restricted" allows. Every string, list and map is bounded
(the API server's CEL cost estimator needs it). Shapes only: which values are refused (hostPath, the
operator's own env names, mount paths and volume names) is said by the rules in pod_rules.py, next to their
CEL, so that a refused field is kept in the schema and refused with a message, never pruned silently.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints

from tidepool.operator.api.base import ApiModel
from tidepool.operator.api.quantity import POSITIVE_QUANTITY_RE, QUANTITY_RE
from tidepool.operator.api.types import DnsLabel, DnsSubdomain

# Kubernetes' own string rules, as patterns both pydantic and the API server read (a dot is `[.]`: the patterns
# also serve inside CEL string literals, which take no backslash escapes unless raw).
# A qualified name (label and annotation keys, topology keys): an optional lowercase DNS-subdomain prefix and
# "/", then a name of at most 63 letters, digits, '-', '_' and '.' that starts and ends with a letter or digit.
# (The prefix's own 253-character bound is left to the API server's check of the pods.)
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/"
QUALIFIED_NAME_RE = rf"^({_PREFIX})?{_NAME}$"
OPTIONAL_QUALIFIED_NAME_RE = rf"^(({_PREFIX})?{_NAME})?$"  # a toleration's key may be empty
PREFIXED_NAME_RE = rf"^{_PREFIX}{_NAME}$"  # a qualified name whose prefix is required (extended resources)
QUALIFIED_NAME_MAX = 253 + 1 + 63
LABEL_VALUE_RE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
CONFIG_KEY_RE = r"^[-._a-zA-Z0-9]+$"
# Pod fields the downward API serves: as env (valueFrom.fieldRef; checked by a rule in pod_rules.py, whose CEL
# carries it in a raw string literal) and as files (downwardAPI items; a pattern: a CEL regex there, deep in
# projected volumes, would exceed the API server's cost budget).
_ONE_LABEL = rf"metadata[.](labels|annotations)\['({_PREFIX})?{_NAME}'\]"
ENV_FIELD_RE = (
    rf"^(metadata[.](name|namespace|uid)|{_ONE_LABEL}|spec[.](nodeName|serviceAccountName)"
    r"|status[.](hostIP|hostIPs|podIP|podIPs))$"
)
FILE_FIELD_RE = rf"^(metadata[.](name|namespace|uid|labels|annotations)|{_ONE_LABEL})$"
RESOURCE_FIELD_RE = r"^(limits|requests)[.](cpu|memory|ephemeral-storage|hugepages-.+)$"
# A path inside a volume: relative, no ".." element, not starting with "..".
_FIRST = r"([^/.][^/]*|[.]([^/.][^/]*)?)"
_SEGMENT = r"([^/.][^/]*|[.]([^/.][^/]*)?|[.][.][^/]+)?"
REL_PATH_RE = rf"^{_FIRST}(/{_SEGMENT})*$"

Key = Annotated[str, StringConstraints(min_length=1, max_length=253)]
LabelKey = Annotated[str, StringConstraints(min_length=1, max_length=QUALIFIED_NAME_MAX, pattern=QUALIFIED_NAME_RE)]
LabelValue = Annotated[str, StringConstraints(max_length=63, pattern=LABEL_VALUE_RE)]
ConfigKey = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=CONFIG_KEY_RE)]
RelPath = Annotated[str, StringConstraints(min_length=1, max_length=1024, pattern=REL_PATH_RE)]
EnvName = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")]
FileMode = Annotated[int, Field(ge=0, le=0o777)]
Labels = dict[str, LabelValue]  # keys: see `is_label_key` (a map's keys are checked by a rule, pod_rules.py)
# A quantity as a bounded string checked by pattern: `types.Quantity`'s CEL isQuantity() is too costly for the API
# server's estimator this deep in lists (its values are also plain strings in Kubernetes' own volume sources).
Size = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=QUANTITY_RE.pattern)]
PositiveSize = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=POSITIVE_QUANTITY_RE.pattern)]


def is_label_key(key: str) -> bool:
    """Whether `key` is a Kubernetes qualified name (the rule `QUALIFIED_NAME_RE` states)."""
    return len(key) <= QUALIFIED_NAME_MAX and re.match(QUALIFIED_NAME_RE, key) is not None


def labels_field(description: str) -> Any:
    return Field(default_factory=dict, max_length=32, description=description)


# ---- env ------------------------------------------------------------------------------------------------


class KeySelector(ApiModel):
    """One key of a Secret or ConfigMap in the pod's namespace."""

    name: DnsSubdomain = Field(description="Name of the Secret or ConfigMap.")
    key: ConfigKey = Field(description="The key to read (letters, digits, '-', '_', '.').")
    optional: bool | None = Field(default=None, description="Start the pod even when the key is missing.")


class ObjectFieldSelector(ApiModel):
    """A field of the pod (downward API), e.g. metadata.name or status.podIP."""

    field_path: Annotated[str, StringConstraints(min_length=1, max_length=256)] = Field(description="Field path.")
    api_version: Literal["v1"] | None = Field(default=None, description="v1.")


class FileFieldSelector(ApiModel):
    """A field of the pod as a downward-API file."""

    field_path: Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=FILE_FIELD_RE)] = Field(
        description="metadata.name, metadata.namespace, metadata.uid, metadata.labels, metadata.annotations, "
        "or one label or annotation as metadata.labels['KEY'] or metadata.annotations['KEY']."
    )
    api_version: Literal["v1"] | None = Field(default=None, description="v1.")


class ResourceFieldSelector(ApiModel):
    """A resource request or limit of a container (downward API)."""

    container_name: DnsLabel | None = Field(default=None, description="Container; unset: this one.")
    resource: Annotated[str, StringConstraints(max_length=64, pattern=RESOURCE_FIELD_RE)] = Field(
        description="limits.<resource> or requests.<resource>: cpu, memory, ephemeral-storage or hugepages-<size>."
    )


class EnvVarSource(ApiModel):
    """Where an env value comes from: exactly one source."""

    secret_key_ref: KeySelector | None = Field(default=None, description="A key of a Secret.")
    config_map_key_ref: KeySelector | None = Field(default=None, description="A key of a ConfigMap.")
    field_ref: ObjectFieldSelector | None = Field(default=None, description="A field of the pod.")
    resource_field_ref: ResourceFieldSelector | None = Field(default=None, description="A container resource.")


class EnvVar(ApiModel):
    """One environment variable of the engine container: a literal value or valueFrom."""

    name: EnvName = Field(description="Variable name (not one the operator sets itself).")
    value: Annotated[str, StringConstraints(max_length=32768)] | None = Field(default=None, description="Value.")
    value_from: EnvVarSource | None = Field(default=None, description="Source of the value (instead of value).")


class OptionalRef(ApiModel):
    """A whole Secret or ConfigMap in the pod's namespace."""

    name: DnsSubdomain = Field(description="Name of the Secret or ConfigMap.")
    optional: bool | None = Field(default=None, description="Start the pod even when it is missing.")


class EnvFromSource(ApiModel):
    """Every key of one Secret or ConfigMap as env (explicit env, the operator's included, wins on a clash)."""

    prefix: Annotated[str, StringConstraints(max_length=64, pattern=r"^[ -<>-~]*$")] | None = Field(
        default=None, description="Prepended to every key (printable ASCII, no '=')."
    )
    secret_ref: OptionalRef | None = Field(default=None, description="The Secret.")
    config_map_ref: OptionalRef | None = Field(default=None, description="The ConfigMap.")


class LocalObjectReference(ApiModel):
    """A named object in the pod's namespace (an image pull Secret, a CSI node-publish Secret)."""

    name: DnsSubdomain = Field(description="Object name.")


# ---- volumes --------------------------------------------------------------------------------------------


class KeyToPath(ApiModel):
    """Project one key to a file."""

    key: Key = Field(description="The key.")
    path: RelPath = Field(description="Relative file path.")
    mode: FileMode | None = Field(default=None, description="File mode bits.")


def _items() -> Any:
    return Field(default_factory=list, max_length=64, description="Keys to project; empty: every key.")


class ConfigMapVolume(ApiModel):
    """A ConfigMap as files."""

    name: DnsSubdomain = Field(description="ConfigMap name.")
    items: list[KeyToPath] = _items()
    default_mode: FileMode | None = Field(default=None, description="File mode bits.")
    optional: bool | None = Field(default=None, description="Start the pod even when it is missing.")


class SecretVolume(ApiModel):
    """A Secret as files."""

    secret_name: DnsSubdomain = Field(description="Secret name.")
    items: list[KeyToPath] = _items()
    default_mode: FileMode | None = Field(default=None, description="File mode bits.")
    optional: bool | None = Field(default=None, description="Start the pod even when it is missing.")


class EmptyDirVolume(ApiModel):
    """Scratch space that lives as long as the pod."""

    medium: Literal["", "Memory"] | None = Field(default=None, description="'' (node disk) or Memory (tmpfs).")
    size_limit: Size | None = Field(default=None, description="Most bytes it may hold.")


class PvcVolume(ApiModel):
    """A PersistentVolumeClaim in the pod's namespace."""

    claim_name: DnsSubdomain = Field(description="Claim name.")
    read_only: bool | None = Field(default=None, description="Mount read-only.")


class DownwardAPIFile(ApiModel):
    """One downward-API file: a pod field or a container resource."""

    path: RelPath = Field(description="Relative file path.")
    field_ref: FileFieldSelector | None = Field(default=None, description="A field of the pod.")
    resource_field_ref: ResourceFieldSelector | None = Field(default=None, description="A container resource.")
    mode: FileMode | None = Field(default=None, description="File mode bits.")


class DownwardAPIVolume(ApiModel):
    """Pod fields as files."""

    items: list[DownwardAPIFile] = Field(default_factory=list, max_length=32, description="Files.")
    default_mode: FileMode | None = Field(default=None, description="File mode bits.")


class ServiceAccountTokenProjection(ApiModel):
    """A bound ServiceAccount token (e.g. for workload identity to object storage)."""

    path: RelPath = Field(description="Relative file path.")
    audience: Annotated[str, StringConstraints(max_length=256)] | None = Field(default=None, description="Audience.")
    expiration_seconds: int | None = Field(default=None, ge=600, le=86_400 * 365, description="Token lifetime.")


class ConfigMapProjection(ApiModel):
    """A ConfigMap in a projected volume."""

    name: DnsSubdomain = Field(description="ConfigMap name.")
    items: list[KeyToPath] = _items()
    optional: bool | None = Field(default=None, description="Allow it to be missing.")


class SecretProjection(ApiModel):
    """A Secret in a projected volume."""

    name: DnsSubdomain = Field(description="Secret name.")
    items: list[KeyToPath] = _items()
    optional: bool | None = Field(default=None, description="Allow it to be missing.")


class DownwardAPIProjection(ApiModel):
    """Pod fields in a projected volume."""

    items: list[DownwardAPIFile] = Field(default_factory=list, max_length=32, description="Files.")


class VolumeProjection(ApiModel):
    """One source of a projected volume."""

    config_map: ConfigMapProjection | None = Field(default=None, description="A ConfigMap.")
    secret: SecretProjection | None = Field(default=None, description="A Secret.")
    downward_api: DownwardAPIProjection | None = Field(default=None, alias="downwardAPI", description="Pod fields.")
    service_account_token: ServiceAccountTokenProjection | None = Field(default=None, description="A token.")


class ProjectedVolume(ApiModel):
    """Several sources in one directory."""

    sources: list[VolumeProjection] = Field(default_factory=list, max_length=16, description="The sources.")
    default_mode: FileMode | None = Field(default=None, description="File mode bits.")


class CsiVolume(ApiModel):
    """An inline CSI volume (e.g. the Secrets Store CSI driver)."""

    driver: DnsSubdomain = Field(description="CSI driver name.")
    read_only: bool | None = Field(default=None, description="Mount read-only.")
    fs_type: Annotated[str, StringConstraints(max_length=32)] | None = Field(default=None, description="Filesystem.")
    volume_attributes: dict[str, Annotated[str, StringConstraints(max_length=1024)]] = Field(
        default_factory=dict, max_length=32, description="Driver-specific attributes."
    )
    node_publish_secret_ref: LocalObjectReference | None = Field(default=None, description="Secret for the driver.")


class ClaimMetadata(ApiModel):
    """Labels and annotations of a generic ephemeral volume's claim."""

    labels: Labels = labels_field("Claim labels.")
    annotations: dict[str, Annotated[str, StringConstraints(max_length=4096)]] = Field(
        default_factory=dict, max_length=32, description="Claim annotations."
    )


class StorageRequest(ApiModel):
    """The size of a claim."""

    storage: PositiveSize = Field(description="Requested size, greater than zero (e.g. 100Gi).")


class ClaimResources(ApiModel):
    """Storage requested by a claim."""

    requests: StorageRequest = Field(description="Requests.")


class ClaimSpec(ApiModel):
    """The claim of a generic ephemeral volume."""

    access_modes: list[Literal["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]] = Field(
        min_length=1, max_length=4, description="Access modes (at least one)."
    )
    storage_class_name: DnsSubdomain | None = Field(default=None, description="StorageClass.")
    volume_mode: Literal["Filesystem", "Block"] | None = Field(default=None, description="Filesystem or Block.")
    resources: ClaimResources = Field(description="Requested storage.")


class ClaimTemplate(ApiModel):
    """The claim created with the pod and deleted with it."""

    metadata: ClaimMetadata | None = Field(default=None, description="Claim labels and annotations.")
    spec: ClaimSpec = Field(description="Claim spec.")


class EphemeralVolume(ApiModel):
    """A generic ephemeral volume: a claim per pod, from a StorageClass."""

    volume_claim_template: ClaimTemplate = Field(description="The claim to create.")


class HostPathVolume(ApiModel):
    """A node directory. In the schema only so that it is refused with a message instead of pruned silently."""

    path: Annotated[str, StringConstraints(max_length=4096)] = Field(description="Node path (refused).")
    type: Annotated[str, StringConstraints(max_length=32)] | None = Field(default=None, description="(refused)")


class Volume(ApiModel):
    """An extra pod volume: exactly one of the sources Pod Security "restricted" allows."""

    name: DnsLabel = Field(description="Volume name (not one the operator uses itself).")
    config_map: ConfigMapVolume | None = Field(default=None, description="A ConfigMap.")
    secret: SecretVolume | None = Field(default=None, description="A Secret.")
    empty_dir: EmptyDirVolume | None = Field(default=None, description="Scratch space.")
    persistent_volume_claim: PvcVolume | None = Field(default=None, description="A PersistentVolumeClaim.")
    projected: ProjectedVolume | None = Field(default=None, description="Several sources in one directory.")
    downward_api: DownwardAPIVolume | None = Field(default=None, alias="downwardAPI", description="Pod fields.")
    csi: CsiVolume | None = Field(default=None, description="An inline CSI volume.")
    ephemeral: EphemeralVolume | None = Field(default=None, description="A generic ephemeral volume.")
    host_path: HostPathVolume | None = Field(
        default=None, description="Refused (Pod Security 'restricted'); use a PersistentVolume and a claim."
    )


VOLUME_SOURCES: tuple[str, ...] = tuple(
    n for n in Volume.model_fields if n not in ("name", "host_path")
)  # the allowed sources, snake_case


class VolumeMount(ApiModel):
    """A mount of one of the pod's volumes into the engine container."""

    name: DnsLabel = Field(description="Name of a volume in pod.volumes.")
    mount_path: Annotated[str, StringConstraints(min_length=1, max_length=1024)] = Field(
        description="Absolute path in the container (not at or under a path the operator mounts)."
    )
    sub_path: RelPath | None = Field(default=None, description="Mount this sub-directory of the volume.")
    read_only: bool | None = Field(default=None, description="Mount read-only.")
