"""Engine pool workloads: the `tidepool serve` container, its pod template, and the workload kind.

A replica is one pod per pipeline stage with `tensor` GPUs each. pipeline = 1 -> a Deployment.
pipeline = N > 1 (multi-node) -> a LeaderWorkerSet of group size N when the LWS CRD exists, else one
StatefulSet of N pods per replica ("group"), ranks from the pod-index label, all behind one headless
Service so ranks find rank 0 (`--master-addr`). An existing pool keeps the kind it runs as when LWS comes
or goes (`with_workload_kind`: sticky, no make-before-break replacement for nothing).

Multi-node groups: every rank runs the same template and the same probes. Rank 0 serves the API;
ranks > 0 serve only `/health` and `/ready` on the same port (engine/distributed/health.py), so a
rank is Ready exactly when it has loaded and joined its driver, and fails its liveness probe when it
lost its group. Only rank 0 is in the pool's Service (network.pool_service). A failed rank restarts
the whole group with LWS (`RecreateGroupOnPodRestart`). A StatefulSet has no group semantics: the
failed rank's pod restarts alone; rank 0's engine fails at its next step (its /health turns 500 and
the kubelet restarts it), the other ranks see rank 0's channel close and exit, and every rank then
rendezvous again through the new rank 0, so the group converges, but later and less cleanly than
with LWS (install LWS for multi-node pools). Every rank mounts its pool's control-channel key (control_key.py).

Invariants: pure; args are rendered from the engine's flag table (serve_flags), sorted, user
`extraArgs` last in their order, and only flags the table marks managed; the operator's env sorted by
name, then the pool's pod.env in its own order; quantities canonical; pod overrides applied by
overrides.py, never over the security contexts or the operator's env, volumes and mounts; the pod
template carries `tidepool.dev/spec-hash`, a digest of the template itself, so any change to what the
pods run changes the hash and rolls the pool. spec.lora adds its settings (flags, env, a readiness gate: lora.py), never
the adapter list, which the operator applies to running pods instead (operator/lora/).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from tidepool.contract.serve_flags import render_args
from tidepool.contract.sleep import SLEEP_MODE_FLAG
from tidepool.operator.api.pod import PodOverrides
from tidepool.operator.api.quantity import canonical_quantity
from tidepool.operator.api.spec import serve_flag_fields
from tidepool.operator.api.view import PoolView, ServiceView, SpecError

from .auth import api_key_args, with_api_key
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
    engine_image,
    labels,
    metadata,
    pod_security_context,
    selector_labels,
    sorted_env,
    spec_hash,
)
from .control_key import control_key_env, with_control_key
from .lora import lora_env, lora_flags, readiness_gates
from .overrides import apply_engine_pod, container_resources, pool_pod
from .sources import CACHE_VOLUME, MODELS_DIR, ModelSource, cache_volume_source, model_source

LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
PRESTOP_SLEEP_S = 5  # the pod keeps serving while its endpoint leaves the Services and the router
# Beyond preStop + drain: uvicorn's graceful shutdown (5 s) and the engine's teardown before the kubelet's SIGKILL.
DRAIN_MARGIN_S = 15
PROBE_PERIOD_S = 10


@dataclass(frozen=True, slots=True)
class Topology:
    """How one replica of a pool maps onto nodes."""

    gpus_per_replica: int
    nnodes: int  # pods per replica
    gpus_per_pod: int
    workload: str  # "Deployment" | "LeaderWorkerSet" | "StatefulSet"


def topology(view: ServiceView, features: ClusterFeatures) -> Topology:
    """A replica is one pod per pipeline stage with `tensor` GPUs each (the API's contract)."""
    tensor, pipeline = view.parallelism.tensor, view.parallelism.pipeline
    multi_node = "LeaderWorkerSet" if features.has_lws else "StatefulSet"
    if view.resources.gpus_per_replica == 0:  # CPU: the tensor ranks share one pod, one pod per pipeline stage
        return Topology(0, pipeline, 0, multi_node) if pipeline > 1 else Topology(0, 1, 0, "Deployment")
    if tensor > features.gpus_per_node:
        raise SpecError(
            f"parallelism.tensor {tensor} needs more GPUs than one node has ({features.gpus_per_node}); "
            "tensor parallelism stays within a node: lower tensor and raise pipeline"
        )
    if pipeline == 1:
        return Topology(tensor, 1, tensor, "Deployment")
    return Topology(tensor * pipeline, pipeline, tensor, multi_node)


def with_workload_kind(features: ClusterFeatures, kind: str | None) -> ClusterFeatures:
    """`features` for a pool that already runs as `kind` (sticky: an existing multi-node pool keeps StatefulSet
    groups when LWS is installed later, and LeaderWorkerSet while LWS stays); None: a new pool, the cluster's choice."""
    if kind == "StatefulSet":
        return dataclasses.replace(features, has_lws=False)
    if kind == "LeaderWorkerSet":
        return dataclasses.replace(features, has_lws=True)
    return features


def startup_budget_s(topo: Topology) -> int:
    """Time allowed for the engine to load: 10 min plus 10 min per GPU of the replica (≥ 30 min from 2 GPUs)."""
    return min(600 * (1 + max(topo.gpus_per_replica, 0)), 4 * 3600)


def termination_grace_s(view: ServiceView) -> int:
    """preStop sleep + the engine's drain (engine.drainTimeoutSeconds) + a margin to shut down."""
    return PRESTOP_SLEEP_S + view.engine.drain_timeout_seconds + DRAIN_MARGIN_S


def engine_flags(
    view: ServiceView, pool: PoolView, topo: Topology, model_path: str, draft_path: str | None, served_name: str
) -> dict[str, Any]:
    """`tidepool serve` flags by name (serve_flags' table); the model is served under the InferenceService's
    name (what clients send). Engine fields marked with a serve flag in the API pass straight through."""
    engine = view.engine
    flags: dict[str, Any] = {
        "model": model_path,
        "served-model-name": served_name,
        "host": "0.0.0.0",
        "port": ENGINE_PORT,
        "quantization": view.quantization,
        "sparsity": view.sparsity,
        "tensor-parallel-size": view.parallelism.tensor,
        "pipeline-parallel-size": view.parallelism.pipeline,
    }
    flags.update({flag: getattr(engine, field) for field, flag in serve_flag_fields().items()})
    flags.update(lora_flags(view))
    if view.autoscaling.idle == "sleep":  # the autoscaler puts idle pools to sleep (operator/autoscaler/sleep.py)
        flags[SLEEP_MODE_FLAG] = True
    if engine.speculative is not None:
        speculative = {
            "method": engine.speculative.method,
            "draft_model": draft_path,
            "num_speculative_tokens": engine.speculative.num_speculative_tokens,
        }
        flags["speculative-config"] = {k: v for k, v in speculative.items() if v is not None}
    if pool.name in ("prefill", "decode"):
        flags["role"] = pool.name
        flags["kv-port"] = KV_PORT
    if topo.nnodes > 1:
        # $(VAR) is expanded by the kubelet from the container's env (see rank_env()).
        is_lws = topo.workload == "LeaderWorkerSet"  # LWS injects these two into every container
        flags["nnodes"] = topo.nnodes
        flags["node-rank"] = "$(LWS_WORKER_INDEX)" if is_lws else "$(TIDEPOOL_NODE_RANK)"
        flags["master-addr"] = "$(LWS_LEADER_ADDRESS)" if is_lws else "$(TIDEPOOL_MASTER_ADDR)"
        flags["master-port"] = MASTER_PORT
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
    """Requests = limits (Guaranteed QoS for the engine), quantities in the API server's canonical form; the
    GPUs as spec.accelerator.resourceName; pod.resources then replaces entries per resource name
    (overrides.container_resources)."""
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if topo.gpus_per_pod:
        gpu = view.spec.accelerator_resource()
        requests[gpu] = limits[gpu] = str(topo.gpus_per_pod)
    for name, value in (("cpu", pool.resources.cpu), ("memory", pool.resources.memory)):
        if value is not None:
            requests[name] = limits[name] = canonical_quantity(value)
    return {"requests": requests, "limits": limits}


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def model_sources(view: ServiceView, features: ClusterFeatures) -> tuple[list[ModelSource], str | None]:
    """Where the pod finds the model (first) and the speculative draft model (when named); the draft's path."""
    hf_image = features.hf_download_image or engine_image(view, features)
    s3_image = features.s3_download_image
    secret = view.model.credentials.secret_name if view.model.credentials else None
    model = model_source(
        view.model.uri, view.model.revision, field="spec.model.uri", hf_image=hf_image, s3_image=s3_image,
        secret_name=secret,
    )  # fmt: skip
    speculative = view.engine.speculative
    if speculative is None or speculative.draft_model is None:
        return [model], None
    draft = model_source(
        speculative.draft_model, None, field="spec.engine.speculative.draftModel", hf_image=hf_image,
        s3_image=s3_image, name="draft", secret_name=secret,
    )  # fmt: skip
    return [model, draft], draft.path


def _storage(view: ServiceView, sources: list[ModelSource]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(mounts, volumes) of the engine container: /tmp, shared memory, the model cache, and the sources' own."""
    mounts = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": CACHE_VOLUME, "mountPath": MODELS_DIR},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},  # NCCL and torch workers share memory here
        {"name": CACHE_VOLUME, **cache_volume_source(view)},
    ]
    for src in sources:
        if src.volume:
            volumes.append(src.volume)
            mounts.append(src.mount)
    return sorted(mounts, key=lambda m: m["mountPath"]), sorted(volumes, key=lambda v: v["name"])


def triton_cache_env(view: ServiceView, topo: Topology) -> dict[str, str]:
    """GPU pods on a persistent model cache keep Triton's kernel cache (compiled kernels and the launcher built
    against the node's libcuda; Triton keys entries by its version and the GPU target) on that claim, so only the
    first pod of a service compiles and a pod scaled from zero or started on a new node reuses it. Elsewhere it
    stays in $HOME/.triton on the pod's /tmp (an emptyDir cache dies with its pod, as /tmp does)."""
    cache = view.model_cache
    if topo.gpus_per_pod and cache is not None and cache.persistent_volume_claim is not None:
        return {"TRITON_CACHE_DIR": f"{MODELS_DIR}/.triton-cache"}
    return {}


def engine_container(
    view: ServiceView,
    pool: PoolView,
    topo: Topology,
    name: str,
    namespace: str,
    features: ClusterFeatures,
    sources: tuple[list[ModelSource], str | None],
    mounts: list[dict[str, Any]],
) -> dict[str, Any]:
    """The `tidepool serve` container of every rank (before the pool's pod overrides)."""
    models, draft_path = sources
    args = render_args(engine_flags(view, pool, topo, models[0].path, draft_path, name), managed_only=True)
    env = {
        "HOME": "/tmp",
        "HF_HOME": f"{MODELS_DIR}/.hf-home",
        **triton_cache_env(view, topo),
        **rank_env(name, namespace, pool.name, topo),
        **lora_env(view),
        **control_key_env(topo.nnodes),
    }
    ports = [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}]
    if pool.name in ("prefill", "decode"):
        ports.append({"name": "kv", "containerPort": KV_PORT, "protocol": "TCP"})
    if topo.nnodes > 1:
        ports.append({"name": "dist", "containerPort": MASTER_PORT, "protocol": "TCP"})
    startup_failures = math.ceil(startup_budget_s(topo) / PROBE_PERIOD_S)
    return {
        "name": "engine",
        "image": engine_image(view, features),
        "command": ["tidepool", "serve"],
        "args": args + api_key_args(view) + list(view.engine.extra_args),
        "env": sorted_env(env),
        "ports": ports,
        "resources": container_resources(_resources(view, pool, topo), pool_pod(view, pool.name).resources),
        # Every rank answers these: node 0's API server, or a worker node's health endpoint (ranks > 0).
        "startupProbe": _probe("/health", PROBE_PERIOD_S, startup_failures),
        "readinessProbe": _probe("/ready", 5, 3),
        "livenessProbe": _probe("/health", 10, 6),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
        "securityContext": container_security_context(),
        "volumeMounts": mounts,
    }


