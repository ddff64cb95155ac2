"""Validation rules of `spec.pod`, `pools.<name>.pod` and `router.resources`: what an override may never do.

Same contract as rules.py (which appends these to SPEC_RULES): each CEL rule has its Python mirror and
one message that says what to fix. Besides what Tidepool forbids, they carry the checks Kubernetes makes of a
pod that a schema cannot state (map keys, operator/values pairs, exactly-one fields), so that the API server
refuses such an InferenceService at admission instead of accepting it and refusing every pod template later.
The names and paths refused come from pod.py, never copied. Refused fields (hostPath, hostNetwork/hostPID/
hostIPC) stay in the schema so that the API server refuses them with these messages instead of pruning them
silently; an unknown volume source (nfs, iscsi, ...) is pruned, which leaves the volume without a source, and
the exactly-one-source rule refuses it.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel

from tidepool.operator.api import kube as k
from tidepool.operator.api import pod as p
from tidepool.operator.api import scheduling as sc
from tidepool.operator.api import spec as s
from tidepool.operator.api.rule import Rule


def _cel_list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{i}'" for i in items) + "]"


def _cel_count(fields: list[str]) -> str:
    return " + ".join(f"(has(self.{f}) ? 1 : 0)" for f in fields)


def _count(obj: BaseModel, fields: list[str]) -> int:
    return sum(getattr(obj, f) is not None for f in fields)


def _wire(model: type[BaseModel], fields: tuple[str, ...]) -> list[str]:
    return [model.model_fields[f].alias or f for f in fields]


_ENV_SOURCES = ("secret_key_ref", "config_map_key_ref", "field_ref", "resource_field_ref")
_ENV_FROM = ("secret_ref", "config_map_ref")
_FILE_SOURCES = ("field_ref", "resource_field_ref")
_ALLOWED = ", ".join(_wire(k.Volume, k.VOLUME_SOURCES))
_RESERVED_ENV = ", ".join((*p.RESERVED_ENV_NAMES, *(f"{x}*" for x in p.RESERVED_ENV_PREFIXES)))


def _cel_resource_keys() -> str:
    """Every key of requests and of limits (one regex in the CRD, not two)."""
    return (
        f"[self.requests, self.limits].all(m, m.all(r, r in {_cel_list(p.RESOURCE_NAMES)} || "
        f"r.startsWith('{p.HUGEPAGES_PREFIX}') || (size(r) <= {k.QUALIFIED_NAME_MAX} && "
        f"r.matches('{p.EXTENDED_RESOURCE_RE}') && !r.contains('{p.NATIVE_RESOURCE_DOMAIN}'))))"
    )


_RESERVED_LABELS = ", ".join((f"{p.RESERVED_LABEL_PREFIX}*", *p.RESERVED_LABEL_KEYS))


def _mounts_ok(x: s.InferenceServiceSpec) -> bool:
    names = {v.name for v in x.pod.volumes}
    pools = [x.pod] + [pool.pod for pool in (x.pools.unified, x.pools.prefill, x.pools.decode) if pool and pool.pod]
    return all(mnt.name in names for pod in pools for mnt in pod.volume_mounts)


def _cel_pool_mounts(pool: str) -> str:
    pod = f"self.pools.{pool}.pod"
    return (
        f"(!has(self.pools.{pool}) || !has({pod}) || "
        f"{pod}.volumeMounts.all(m, self.pod.volumes.exists(v, v.name == m.name)))"
    )


def _unique(items: list[Any], key: str) -> bool:
    values = [getattr(i, key) for i in items]
    return len(values) == len(set(values))


# ---- Kubernetes' own checks of what the pods get, so that the API server refuses the InferenceService
# instead of every pod apply failing later. Map keys have no schema of their own, hence rules.
_LABEL_KEY_HINT = (
    "a name of at most 63 letters, digits, '-', '_' or '.' that starts and ends with a letter or digit, "
    "optionally after a lowercase DNS-subdomain prefix and '/' (e.g. example.com/gpu-type)"
)
_INTEGER_RE = r"^-?[0-9]+$"
_LABEL_FORMS = "metadata.labels['KEY'] or metadata.annotations['KEY']"


def _label_keys(model: type[BaseModel], fields: tuple[str, ...], where: str) -> Rule:
    wire = _wire(model, fields)
    return Rule(
        model,
        " && ".join(
            f"self.{f}.all(k, size(k) <= {k.QUALIFIED_NAME_MAX} && k.matches('{k.QUALIFIED_NAME_RE}'))" for f in wire
        ),
        f"{where} keys must be label keys: {_LABEL_KEY_HINT}",
        lambda o: all(k.is_label_key(key) for f in fields for key in getattr(o, f)),
        f".{wire[0]}" if len(wire) == 1 else None,
    )


def _selector_values_ok(r: sc.LabelSelectorRequirement | sc.NodeSelectorRequirement) -> bool:
    if r.operator in ("In", "NotIn"):
        return len(r.values) > 0
    if r.operator in ("Gt", "Lt"):
        return len(r.values) == 1 and re.match(_INTEGER_RE, r.values[0]) is not None
    return not r.values


POD_RULES: tuple[Rule, ...] = (
    Rule(
        k.EnvVar,
        f"!(self.name in {_cel_list(p.RESERVED_ENV_NAMES)}) && "
        + " && ".join(f"!self.name.startsWith('{x}')" for x in p.RESERVED_ENV_PREFIXES),
        f"pod.env must not set a variable the operator sets itself ({_RESERVED_ENV}); use another name",
        lambda e: not p.reserved_env(e.name),
        ".name",
    ),
    Rule(
        k.EnvVar,
        "!(has(self.value) && has(self.valueFrom))",
        "a pod.env entry sets value or valueFrom, not both",
        lambda e: e.value is None or e.value_from is None,
    ),
    Rule(
        k.EnvVarSource,
        _cel_count(_wire(k.EnvVarSource, _ENV_SOURCES)) + " == 1",
        "pod.env valueFrom needs exactly one of secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef",
        lambda v: _count(v, list(_ENV_SOURCES)) == 1,
    ),
    Rule(
        k.EnvFromSource,
        _cel_count(_wire(k.EnvFromSource, _ENV_FROM)) + " == 1",
        "pod.envFrom entries need exactly one of secretRef, configMapRef",
        lambda v: _count(v, list(_ENV_FROM)) == 1,
    ),
    Rule(
        k.Volume,
        "!has(self.hostPath)",
        "pod.volumes: hostPath volumes are refused (Pod Security 'restricted' forbids them); put the data on a "
        "PersistentVolume and mount its claim with persistentVolumeClaim",
        lambda v: v.host_path is None,
        ".hostPath",
    ),
    Rule(
        k.Volume,
        _cel_count(_wire(k.Volume, k.VOLUME_SOURCES)) + " == 1",
        f"pod.volumes entries need exactly one source of: {_ALLOWED} "
        "(the sources Pod Security 'restricted' allows; others such as hostPath or nfs are refused)",
        lambda v: _count(v, list(k.VOLUME_SOURCES)) == 1,
    ),
    Rule(
        k.Volume,
        f"!(self.name in {_cel_list(p.RESERVED_VOLUME_NAMES)}) && !self.name.matches('{p.RESERVED_VOLUME_NAME_RE}')",
        "pod.volumes must not use a volume name the operator uses itself ("
        + ", ".join(p.RESERVED_VOLUME_NAMES)
        + ", pvc-<10 hex digits>)",
        lambda v: not p.reserved_volume(v.name),
        ".name",
    ),
    Rule(
        k.VolumeMount,
        "self.mountPath.startsWith('/')",
        "pod.volumeMounts mountPath must be an absolute path",
        lambda v: v.mount_path.startswith("/"),
        ".mountPath",
    ),
    Rule(
        k.VolumeMount,
        f"!{_cel_list(p.RESERVED_MOUNT_PATHS)}.exists(p, self.mountPath == p || self.mountPath.startsWith(p + '/'))",
        "pod.volumeMounts must not mount at or under a path the operator mounts ("
        + ", ".join(p.RESERVED_MOUNT_PATHS)
        + ")",
        lambda v: not p.reserved_mount(v.mount_path),
        ".mountPath",
    ),
    Rule(
        p.ContainerResources,
        _cel_resource_keys(),
        "pod.resources and router.resources may set only "
        + ", ".join(p.RESOURCE_NAMES)
        + f", {p.HUGEPAGES_PREFIX}<size> and extended resources (a DNS-subdomain prefix, '/', a name, outside "
        f"{p.NATIVE_RESOURCE_DOMAIN}: e.g. amd.com/gpu, rdma/hca)",
        lambda r: all(p.allowed_resource(n) for n in (*r.requests, *r.limits)),
    ),
    Rule(
        p.PoolPodOverrides,
        "self.resourceClaims.all(c, self.resourceClaims.exists_one(d, d.name == c.name))",
        "pod.resourceClaims names must be unique",
        lambda o: _unique(o.resource_claims, "name"),
        ".resourceClaims",
    ),
    Rule(
        p.PoolPodOverrides,
        f"self.labels.all(k, !k.startsWith('{p.RESERVED_LABEL_PREFIX}') && !(k in {_cel_list(p.RESERVED_LABEL_KEYS)}))",
        f"pod.labels must not set a label the operator sets itself ({_RESERVED_LABELS}): its selectors and "
        "rollout hash depend on them; use another key",
        lambda o: not any(p.reserved_label(key) for key in o.labels),
        ".labels",
    ),
    Rule(
        p.PoolPodOverrides,
        f"self.annotations.all(k, !k.startsWith('{p.RESERVED_LABEL_PREFIX}'))",
        f"pod.annotations must not use the operator's prefix {p.RESERVED_LABEL_PREFIX}",
        lambda o: not any(key.startswith(p.RESERVED_LABEL_PREFIX) for key in o.annotations),
        ".annotations",
    ),
    Rule(
        p.PoolPodOverrides,
        "!(has(self.hostNetwork) && self.hostNetwork) && !(has(self.hostPID) && self.hostPID) && "
        "!(has(self.hostIPC) && self.hostIPC)",
        "pod.hostNetwork, hostPID and hostIPC are refused (Pod Security 'restricted'); engines use the pod network",
        lambda o: not (o.host_network or o.host_pid or o.host_ipc),
    ),
    Rule(
        p.PoolPodOverrides,
        "self.env.all(e, self.env.exists_one(f, f.name == e.name))",
        "pod.env names must be unique",
        lambda o: _unique(o.env, "name"),
        ".env",
    ),
    Rule(  # spec.pod's volumes; the mounts, which a pool has too, below
        p.PodOverrides,
        "self.volumes.all(v, self.volumes.exists_one(w, w.name == v.name))",
        "pod.volumes names must be unique",
        lambda o: _unique(o.volumes, "name"),
        ".volumes",
    ),
    Rule(
        p.PoolPodOverrides,
        "self.volumeMounts.all(v, self.volumeMounts.exists_one(w, w.mountPath == v.mountPath))",
        "pod.volumeMounts mountPaths must be unique",
        lambda o: _unique(o.volume_mounts, "mount_path"),
        ".volumeMounts",
    ),
    Rule(
        s.InferenceServiceSpec,
        "self.pod.volumeMounts.all(m, self.pod.volumes.exists(v, v.name == m.name)) && "
        + " && ".join(_cel_pool_mounts(pool) for pool in s.POOL_NAMES),
        "every pod.volumeMounts name must be a volume of spec.pod.volumes "
        "(a pool's pod declares no volumes of its own: its volumeMounts name spec.pod's)",
        _mounts_ok,
        ".pod",
    ),
    _label_keys(p.PoolPodOverrides, ("node_selector", "annotations"), "pod.nodeSelector and pod.annotations"),
    _label_keys(p.PoolPodOverrides, ("labels",), "pod.labels"),
    _label_keys(s.RouterSpec, ("node_selector",), "router.nodeSelector"),
    _label_keys(sc.LabelSelector, ("match_labels",), "a label selector's matchLabels"),
    _label_keys(k.ClaimMetadata, ("labels", "annotations"), "an ephemeral volume claim's labels and annotations"),
    Rule(
        sc.LabelSelectorRequirement,
        "self.operator in ['In', 'NotIn'] ? size(self.values) > 0 : size(self.values) == 0",
        "a label selector's matchExpressions need values with operator In or NotIn, and none with Exists or "
        "DoesNotExist",
        _selector_values_ok,
        ".values",
    ),
    Rule(
        sc.NodeSelectorRequirement,
        "self.operator in ['In', 'NotIn'] ? size(self.values) > 0 : self.operator in ['Gt', 'Lt'] ? "
        f"size(self.values) == 1 && self.values[0].matches('{_INTEGER_RE}') : size(self.values) == 0",
        "a node selector's matchExpressions need values with operator In or NotIn, exactly one integer value with "
        "Gt or Lt, and none with Exists or DoesNotExist",
        _selector_values_ok,
        ".values",
    ),
    Rule(
        sc.PodAffinityTerm,
        "has(self.labelSelector) || (size(self.matchLabelKeys) == 0 && size(self.mismatchLabelKeys) == 0)",
        "a pod (anti-)affinity term with matchLabelKeys or mismatchLabelKeys needs a labelSelector",
        lambda t: t.label_selector is not None or not (t.match_label_keys or t.mismatch_label_keys),
    ),
    Rule(
        sc.PodAffinityTerm,
        "!self.matchLabelKeys.exists(k, k in self.mismatchLabelKeys)",
        "a pod (anti-)affinity term must not list a key in both matchLabelKeys and mismatchLabelKeys",
        lambda t: not set(t.match_label_keys) & set(t.mismatch_label_keys),
        ".matchLabelKeys",
    ),
    Rule(
        sc.TopologySpreadConstraint,
        "!has(self.minDomains) || self.whenUnsatisfiable == 'DoNotSchedule'",
        "a topology spread constraint's minDomains needs whenUnsatisfiable DoNotSchedule",
        lambda c: c.min_domains is None or c.when_unsatisfiable == "DoNotSchedule",
        ".minDomains",
    ),
    Rule(
        p.PoolPodOverrides,
        "self.topologySpreadConstraints.all(c, self.topologySpreadConstraints.exists_one(d, "
        "d.topologyKey == c.topologyKey && d.whenUnsatisfiable == c.whenUnsatisfiable))",
        "pod.topologySpreadConstraints must not repeat a topologyKey with the same whenUnsatisfiable",
        lambda o: (
            len({(c.topology_key, c.when_unsatisfiable) for c in o.topology_spread_constraints})
            == len(o.topology_spread_constraints)
        ),
        ".topologySpreadConstraints",
    ),
    Rule(
        k.EnvVarSource,
        f'!has(self.fieldRef) || self.fieldRef.fieldPath.matches(r"{k.ENV_FIELD_RE}")',
        "pod.env valueFrom.fieldRef.fieldPath must be metadata.name, metadata.namespace, metadata.uid, "
        f"{_LABEL_FORMS}, spec.nodeName, spec.serviceAccountName, status.hostIP(s) or status.podIP(s)",
        lambda v: v.field_ref is None or re.match(k.ENV_FIELD_RE, v.field_ref.field_path) is not None,
        ".fieldRef.fieldPath",
    ),
    Rule(
        k.DownwardAPIFile,
        _cel_count(_wire(k.DownwardAPIFile, _FILE_SOURCES)) + " == 1",
        "a downwardAPI item needs exactly one of fieldRef or resourceFieldRef",
        lambda f: _count(f, list(_FILE_SOURCES)) == 1,
    ),
    Rule(
        k.DownwardAPIFile,
        "!has(self.resourceFieldRef) || has(self.resourceFieldRef.containerName)",
        "a downwardAPI item's resourceFieldRef needs containerName (the engine's container is named engine)",
        lambda f: f.resource_field_ref is None or f.resource_field_ref.container_name is not None,
        ".resourceFieldRef",
    ),
)
