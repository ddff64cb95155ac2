"""`spec.pod` and `pools.<name>.pod`: what an admin may change on the engine pods, and the router's share of it.

Shapes only, like spec.py (the Kubernetes types are in kube.py). What an override may never change is
named here once and refused by pod_rules.py (CEL at admission, the same check in Python): the operator's
own env names (`RESERVED_ENV_NAMES`, `RESERVED_ENV_PREFIXES`), volume names (`RESERVED_VOLUME_NAMES`,
`RESERVED_VOLUME_NAME_RE`) and mount paths (`RESERVED_MOUNT_PATHS`, at or under), hostPath volumes and
host namespaces, and pod labels/annotations of the operator's own (`RESERVED_LABEL_PREFIX`,
`RESERVED_LABEL_KEYS`). The Pod Security "restricted" contexts are not fields at all: the builders own them.
Container resources may name any extended resource (amd.com/gpu, rdma/hca) but the accelerator's
(`Accelerator`, spec.accelerator: the resource GPUs are requested as, whose count follows parallelism).

Where each field lands (builders/overrides.py applies them; the router takes only what is listed):
- engine pods: every field; env, envFrom, volumeMounts and resources (claims: DRA, naming pod.resourceClaims) on
  the engine container; labels and annotations on the pod template, never over the operator's own keys.
- router pod: tolerations, priorityClassName, imagePullSecrets from spec.pod, plus router.nodeSelector,
  router.tolerations (after spec.pod's) and router.resources. The router needs no GPU node, so the
  engine's nodeSelector, affinity, topology spread and runtimeClassName do not follow it.
A pool's `pod` (`PoolPodOverrides`: spec.pod's fields but volumes, which the service declares once: a fourth
copy of the volume sources would take the CRD past what client-side apply can store) is merged over spec.pod:
maps merge (the pool's key wins), lists append, except lists of named entries (env, imagePullSecrets,
resourceClaims and resources.claims by name; volumeMounts by mountPath), where the pool's entry replaces the
global one of the same key in place; scalars replace; affinity merges per kind (nodeAffinity, podAffinity,
podAntiAffinity) and resources per resource name.
"""

from __future__ import annotations

import posixpath
import re
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints

from tidepool.contract.wire import CONTROL_KEY_MOUNT_PATH
from tidepool.operator.api.auth import API_KEY_MOUNT_DIR, API_KEY_VOLUME
from tidepool.operator.api.base import ApiModel
from tidepool.operator.api.kube import (
    OPTIONAL_QUALIFIED_NAME_RE,
    PREFIXED_NAME_RE,
    QUALIFIED_NAME_MAX,
    EnvFromSource,
    EnvVar,
    Labels,
    LabelValue,
    LocalObjectReference,
    Volume,
    VolumeMount,
)
from tidepool.operator.api.scheduling import Affinity, PodResourceClaim, ResourceClaimRef, TopologySpreadConstraint
from tidepool.operator.api.types import DnsSubdomain, Quantity