def gpu_taint_keys(resource_name: str) -> list[str]:
    """Taint keys GPU nodes of an accelerator commonly carry: `<domain>/gpu` (nvidia.com/gpu also on MIG nodes,
    amd.com/gpu) and the resource name itself when it differs."""
    domain_gpu = resource_name.split("/", 1)[0] + "/gpu"
    return [domain_gpu] if resource_name == domain_gpu else [domain_gpu, resource_name]


def _placement(view: ServiceView, pod: PodOverrides, pool: PoolView, topo: Topology) -> dict[str, Any]:
    """tolerations and nodeSelector: the pod overrides', plus the GPU taints' tolerations and the GPU product."""
    tolerations = [t.to_wire() for t in pod.tolerations]
    node_selector = dict(pod.node_selector)
    if topo.gpus_per_pod:  # GPU nodes are commonly tainted <vendor>/gpu:NoSchedule
        for key in reversed(gpu_taint_keys(view.spec.accelerator_resource())):
            gpu_taint = {"key": key, "operator": "Exists", "effect": "NoSchedule"}
            if not any(contains_toleration(t, gpu_taint) for t in tolerations):
                tolerations.insert(0, gpu_taint)
        if pool.resources.gpu_product:
            node_selector.setdefault("nvidia.com/gpu.product", pool.resources.gpu_product)
    out: dict[str, Any] = {}
    if tolerations:
        out["tolerations"] = tolerations
    if node_selector:
        out["nodeSelector"] = dict(sorted(node_selector.items()))
    return out


