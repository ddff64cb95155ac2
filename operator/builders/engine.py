"""Engine pool workloads: the `tidepool serve` container, its pod template, and the workload kind.

One replica fits on a node (tensor × pipeline GPUs ≤ GPUs per node) -> a Deployment.
One replica spans N nodes -> a LeaderWorkerSet of group size N when the LWS CRD exists, else one
StatefulSet of N pods per replica ("group"), ranks from the pod-index label, all behind one headless
Service so ranks find rank 0 (`--master-addr`).

Invariants: pure; args are emitted as sorted flag/value pairs (user `extraArgs` last, in their order);
env sorted by name; the pod template carries `tidepool.dev/spec-hash`, a digest of the template itself,
so any change to what the pods run changes the hash and rolls the pool.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from .common import (
    ENGINE_PORT,
    KV_PORT,
    LABEL_GROUP_INDEX,
    LABEL_SPEC_HASH,
    MASTER_PORT,
    POD_INDEX_LABEL,
    ClusterFeatures,
    child_name,
    container_security_context,
    flags_to_args,
    labels,
    metadata,
    pod_security_context,
    selector_labels,
    sorted_env,
    spec_hash,
)
from .sources import CACHE_VOLUME, MODELS_DIR, is_model_uri, model_source
from .spec_view import PoolView, ServiceView, SpecError

LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
PRESTOP_SLEEP_S = 5
PROBE_PERIOD_S = 10
CONFIG_DIR = "/etc/tidepool"


@dataclass(frozen=True, slots=True)
class Topology:
    """How one replica of a pool maps onto nodes."""

    gpus_per_replica: int
    nnodes: int  # pods per replica
    gpus_per_pod: int
    workload: str  # "Deployment" | "LeaderWorkerSet" | "StatefulSet"


def topology(view: ServiceView, pool: PoolView, features: ClusterFeatures) -> Topology:
    """A replica is one pod per pipeline stage with `tensor` GPUs each (the API's contract)."""
    if view.gpus_per_replica == 0:  # CPU replicas (tests, demos): never multi-node
        if view.pipeline > 1 or view.tensor > 1:
            raise SpecError("spec.resources.gpusPerReplica 0 (CPU) needs parallelism.tensor = pipeline = 1")
        return Topology(0, 1, 0, "Deployment")
    if view.tensor > features.gpus_per_node:
        raise SpecError(
            f"parallelism.tensor {view.tensor} needs more GPUs than one node has ({features.gpus_per_node}); "
            "tensor parallelism stays within a node: lower tensor and raise pipeline"
        )
    nnodes = view.pipeline
    if nnodes == 1:
        return Topology(view.tensor, 1, view.tensor, "Deployment")
    workload = "LeaderWorkerSet" if features.has_lws else "StatefulSet"
    return Topology(view.tensor * nnodes, nnodes, view.tensor, workload)


def startup_budget_s(view: ServiceView, topo: Topology) -> int:
    """Time allowed for the engine to load: 10 min plus 10 min per GPU of the replica (≥ 30 min from 2 GPUs)."""
    return min(600 * (1 + max(topo.gpus_per_replica, 0)), 4 * 3600)


def engine_flags(
    view: ServiceView, pool: PoolView, topo: Topology, model_path: str, draft_path: str | None, served_name: str
) -> dict[str, Any]:
    """`tidepool serve` flags; the model is served under the InferenceService's name (what clients send)."""
    flags: dict[str, Any] = {
        "--model": model_path,
        "--served-model-name": served_name,
        "--host": "0.0.0.0",
        "--port": ENGINE_PORT,
        "--dtype": view.dtype,
        "--max-model-len": view.max_model_len,
        "--max-num-seqs": view.max_num_seqs,
        "--max-num-batched-tokens": view.max_num_batched_tokens,
        "--block-size": view.block_size,
        "--gpu-memory-utilization": view.gpu_memory_utilization,
        "--drain-timeout": view.drain_timeout_s,
        "--enable-prefix-caching" if view.prefix_caching else "--no-enable-prefix-caching": True,
        "--enable-chunked-prefill" if view.chunked_prefill else "--no-enable-chunked-prefill": True,
        "--quantization": view.quantization,
    }
    if view.tensor > 1:
        flags["--tensor-parallel-size"] = view.tensor
    if view.pipeline > 1:
        flags["--pipeline-parallel-size"] = view.pipeline
    if view.speculative:
        spec = {
            "method": view.speculative.get("method"),
            "model": draft_path,
            "num_speculative_tokens": view.speculative.get("numSpeculativeTokens"),
        }
        flags["--speculative-config"] = json.dumps({k: v for k, v in spec.items() if v is not None}, sort_keys=True)
    if pool.name in ("prefill", "decode"):
        flags["--role"] = pool.name
        flags["--kv-port"] = KV_PORT
    if topo.nnodes > 1:
        # $(VAR) is expanded by the kubelet from the container's env (see rank_env()).
        flags["--nnodes"] = topo.nnodes
        is_lws = topo.workload == "LeaderWorkerSet"  # LWS injects these two into every container
        flags["--node-rank"] = "$(LWS_WORKER_INDEX)" if is_lws else "$(TIDEPOOL_NODE_RANK)"
        flags["--master-addr"] = "$(LWS_LEADER_ADDRESS)" if is_lws else "$(TIDEPOOL_MASTER_ADDR)"
        flags["--master-port"] = MASTER_PORT
    return flags


def headless_name(service: str, pool: str) -> str:
    return child_name(service, f"{pool}-hl")


def group_name(service: str, pool: str, index: int) -> str:
    return child_name(service, f"{pool}-g{index}")


def rank_env(service: str, namespace: str, pool: str, topo: Topology) -> dict[str, Any]:
    """Rank and rank-0 address of a StatefulSet group's pod (env sorted by name: GROUP precedes MASTER_ADDR,
    which the kubelet needs to expand `$(TIDEPOOL_GROUP)`). LWS pods get LWS_* env from LWS itself."""
    if topo.workload == "StatefulSet":
        # The group's rank 0 is "<group>-0"; its StatefulSet name is in the pod's group label.
        hl = headless_name(service, pool)
        return {
            "TIDEPOOL_NODE_RANK": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}},
            "TIDEPOOL_GROUP": {"fieldRef": {"fieldPath": f"metadata.labels['{LABEL_GROUP_INDEX}']"}},
            "TIDEPOOL_MASTER_ADDR": f"{child_name(service, pool)}-g$(TIDEPOOL_GROUP)-0.{hl}.{namespace}.svc",
        }
    return {}