# Env the operator sets on the engine container (HOME, HF_HOME, the StatefulSet ranks' TIDEPOOL_*) or that
# LeaderWorkerSet injects (LWS_*). NVIDIA_VISIBLE_DEVICES would hand the container GPUs the device plugin did
# not allocate to it (the container toolkit reads it).
RESERVED_ENV_NAMES: tuple[str, ...] = ("HOME", "HF_HOME", "NVIDIA_VISIBLE_DEVICES")
RESERVED_ENV_PREFIXES: tuple[str, ...] = ("TIDEPOOL_", "LWS_")
# Volumes of the engine pod (builders/engine.py, sources.py, control_key.py, auth.py): scratch, shared memory,
# model cache, a multi-node pool's control key, spec.auth's API keys; a pvc:// model source's volume is
# "pvc-" + 10 hex digits.
RESERVED_VOLUME_NAMES: tuple[str, ...] = ("tmp", "dshm", "model-cache", "control-key", API_KEY_VOLUME)
RESERVED_VOLUME_NAME_RE = r"^pvc-[0-9a-f]{10}$"
# Paths the operator mounts into the engine container; an override may mount neither at nor under them.
RESERVED_MOUNT_PATHS: tuple[str, ...] = (
    "/tmp", "/dev/shm", "/models", posixpath.dirname(CONTROL_KEY_MOUNT_PATH), API_KEY_MOUNT_DIR,
)  # fmt: skip
# Container resources an override may set: these, hugepages-<size>, and any extended resource (a DNS-subdomain
# prefix, '/', a name: amd.com/gpu, nvidia.com/mig-1g.10gb, rdma/hca) outside kubernetes.io, as Kubernetes allows;
# never spec.accelerator.resourceName, whose count follows spec.parallelism / resources.gpusPerReplica.
RESOURCE_NAMES: tuple[str, ...] = ("cpu", "memory", "ephemeral-storage")
HUGEPAGES_PREFIX = "hugepages-"
EXTENDED_RESOURCE_RE = PREFIXED_NAME_RE
NATIVE_RESOURCE_DOMAIN = "kubernetes.io/"  # Kubernetes refuses extended resources in its own domain
DEFAULT_ACCELERATOR = "nvidia.com/gpu"
# Pod labels and annotations the operator owns: its selector, spec-hash and group labels (tidepool.dev/...) and
# the recommended labels, llm-d's role label it sets on every engine pod (builders/common.py `labels`).
RESERVED_LABEL_PREFIX = "tidepool.dev/"
RESERVED_LABEL_KEYS: tuple[str, ...] = (
    "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by", "llm-d.ai/role",
)  # fmt: skip
# The router container's requests and limits before router.resources replaces entries per resource name.
ROUTER_RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "250m", "memory": "256Mi"},
    "limits": {"memory": "1Gi"},
}
NodeSelectorMap = dict[str, LabelValue]  # keys: label keys (a rule in pod_rules.py)


def reserved_env(name: str) -> bool:
    """Whether an env name is the operator's own (refused in pod.env)."""
    return name in RESERVED_ENV_NAMES or name.startswith(RESERVED_ENV_PREFIXES)


def reserved_volume(name: str) -> bool:
    """Whether a volume name is the operator's own (refused in pod.volumes)."""
    return name in RESERVED_VOLUME_NAMES or re.match(RESERVED_VOLUME_NAME_RE, name) is not None


def reserved_mount(path: str) -> bool:
    """Whether a mount path is at or under one the operator mounts (refused in pod.volumeMounts)."""
    return any(path == p or path.startswith(p + "/") for p in RESERVED_MOUNT_PATHS)


def is_extended_resource(name: str) -> bool:
    """Whether `name` is an extended resource name Kubernetes accepts (prefix/name, not in kubernetes.io)."""
    return (
        len(name) <= QUALIFIED_NAME_MAX
        and re.match(EXTENDED_RESOURCE_RE, name) is not None
        and NATIVE_RESOURCE_DOMAIN not in name
    )


def allowed_resource(name: str) -> bool:
    return name in RESOURCE_NAMES or name.startswith(HUGEPAGES_PREFIX) or is_extended_resource(name)


def reserved_label(key: str) -> bool:
    """Whether a pod label or annotation key is the operator's own (refused in pod.labels / pod.annotations)."""
    return key.startswith(RESERVED_LABEL_PREFIX) or key in RESERVED_LABEL_KEYS


ResourceName = Annotated[
    str, StringConstraints(min_length=1, max_length=QUALIFIED_NAME_MAX, pattern=EXTENDED_RESOURCE_RE)
]


class Accelerator(ApiModel):
    """`spec.accelerator`: the extended resource the engine pods request `gpusPerReplica / pipeline` of."""

    resource_name: ResourceName = Field(
        default=DEFAULT_ACCELERATOR,
        description="Device-plugin resource (e.g. amd.com/gpu, nvidia.com/mig-1g.10gb); the engine pods tolerate "
        "a taint of this key and of <its domain>/gpu.",
    )