def pod_template(
    view: ServiceView, pool: PoolView, topo: Topology, name: str, namespace: str, features: ClusterFeatures
) -> dict[str, Any]:
    """The pod of every rank of a replica (multi-node ranks share it; see the module docstring). The pool's pod
    overrides (spec.pod with pools.<pool>.pod merged over it) land here, around the operator's own settings."""
    pod = pool_pod(view, pool.name)
    sources = model_sources(view, features)
    mounts, volumes = with_api_key(view, *with_control_key(name, pool.name, topo.nnodes, *_storage(view, sources[0])))
    container = engine_container(view, pool, topo, name, namespace, features, sources, mounts)
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(ENGINE_PORT),
        "prometheus.io/path": "/metrics",
        **pod.annotations,
    }
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # engines never call the API server
        "securityContext": pod_security_context(),
        "terminationGracePeriodSeconds": termination_grace_s(view),
        "initContainers": [s.init_container for s in sources[0] if s.init_container],
        "containers": [container],
        "volumes": volumes,
        **_placement(view, pod, pool, topo),
    }
    if pod.service_account_name:
        spec["serviceAccountName"] = pod.service_account_name
    if pod.priority_class_name:
        spec["priorityClassName"] = pod.priority_class_name
    if gates := readiness_gates(view):
        spec["readinessGates"] = gates
    apply_engine_pod(spec, container, pod, selector_labels(name, pool.name))
    if topo.workload == "StatefulSet":
        spec["subdomain"] = headless_name(name, pool.name)
    if not spec["initContainers"]:
        del spec["initContainers"]
    pod_labels = {**pod.labels, **labels(name, pool.name, "engine")}  # the operator's keys win (and are refused)
    template = {"metadata": {"labels": pod_labels, "annotations": annotations}, "spec": spec}
    template["metadata"]["labels"][LABEL_SPEC_HASH] = spec_hash(template)
    template["metadata"]["labels"] = dict(sorted(template["metadata"]["labels"].items()))
    template["metadata"]["annotations"] = dict(sorted(annotations.items()))
    return template