def _resources(view: ServiceView, pool: PoolView, topo: Topology) -> dict[str, Any]:
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if topo.gpus_per_pod:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(topo.gpus_per_pod)
    cpu, memory = pool.cpu or view.cpu, pool.memory or view.memory
    if cpu:
        requests["cpu"] = limits["cpu"] = str(cpu)
    if memory:
        requests["memory"] = limits["memory"] = str(memory)
    return {"requests": requests, "limits": limits}


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def pod_template(
    view: ServiceView, pool: PoolView, topo: Topology, name: str, namespace: str, features: ClusterFeatures
) -> dict[str, Any]:
    hf_image = features.hf_download_image or view.image
    s3_image = features.s3_download_image
    model = model_source(
        view.model_uri, view.model_revision, field="spec.model.uri", hf_image=hf_image, s3_image=s3_image
    )
    sources = [model]
    draft_path = None
    draft = (view.speculative or {}).get("draftModel")
    if draft and is_model_uri(draft):
        src = model_source(
            draft, None, field="spec.engine.speculative.draftModel", hf_image=hf_image,
            s3_image=features.s3_download_image, name="draft",
        )  # fmt: skip
        sources.append(src)
        draft_path = src.path
    elif draft:
        draft_path = draft
    flags = engine_flags(view, pool, topo, model.path, draft_path, name)
    env = {"HOME": "/tmp", "HF_HOME": f"{MODELS_DIR}/.hf-home", **rank_env(name, namespace, pool.name, topo)}
    ports = [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}]
    if pool.name in ("prefill", "decode"):
        ports.append({"name": "kv", "containerPort": KV_PORT, "protocol": "TCP"})
    if topo.nnodes > 1:
        ports.append({"name": "dist", "containerPort": MASTER_PORT, "protocol": "TCP"})
    startup_failures = math.ceil(startup_budget_s(view, topo) / PROBE_PERIOD_S)
    mounts = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": CACHE_VOLUME, "mountPath": MODELS_DIR},
        {"name": "engine-config", "mountPath": CONFIG_DIR, "readOnly": True},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},  # NCCL and torch workers share memory here
        {"name": "engine-config", "configMap": {"name": child_name(name, "engine-config")}},
        {"name": CACHE_VOLUME, **cache_volume_source(view)},
    ]
    for src in sources:
        if src.volume:
            volumes.append(src.volume)
            mounts.append(src.mount)
    container = {
        "name": "engine",
        "image": view.image,
        "command": ["tidepool", "serve"],
        "args": flags_to_args(flags) + list(view.extra_args),
        "env": sorted_env(env),
        "ports": ports,
        "resources": _resources(view, pool, topo),
        "startupProbe": _probe("/health", PROBE_PERIOD_S, startup_failures),
        "readinessProbe": _probe("/ready", 5, 3),
        "livenessProbe": _probe("/health", 10, 6),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
        "securityContext": container_security_context(),
        "volumeMounts": sorted(mounts, key=lambda m: m["mountPath"]),
    }
    tolerations = list(view.tolerations)
    node_selector = dict(view.node_selector)
    if topo.gpus_per_pod:  # GPU nodes are commonly tainted nvidia.com/gpu:NoSchedule
        gpu_taint = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        if not any(contains_toleration(t, gpu_taint) for t in tolerations):
            tolerations.insert(0, gpu_taint)
        gpu_product = pool.gpu_product or view.gpu_product
        if gpu_product:
            node_selector.setdefault("nvidia.com/gpu.product", gpu_product)
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(ENGINE_PORT),
        "prometheus.io/path": "/metrics",
        **view.annotations,
    }
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # engines never call the API server
        "securityContext": pod_security_context(),
        "terminationGracePeriodSeconds": view.drain_timeout_s + PRESTOP_SLEEP_S + 15,
        "initContainers": [s.init_container for s in sources if s.init_container],
        "containers": [container],
        "volumes": sorted(volumes, key=lambda v: v["name"]),
    }
    if tolerations:
        spec["tolerations"] = tolerations
    if node_selector:
        spec["nodeSelector"] = dict(sorted(node_selector.items()))
    if view.service_account_name:
        spec["serviceAccountName"] = view.service_account_name
    if view.priority_class_name:
        spec["priorityClassName"] = view.priority_class_name
    if topo.workload == "StatefulSet":
        spec["subdomain"] = headless_name(name, pool.name)
    if not spec["initContainers"]:
        del spec["initContainers"]
    template = {"metadata": {"labels": labels(name, pool.name, "engine"), "annotations": annotations}, "spec": spec}
    template["metadata"]["labels"][LABEL_SPEC_HASH] = spec_hash(template)
    template["metadata"]["labels"] = dict(sorted(template["metadata"]["labels"].items()))
    template["metadata"]["annotations"] = dict(sorted(annotations.items()))
    return template


