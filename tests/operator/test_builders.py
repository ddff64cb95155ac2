"""Table-driven tests of the pure builders: which children a spec yields, and what the pods run."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tidepool.operator.api import InferenceServiceSpec
from tidepool.operator.builders import ClusterFeatures, ServiceView, SpecError, desired_state

UNIFIED = {
    "model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"},
    "engine": {"image": "tidepool:test", "maxModelLen": 4096, "maxNumSeqs": 128},
    "resources": {"gpusPerReplica": 1, "gpuProduct": "NVIDIA-H100-80GB-HBM3", "cpu": "4", "memory": "16Gi"},
    "mode": "unified",
    "pools": {"unified": {"replicas": 2, "minReplicas": 1, "maxReplicas": 4}},
}
DISAGG = {
    **UNIFIED,
    "parallelism": {"tensor": 2},
    "resources": {"gpusPerReplica": 2},
    "mode": "disaggregated",
    "replicas": 3,
    "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 2, "maxReplicas": 4}},
}
MULTI_NODE = {**UNIFIED, "parallelism": {"tensor": 8, "pipeline": 2}, "resources": {"gpusPerReplica": 16}}


def spec(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A validated, defaulted copy of `base` with top-level or dotted-path changes."""
    out = json.loads(json.dumps(base))
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return InferenceServiceSpec.model_validate(out).to_wire()


def build(s: dict[str, Any], features: ClusterFeatures | None = None, **kw: Any) -> list[dict[str, Any]]:
    return desired_state("svc", "ns", ServiceView.from_spec(s), features, **kw).children