def contains_toleration(have: dict[str, Any], want: dict[str, Any]) -> bool:
    return all(have.get(k) == v for k, v in want.items())


def pool_workloads(
    view: ServiceView, pool: PoolView, replicas: int, name: str, namespace: str, features: ClusterFeatures
) -> list[dict[str, Any]]:
    """The workload object(s) of one pool: a Deployment, a LeaderWorkerSet, or one StatefulSet per replica."""
    topo = topology(view, features)
    template = pod_template(view, pool, topo, name, namespace, features)
    hash_label = {LABEL_SPEC_HASH: template["metadata"]["labels"][LABEL_SPEC_HASH]}
    meta_labels = {**labels(name, pool.name, "engine"), **hash_label}
    wl_name = child_name(name, pool.name)
    rollout = {"maxSurge": view.rollout.max_surge, "maxUnavailable": view.rollout.max_unavailable}
    progress_deadline = startup_budget_s(topo) + 600
    if topo.workload == "Deployment":
        return [
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": metadata(wl_name, namespace, meta_labels),
                "spec": {
                    "replicas": replicas,
                    "selector": {"matchLabels": selector_labels(name, pool.name)},
                    "strategy": {"type": "RollingUpdate", "rollingUpdate": rollout},
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
                    # A headless Service per group (`<name>-<group>`): the pool's own ClusterIP Service already
                    # holds `<name>`, so LWS's shared one could not exist and the leader's DNS name would not resolve.
                    "networkConfig": {"subdomainPolicy": "UniquePerReplica"},
                    "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": rollout},
                    "leaderWorkerTemplate": {
                        "size": topo.nnodes,
                        # Any rank's container restart recreates the whole group: ranks rendezvous only at start.
                        "restartPolicy": "RecreateGroupOnPodRestart",
                        "workerTemplate": template,
                    },
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