def contains_toleration(have: dict[str, Any], want: dict[str, Any]) -> bool:
    return all(have.get(k) == v for k, v in want.items())


def cache_volume_source(view: ServiceView) -> dict[str, Any]:
    if view.cache_claim:
        return {"persistentVolumeClaim": {"claimName": view.cache_claim}}
    return {"emptyDir": {}}


def pool_workloads(
    view: ServiceView, pool: PoolView, replicas: int, name: str, namespace: str, features: ClusterFeatures
) -> list[dict[str, Any]]:
    """The workload object(s) of one pool: a Deployment, a LeaderWorkerSet, or one StatefulSet per replica."""
    topo = topology(view, pool, features)
    template = pod_template(view, pool, topo, name, namespace, features)
    hash_label = {LABEL_SPEC_HASH: template["metadata"]["labels"][LABEL_SPEC_HASH]}
    meta_labels = {**labels(name, pool.name, "engine"), **hash_label}
    wl_name = child_name(name, pool.name)
    progress_deadline = startup_budget_s(view, topo) + 600
    if topo.workload == "Deployment":
        return [
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": metadata(wl_name, namespace, meta_labels),
                "spec": {
                    "replicas": replicas,
                    "selector": {"matchLabels": selector_labels(name, pool.name)},
                    "strategy": {
                        "type": "RollingUpdate",
                        "rollingUpdate": {"maxSurge": view.max_surge, "maxUnavailable": view.max_unavailable},
                    },
                    "revisionHistoryLimit": 3,
                    "progressDeadlineSeconds": progress_deadline,
                    "template": template,
                },
            }
        ]
    if topo.workload == "LeaderWorkerSet":
        return [
            {
                "apiVersion": LWS_API,
                "kind": "LeaderWorkerSet",
                "metadata": metadata(wl_name, namespace, meta_labels),
                "spec": {
                    "replicas": replicas,
                    "startupPolicy": "LeaderCreated",
                    "rolloutStrategy": {
                        "type": "RollingUpdate",
                        "rollingUpdateConfiguration": {
                            "maxSurge": view.max_surge,
                            "maxUnavailable": view.max_unavailable,
                        },
                    },
                    "leaderWorkerTemplate": {"size": topo.nnodes, "workerTemplate": template},
                },
            }
        ]
    out = []
    for index in range(replicas):
        tmpl = json.loads(json.dumps(template))
        tmpl["metadata"]["labels"][LABEL_GROUP_INDEX] = str(index)
        tmpl["metadata"]["labels"] = dict(sorted(tmpl["metadata"]["labels"].items()))
        sel = {**selector_labels(name, pool.name), LABEL_GROUP_INDEX: str(index)}
        out.append(
            {
                "apiVersion": "apps/v1",
                "kind": "StatefulSet",
                "metadata": metadata(group_name(name, pool.name, index), namespace, {**meta_labels, **sel}),
                "spec": {
                    "replicas": topo.nnodes,
                    "serviceName": headless_name(name, pool.name),
                    "podManagementPolicy": "Parallel",  # all ranks must start together to rendezvous
                    "selector": {"matchLabels": dict(sorted(sel.items()))},
                    "template": tmpl,
                },
            }
        )
    return out