def by_key(children: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def pod_specs(children: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for c in children:
        if c["kind"] in ("Deployment", "StatefulSet"):
            out.append(c["spec"]["template"])
        elif c["kind"] == "LeaderWorkerSet":
            out.append(c["spec"]["leaderWorkerTemplate"]["workerTemplate"])
    return out


def engine_container(workload: dict[str, Any]) -> dict[str, Any]:
    tmpl = workload["spec"].get("template") or workload["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    return tmpl["spec"]["containers"][0]


COMMON = {
    ("ServiceAccount", "svc-router"),
    ("RoleBinding", "svc-router"),
    ("Deployment", "svc-router"),
    ("Service", "svc-router"),
    ("PodDisruptionBudget", "svc-router"),
    ("NetworkPolicy", "svc-engine"),  # spec.networkPolicy (test_netpol.py)
    ("NetworkPolicy", "svc-router"),
}

CASES = [
    pytest.param(
        spec(UNIFIED),
        ClusterFeatures(),
        COMMON | {("Deployment", "svc-unified"), ("Service", "svc-unified"), ("PodDisruptionBudget", "svc-unified")},
        {"svc-unified": ("Deployment", 2, 1)},
        id="unified",
    ),
    pytest.param(
        spec(DISAGG),
        ClusterFeatures(),
        COMMON
        | {(k, f"svc-{p}") for p in ("prefill", "decode") for k in ("Deployment", "Service")}
        | {("PodDisruptionBudget", "svc-decode")},  # prefill: one replica, no autoscaler: no budget (it protects none)
        {"svc-prefill": ("Deployment", 1, 2), "svc-decode": ("Deployment", 3, 2)},  # spec.replicas wins for decode
        id="disaggregated",
    ),
    pytest.param(
        spec(MULTI_NODE),
        ClusterFeatures(),
        COMMON
        | {
            ("StatefulSet", "svc-unified-g0"),
            ("StatefulSet", "svc-unified-g1"),
            ("Service", "svc-unified"),
            ("Service", "svc-unified-hl"),
            ("PodDisruptionBudget", "svc-unified"),
            ("Secret", "svc-unified-control-key"),  # the control channel's key (test_control_key.py)
        },
        {"svc-unified-g0": ("StatefulSet", 2, 8), "svc-unified-g1": ("StatefulSet", 2, 8)},
        id="multi-node-statefulset-groups",
    ),
    pytest.param(
        spec(MULTI_NODE),
        ClusterFeatures(has_lws=True, has_service_monitor=True),
        COMMON
        | {
            ("LeaderWorkerSet", "svc-unified"),
            ("Service", "svc-unified"),
            ("PodDisruptionBudget", "svc-unified"),
            ("ServiceMonitor", "svc"),
            ("Secret", "svc-unified-control-key"),  # the control channel's key (test_control_key.py)
        },
        {"svc-unified": ("LeaderWorkerSet", 2, 8)},
        id="multi-node-lws-and-servicemonitor",
    ),
    pytest.param(
        spec(
            UNIFIED,
            resources={"gpusPerReplica": 0},
            modelCache={"persistentVolumeClaim": {"claimName": "weights", "size": "10Gi"}},
        ),
        ClusterFeatures(),
        COMMON
        | {
            ("Deployment", "svc-unified"),
            ("Service", "svc-unified"),
            ("PodDisruptionBudget", "svc-unified"),
            ("PersistentVolumeClaim", "weights"),
        },
        {"svc-unified": ("Deployment", 2, 0)},
        id="cpu-with-created-cache-claim",
    ),
    pytest.param(  # CPU pipeline parallelism: one pod per stage, no GPUs, the same multi-node workload
        spec(UNIFIED, resources={"gpusPerReplica": 0}, parallelism={"tensor": 2, "pipeline": 2}),
        ClusterFeatures(has_lws=True),
        COMMON
        | {("LeaderWorkerSet", "svc-unified"), ("Service", "svc-unified"), ("PodDisruptionBudget", "svc-unified")}
        | {("Secret", "svc-unified-control-key")},
        {"svc-unified": ("LeaderWorkerSet", 2, 0)},
        id="cpu-pipeline-parallel-lws",
    ),
]


@pytest.mark.parametrize(("s", "features", "names", "workloads"), CASES)
def test_children_per_spec(s, features, names, workloads):
    children = build(s, features)
    found = by_key(children)
    assert set(found) == names
    for name, (kind, replicas, gpus) in workloads.items():
        wl = found[(kind, name)]
        # replicas: Deployment/LWS count replicas; a StatefulSet group counts the pods of one replica.
        assert wl["spec"]["replicas"] == replicas
        limits = engine_container(wl)["resources"]["limits"]
        assert limits.get("nvidia.com/gpu") == (str(gpus) if gpus else None)
    assert all(c["metadata"]["namespace"] == "ns" for c in children)


@pytest.mark.parametrize(("s", "features"), [(c.values[0], c.values[1]) for c in CASES])
def test_output_is_stable_sorted_and_restricted(s, features):
    first, second = build(s, features), build(s, features)
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)
    for tmpl in pod_specs(first):
        pod = tmpl["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert "hostPath" not in json.dumps(pod["volumes"])
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["readOnlyRootFilesystem"] is True
            names = [e["name"] for e in c.get("env", [])]
            assert names == sorted(names)
        flags = [a for a in pod["containers"][0]["args"] if a.startswith("--")]
        assert flags == sorted(flags)
        assert tmpl["metadata"]["labels"]["tidepool.dev/spec-hash"]
        mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert "/tmp" in mounts


def test_probes_and_drain_are_sized_from_the_spec():
    for s, min_startup_s in ((spec(UNIFIED), 10 * 60), (spec(DISAGG), 30 * 60)):
        for wl in (c for c in build(s) if c["kind"] == "Deployment" and "router" not in c["metadata"]["name"]):
            pod = wl["spec"]["template"]["spec"]
            engine = pod["containers"][0]
            startup = engine["startupProbe"]
            assert startup["httpGet"]["path"] == "/health"
            assert startup["failureThreshold"] * startup["periodSeconds"] >= min_startup_s
            assert engine["readinessProbe"]["httpGet"]["path"] == "/ready"
            assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
            drain = float(engine["args"][engine["args"].index("--drain-timeout") + 1])
            pre_stop = engine["lifecycle"]["preStop"]["sleep"]["seconds"]
            assert pod["terminationGracePeriodSeconds"] >= drain + pre_stop


@pytest.mark.parametrize("drain", [0, 30, 600, 3600])
def test_drain_timeout_reaches_the_engine_and_the_grace_period(drain):
    children = by_key(build(spec(UNIFIED, engine__drainTimeoutSeconds=drain)))
    pod = children[("Deployment", "svc-unified")]["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    assert float(engine["args"][engine["args"].index("--drain-timeout") + 1]) == drain
    pre_stop = engine["lifecycle"]["preStop"]["sleep"]["seconds"]
    # The kubelet's grace period counts from the preStop hook: it must cover preStop + the whole drain + shutdown.
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 10
    router = children[("Deployment", "svc-router")]["spec"]["template"]["spec"]
    assert router["terminationGracePeriodSeconds"] >= drain  # it proxies the streams the engines drain


@pytest.mark.parametrize("features", [ClusterFeatures(), ClusterFeatures(has_lws=True)], ids=["statefulset", "lws"])
def test_multi_node_ranks_share_probes_and_only_the_leader_serves(features):
    """Every rank gets the probes the worker node's health endpoint answers (same paths, same port); the pool's
    Service selects rank 0 only; LWS restarts the group as a unit."""
    s = spec(UNIFIED, parallelism={"tensor": 2, "pipeline": 2}, resources={"gpusPerReplica": 4})
    children = build(s, features)
    workloads = [c for c in children if c["kind"] in ("StatefulSet", "LeaderWorkerSet")]
    assert workloads
    for wl in workloads:
        container = engine_container(wl)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe, path in (("startupProbe", "/health"), ("readinessProbe", "/ready"), ("livenessProbe", "/health")):
            assert container[probe]["httpGet"] == {"path": path, "port": "http"}
        args = container["args"]
        assert ports["http"] == int(args[args.index("--port") + 1])  # the port worker nodes answer probes on
    service = by_key(children)[("Service", "svc-unified")]
    rank_label = "leaderworkerset.sigs.k8s.io/worker-index" if features.has_lws else "apps.kubernetes.io/pod-index"
    assert service["spec"]["selector"][rank_label] == "0"
    if features.has_lws:
        (lws,) = workloads
        assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2


def test_spec_hash_follows_what_pods_run():
    def hashes(s: dict[str, Any]) -> dict[str, str]:
        return {
            c["metadata"]["name"]: c["spec"]["template"]["metadata"]["labels"]["tidepool.dev/spec-hash"]
            for c in build(s)
            if c["kind"] == "Deployment"
        }

    base = hashes(spec(UNIFIED))
    assert hashes(spec(UNIFIED)) == base
    assert hashes(spec(UNIFIED, pools={"unified": {"replicas": 4, "maxReplicas": 4}})) == base  # scaling != rollout
    changed = hashes(spec(UNIFIED, engine__maxNumSeqs=64))
    assert changed["svc-unified"] != base["svc-unified"] and changed["svc-router"] == base["svc-router"]
    routed = hashes(spec(UNIFIED, router={"policy": "round-robin"}))
    assert routed["svc-unified"] == base["svc-unified"] and routed["svc-router"] != base["svc-router"]


def test_replicas_by_pool_overrides_the_spec():
    found = by_key(build(spec(DISAGG), replicas_by_pool={"prefill": 3, "decode": 0}))
    assert found[("Deployment", "svc-prefill")]["spec"]["replicas"] == 3
    assert found[("Deployment", "svc-decode")]["spec"]["replicas"] == 0
    with pytest.raises(SpecError, match="replicas of pool decode"):
        build(spec(DISAGG), replicas_by_pool={"decode": -1})


@pytest.mark.parametrize(
    ("uri", "init_cmd", "model_path"),
    [
        ("hf://org/model", ["tidepool", "download"], "/models/hf/org/model/main"),
        ("s3://bucket/prefix/model", ["aws"], "/models/s3/bucket/prefix/model"),
        ("pvc://weights/llama/8b", None, "/models/pvc/weights/llama/8b"),
    ],
)
def test_model_sources(uri, init_cmd, model_path):
    wl = by_key(build(spec(UNIFIED, model={"uri": uri})))[("Deployment", "svc-unified")]
    pod = wl["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == model_path
    inits = pod.get("initContainers", [])
    assert [i["command"] for i in inits] == ([init_cmd] if init_cmd else [])
    if uri.startswith("pvc://"):
        claim = next(v for v in pod["volumes"] if "persistentVolumeClaim" in v and v["name"].startswith("pvc-"))
        assert claim["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": {"uri": "file:///models/x"}}, "pvc://claim/path"),  # refused by the API rules, with the fix
        (
            {"parallelism": {"tensor": 16}, "resources": {"gpusPerReplica": 16}},
            "tensor parallelism stays within a node",
        ),
    ],
)
def test_impossible_specs_name_the_fix(changes, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        build(spec(UNIFIED, **changes))


def _substitute_env(args: list[str]) -> list[str]:
    """What the kubelet does with $(VAR) before the container starts."""
    sample = {"TIDEPOOL_NODE_RANK": "1", "TIDEPOOL_MASTER_ADDR": "svc-unified-g0-0", "LWS_WORKER_INDEX": "1"}
    sample["LWS_LEADER_ADDRESS"] = "svc-unified-0"
    return [re.sub(r"\$\((\w+)\)", lambda m: sample[m.group(1)], a) for a in args]


@pytest.mark.parametrize(
    "s",
    [
        spec(UNIFIED),
        spec(UNIFIED, engine__prefixCaching=False, engine__chunkedPrefill=False),
        spec(DISAGG),
        spec(MULTI_NODE),
        spec(UNIFIED, engine__speculative={"method": "draft", "draftModel": "hf://org/draft"}),
        spec(UNIFIED, model__quantization="int4"),
    ],
    ids=["unified", "no-caching", "disaggregated", "multi-node", "speculative", "quantized"],
)
def test_engine_args_parse_with_tidepool_serve(s):
    """The builder's args go through the real `tidepool serve` parser (the engine's own flags)."""
    from tidepool.engine.server.cli import build_parser

    parser = build_parser()
    for wl in build(s):
        if wl["kind"] not in ("Deployment", "StatefulSet") or wl["metadata"]["name"] == "svc-router":
            continue
        container = engine_container(wl)
        assert container["command"] == ["tidepool", "serve"]
        args = parser.parse_args(_substitute_env(container["args"]))
        assert args.port == 8000 and args.served_model_name == "svc"
        if "pools" in s and "decode" in s["pools"]:
            assert args.role in ("prefill", "decode") and args.kv_port == 14579
        if s["parallelism"]["pipeline"] > 1:
            assert args.nnodes == 2 and args.node_rank == 1 and args.master_port == 29500
        quantization = s["model"].get("quantization")
        assert args.quantization == (None if quantization in (None, "none") else quantization)
        if s["engine"].get("speculative"):
            config = json.loads(args.speculative_config)
            assert config["draft_model"] == "/models/hf/org/draft/main" and config["num_speculative_tokens"] == 4