class Toleration(ApiModel):
    """A Kubernetes pod toleration."""

    key: Annotated[str, StringConstraints(max_length=QUALIFIED_NAME_MAX, pattern=OPTIONAL_QUALIFIED_NAME_RE)] | None = (
        Field(default=None, description="Taint key (a label key); unset or empty needs operator Exists (every taint).")
    )
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: LabelValue | None = Field(default=None, description="Taint value to match (only with Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; unset matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="How long a NoExecute taint is tolerated before eviction."
    )


ResourceList = dict[str, Quantity]


def _resource_list(description: str) -> Any:
    return Field(default_factory=dict, max_length=8, description=description)


class ContainerResources(ApiModel):
    """Requests and limits of one container, per resource (cpu, memory, ephemeral-storage, hugepages-*, extended)."""

    requests: ResourceList = _resource_list("Requests by resource name; each replaces the operator's value.")
    limits: ResourceList = _resource_list("Limits by resource name; each replaces the operator's value.")


class EngineResources(ContainerResources):
    """The engine container's resources: requests, limits and the DRA claims it uses."""

    claims: list[ResourceClaimRef] = Field(
        default_factory=list, max_length=8, description="Names of pod.resourceClaims the engine container uses."
    )


class PoolPodOverrides(ApiModel):
    """`pools.<name>.pod`: what one pool changes on its engine pods, merged over spec.pod. Every field of
    spec.pod but `volumes`, which the service declares once in spec.pod (a pool's volumeMounts may name them)."""

    node_selector: NodeSelectorMap = Field(
        default_factory=dict, max_length=32, description="Extra node selector labels."
    )
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32, description="Pod tolerations.")
    labels: Labels = Field(
        default_factory=dict,
        max_length=32,
        description="Extra engine pod labels (e.g. kueue.x-k8s.io/queue-name); not the operator's own.",
    )
    annotations: dict[str, Annotated[str, StringConstraints(max_length=4096)]] = Field(
        default_factory=dict, max_length=64, description="Extra pod annotations; tidepool.dev/* are refused."
    )
    scheduler_name: DnsSubdomain | None = Field(default=None, description="Scheduler of the engine pods.")
    resource_claims: list[PodResourceClaim] = Field(
        default_factory=list, max_length=8, description="DRA claims of the engine pods (resource.k8s.io)."
    )
    service_account_name: DnsSubdomain | None = Field(
        default=None, description="ServiceAccount of the engine pods; unset uses the namespace default."
    )
    priority_class_name: DnsSubdomain | None = Field(default=None, description="PriorityClass of the engine pods.")
    runtime_class_name: DnsSubdomain | None = Field(
        default=None, description="RuntimeClass of the engine pods (e.g. nvidia)."
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=16, description="Secrets to pull the engine (and router) images with."
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=64,
        description="Env of the engine container; names the operator sets itself (HOME, HF_HOME, "
        "NVIDIA_VISIBLE_DEVICES, TIDEPOOL_*, LWS_*) are refused.",
    )
    env_from: list[EnvFromSource] = Field(
        default_factory=list, max_length=16, description="Secrets/ConfigMaps whose keys become env of the engine."
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, max_length=16, description="Mounts of pod.volumes into the engine container."
    )
    affinity: Affinity | None = Field(default=None, description="Node and pod (anti-)affinity of the engine pods.")
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(
        default_factory=list, max_length=8, description="How the engine pods spread across nodes or zones."
    )
    resources: EngineResources | None = Field(
        default=None, description="Engine container requests/limits, replacing those from spec.resources per key."
    )
    host_network: bool | None = Field(default=None, description="Refused when true (Pod Security 'restricted').")
    host_pid: bool | None = Field(
        default=None, alias="hostPID", description="Refused when true (Pod Security 'restricted')."
    )
    host_ipc: bool | None = Field(
        default=None, alias="hostIPC", description="Refused when true (Pod Security 'restricted')."
    )


class PodOverrides(PoolPodOverrides):
    """`spec.pod`: settings copied onto the engine pods (and, as listed in the module docstring, the router pod)."""

    volumes: list[Volume] = Field(
        default_factory=list,
        max_length=16,
        description="Extra volumes (configMap, secret, emptyDir, persistentVolumeClaim, projected, downwardAPI, "
        "csi, ephemeral: what Pod Security 'restricted' allows).",
    )
