"""Pod overrides (spec.pod, pools.<name>.pod, router.*) in the rendered pods: where each lands, the merge,
what the router takes, what is refused, and the restricted security contexts surviving every override."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from fake_api import NAME, NS, SPEC, with_controller
from pydantic import ValidationError
from test_builders import DISAGG, MULTI_NODE, UNIFIED, build, by_key, pod_specs, spec

from tidepool.operator.api import InferenceServiceSpec, PodOverrides, validate_spec
from tidepool.operator.api import pod as api_pod
from tidepool.operator.builders import ClusterFeatures, SpecError
from tidepool.operator.builders.common import container_security_context, pod_security_context
from tidepool.operator.builders.overrides import merge_pod

SECRET_ENV = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
POD = {
    "env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}, SECRET_ENV],
    "envFrom": [{"configMapRef": {"name": "engine-env"}}],
    "volumes": [
        {"name": "certs", "secret": {"secretName": "ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"name": "scratch", "emptyDir": {}},
    ],
    "volumeMounts": [
        {"name": "certs", "mountPath": "/etc/ssl/extra", "readOnly": True},
        {"name": "scratch", "mountPath": "/scratch"},
    ],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]
            }
        }
    },
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}
    ],
    "runtimeClassName": "nvidia",
    "imagePullSecrets": [{"name": "regcred"}],
    "resources": {"requests": {"ephemeral-storage": "20Gi"}, "limits": {"ephemeral-storage": "40Gi", "cpu": "8"}},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
    "nodeSelector": {"pool": "gpu"},
    "priorityClassName": "high",
}
FEATURES = {
    "deployment": (UNIFIED, ClusterFeatures()),
    "statefulset": (MULTI_NODE, ClusterFeatures()),
    "leaderworkerset": (MULTI_NODE, ClusterFeatures(has_lws=True)),
    "disaggregated": (DISAGG, ClusterFeatures()),
}


def engine_pods(s: dict[str, Any], features: ClusterFeatures | None = None) -> list[dict[str, Any]]:
    return [t for t in pod_specs(build(s, features)) if t["metadata"]["labels"]["tidepool.dev/pool"] != "router"]


def router_pod(s: dict[str, Any]) -> dict[str, Any]:
    return by_key(build(s))[("Deployment", "svc-router")]["spec"]["template"]


def test_env_envfrom_and_mounts_reach_the_download_init_container_but_not_over_its_credentials() -> None:
    base = copy.deepcopy(UNIFIED)
    base["model"]["credentials"] = {"secretName": "hub"}
    (template,) = engine_pods(spec(base, pod=POD))[:1]
    (init,) = template["spec"]["initContainers"]
    env = {e["name"]: e for e in init["env"]}
    assert env["HTTPS_PROXY"]["value"] == "http://proxy:3128"
    token = [e for e in init["env"] if e["name"] == "HF_TOKEN"]
    assert len(token) == 1 and token[0]["valueFrom"]["secretKeyRef"]["name"] == "hub"  # the credentials' own
    assert init["envFrom"] == [{"configMapRef": {"name": "engine-env"}}]
    mounts = [m["mountPath"] for m in init["volumeMounts"]]
    assert "/etc/ssl/extra" in mounts and "/models" in mounts and mounts == sorted(mounts)


@pytest.mark.parametrize("form", FEATURES)
def test_overrides_land_in_every_engine_pod_form(form: str) -> None:
    base, features = FEATURES[form]
    pods = engine_pods(spec(base, pod=POD), features)
    assert pods
    for template in pods:
        pod, engine = template["spec"], template["spec"]["containers"][0]
        env = {e["name"]: e for e in engine["env"]}
        assert env["HTTPS_PROXY"]["value"] == "http://proxy:3128" and env["HF_TOKEN"] == SECRET_ENV
        assert env["HOME"]["value"] == "/tmp"  # the operator's own env is still there
        assert engine["envFrom"] == [{"configMapRef": {"name": "engine-env"}}]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["scratch"] == {"name": "scratch", "emptyDir": {}}  # an empty source stays {}
        assert volumes["certs"]["secret"] == {"secretName": "ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
        assert {"tmp", "dshm", "model-cache"} <= set(volumes)
        mounts = {m["mountPath"]: m for m in engine["volumeMounts"]}
        assert mounts["/etc/ssl/extra"] == {"name": "certs", "mountPath": "/etc/ssl/extra", "readOnly": True}
        assert "/scratch" in mounts and "/models" in mounts
        assert [m["mountPath"] for m in engine["volumeMounts"]] == sorted(mounts)
        assert pod["affinity"] == POD["affinity"]
        (spread,) = pod["topologySpreadConstraints"]  # labelSelector unset: this pool's own pods
        assert spread["labelSelector"]["matchLabels"] == {
            "tidepool.dev/inferenceservice": "svc",
            "tidepool.dev/pool": template["metadata"]["labels"]["tidepool.dev/pool"],
        }
        assert pod["runtimeClassName"] == "nvidia" and pod["imagePullSecrets"] == [{"name": "regcred"}]
        assert pod["priorityClassName"] == "high" and pod["nodeSelector"]["pool"] == "gpu"
        assert {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"} in pod["tolerations"]
        resources = engine["resources"]
        assert (
            resources["requests"]["ephemeral-storage"] == "20Gi" and resources["limits"]["ephemeral-storage"] == "40Gi"
        )
        assert resources["limits"]["cpu"] == "8"  # replaces spec.resources.cpu's limit; the request stays
        assert "nvidia.com/gpu" in resources["limits"]
        # The restricted contexts survive every override.
        assert pod["securityContext"] == pod_security_context()
        assert all(c["securityContext"] == container_security_context() for c in pod["containers"])
        assert pod["automountServiceAccountToken"] is False
        assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod)


def test_overrides_change_the_spec_hash() -> None:
    def hashes(s: dict[str, Any]) -> set[str]:
        return {t["metadata"]["labels"]["tidepool.dev/spec-hash"] for t in engine_pods(s)}

    assert hashes(spec(UNIFIED)) != hashes(spec(UNIFIED, pod={"env": [{"name": "A", "value": "1"}]}))


def test_router_takes_only_what_is_documented() -> None:
    s = spec(
        UNIFIED,
        pod=POD,
        router={
            "nodeSelector": {"role": "edge"},
            "tolerations": [{"key": "edge", "operator": "Exists"}],
            "resources": {"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}},
        },
    )
    template = router_pod(s)
    pod, router = template["spec"], template["spec"]["containers"][0]
    assert pod["nodeSelector"] == {"role": "edge"}  # spec.pod.nodeSelector targets GPU nodes: not the router's
    assert pod["tolerations"] == [POD["tolerations"][0], {"key": "edge", "operator": "Exists"}]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and pod["priorityClassName"] == "high"
    assert router["resources"] == {"requests": {"cpu": "1", "memory": "256Mi"}, "limits": {"memory": "2Gi"}}
    for absent in ("affinity", "runtimeClassName"):
        assert absent not in pod
    # its own spread (across nodes, then zones), never spec.pod's
    assert [c["topologyKey"] for c in pod["topologySpreadConstraints"]] == [
        "kubernetes.io/hostname",
        "topology.kubernetes.io/zone",
    ]
    assert "envFrom" not in router and [v["name"] for v in pod["volumes"]] == ["tmp"]
    assert [e["name"] for e in router["env"]] == ["HOME"]
    assert pod["securityContext"] == pod_security_context()
    assert router["securityContext"] == container_security_context()


def test_router_defaults_unchanged_without_overrides() -> None:
    template = router_pod(spec(UNIFIED))
    assert template["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "250m", "memory": "256Mi"},
        "limits": {"memory": "1Gi"},
    }
    assert not {"nodeSelector", "tolerations", "imagePullSecrets"} & set(template["spec"])


def test_pool_pod_merges_over_spec_pod() -> None:
    pool_pod = {
        "env": [{"name": "HTTPS_PROXY", "value": "http://decode-proxy:3128"}, {"name": "ROLE_HINT", "value": "d"}],
        "volumeMounts": [{"name": "fast-scratch", "mountPath": "/fast"}],  # a pool mounts what spec.pod declares
        "nodeSelector": {"pool": "decode-gpu", "extra": "yes"},
        "tolerations": [{"key": "decode", "operator": "Exists"}],
        "priorityClassName": "decode-high",
        "resources": {"limits": {"cpu": "16"}},
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": "h"}]}},
    }
    pod = {**POD, "volumes": [*POD["volumes"], {"name": "fast-scratch", "emptyDir": {"medium": "Memory"}}]}
    s = spec(DISAGG, pod=pod, pools__decode__pod=pool_pod)
    pods = {t["metadata"]["labels"]["tidepool.dev/pool"]: t["spec"] for t in engine_pods(s)}
    prefill, decode = pods["prefill"], pods["decode"]
    env = [(e["name"], e.get("value")) for e in decode["containers"][0]["env"] if e["name"] not in ("HOME", "HF_HOME")]
    # Named lists: the pool's entry replaces the global one in place, new ones append.
    assert env == [("HTTPS_PROXY", "http://decode-proxy:3128"), ("HF_TOKEN", None), ("ROLE_HINT", "d")]
    assert {v["name"]: v for v in decode["volumes"]}["fast-scratch"]["emptyDir"] == {"medium": "Memory"}
    assert "/fast" in {m["mountPath"] for m in decode["containers"][0]["volumeMounts"]}
    assert "/fast" not in {m["mountPath"] for m in prefill["containers"][0]["volumeMounts"]}
    assert decode["nodeSelector"] == {"pool": "decode-gpu", "extra": "yes"}  # maps merge, the pool's key wins
    assert decode["tolerations"][-2:] == [POD["tolerations"][0], {"key": "decode", "operator": "Exists"}]
    assert decode["priorityClassName"] == "decode-high"  # scalars replace
    limits = decode["containers"][0]["resources"]["limits"]
    assert limits["cpu"] == "16" and limits["ephemeral-storage"] == "40Gi"  # resources merge per key
    # affinity merges per kind: the global nodeAffinity stays, the pool adds podAntiAffinity.
    assert set(decode["affinity"]) == {"nodeAffinity", "podAntiAffinity"}
    # The other pool sees spec.pod only.
    assert prefill["priorityClassName"] == "high" and prefill["nodeSelector"] == {"pool": "gpu"}
    assert "podAntiAffinity" not in prefill["affinity"]
    assert {e["name"]: e.get("value") for e in prefill["containers"][0]["env"]}["HTTPS_PROXY"] == "http://proxy:3128"


def test_merge_pod_is_the_identity_without_a_pool_override() -> None:
    base = PodOverrides.model_validate(POD)
    assert merge_pod(base, None) == base
    assert merge_pod(base, PodOverrides()) == base
    assert merge_pod(PodOverrides(), base) == base


def test_pool_mount_may_name_a_global_volume() -> None:
    s = spec(
        DISAGG,
        pod={"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}}]},
        pools__prefill__pod={"volumeMounts": [{"name": "data", "mountPath": "/data"}]},
    )
    pods = {t["metadata"]["labels"]["tidepool.dev/pool"]: t["spec"]["containers"][0] for t in engine_pods(s)}
    assert "/data" in {m["mountPath"] for m in pods["prefill"]["volumeMounts"]}
    assert "/data" not in {m["mountPath"] for m in pods["decode"]["volumeMounts"]}


def test_request_above_its_limit_is_refused_before_anything_is_built() -> None:
    s = spec(UNIFIED, pod={"resources": {"limits": {"memory": "8Gi"}}})  # spec.resources.memory requests 16Gi
    with pytest.raises(SpecError, match=r"pools\.unified: a container request is above its limit"):
        build(s)


def test_every_env_volume_and_mount_the_builders_render_is_reserved() -> None:
    """The reserved names in api/pod.py cover what the engine pods actually carry (one list, checked here)."""
    for base, features in FEATURES.values():
        for template in engine_pods(spec(base, model={"uri": "pvc://weights/llama"}), features):
            pod, engine = template["spec"], template["spec"]["containers"][0]
            assert all(api_pod.reserved_env(e["name"]) for e in engine["env"]), engine["env"]
            assert all(api_pod.reserved_volume(v["name"]) for v in pod["volumes"]), pod["volumes"]
            assert all(api_pod.reserved_mount(m["mountPath"]) for m in engine["volumeMounts"])
    # LeaderWorkerSet injects its env at admission: the prefix covers what the args reference.
    lws = engine_pods(spec(MULTI_NODE), ClusterFeatures(has_lws=True))[0]["spec"]["containers"][0]["args"]
    assert any("$(LWS_" in a for a in lws) and api_pod.reserved_env("LWS_LEADER_ADDRESS")


@pytest.mark.parametrize(
    ("pod", "message"),
    [
        ({"env": [{"name": "HF_HOME", "value": "/x"}]}, "pod.env must not set a variable the operator sets itself"),
        ({"env": [{"name": "LWS_WORKER_INDEX", "value": "0"}]}, "LWS_*"),
        ({"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}, "NVIDIA_VISIBLE_DEVICES"),
        ({"volumes": [{"name": "d", "hostPath": {"path": "/var/lib"}}]}, "hostPath volumes are refused"),
        ({"volumes": [{"name": "d", "emptyDir": {}, "secret": {"secretName": "s"}}]}, "exactly one source"),
        ({"volumes": [{"name": "pvc-0123456789", "emptyDir": {}}]}, "pvc-<10 hex digits>"),
        ({"volumes": [{"name": "dshm", "emptyDir": {}}]}, "volume name the operator uses"),
        (
            {"volumes": [{"name": "d", "emptyDir": {}}], "volumeMounts": [{"name": "d", "mountPath": "/tmp"}]},
            "at or under a path the operator mounts (/tmp, /dev/shm, /models, /etc/tidepool/control-key, /etc/",
        ),
        (
            {
                "volumes": [{"name": "d", "emptyDir": {}}],
                "volumeMounts": [{"name": "d", "mountPath": "/models/x"}],
            },
            "at or under",
        ),
        ({"hostPID": True}, "hostNetwork, hostPID and hostIPC are refused"),
        ({"resources": {"limits": {"nvidia.com/gpu": "1"}}}, "its count follows resources.gpusPerReplica"),
        ({"resources": {"requests": {"rdma/hca": "1"}}}, "an extended resource (a name with '/') cannot be"),
        ({"resources": {"claims": [{"name": "gpus"}]}}, "pod.resources.claims must name a pod.resourceClaims"),
        ({"labels": {"tidepool.dev/pool": "x"}}, "pod.labels must not set a label the operator sets itself"),
        ({"annotations": {"tidepool.dev/x": "y"}}, "pod.annotations must not use the operator's prefix"),
    ],
)
def test_refusals_name_the_fix(pod: dict[str, Any], message: str) -> None:
    # The same rules hold for a pool's own override; volumes only spec.pod declares (see the next test).
    for where in ("pod",) if "volumes" in pod else ("pod", "pools__unified__pod"):
        model = InferenceServiceSpec.model_validate(spec(UNIFIED, **{where: pod}))
        problems = validate_spec(model)
        assert any(message in p for p in problems), (where, problems)
        with pytest.raises(SpecError, match=r"refused|must|need|follow"):
            build(model.to_wire())


def test_a_pool_declares_no_volumes_of_its_own() -> None:
    """pools.<name>.pod is spec.pod's shape but volumes (one copy of the volume sources keeps the CRD within what
    client-side apply can store): the models refuse it as the API server's strict field validation does."""
    with pytest.raises(ValidationError, match=r"pools\.unified\.pod\.volumes"):
        InferenceServiceSpec.model_validate(
            spec(UNIFIED, pools__unified__pod={"volumes": [{"name": "d", "emptyDir": {}}]})
        )
    with pytest.raises(SpecError, match=r"must be a volume of spec\.pod\.volumes"):
        build(spec(UNIFIED, pools__unified__pod={"volumeMounts": [{"name": "d", "mountPath": "/d"}]}))


def test_fields_outside_the_schema_are_refused_by_the_models() -> None:
    """The API server prunes unknown fields; a body that skipped it (a test, a dry run) is refused outright."""
    for pod in (
        {"securityContext": {"privileged": True}},
        {"volumes": [{"name": "d", "nfs": {"server": "s", "path": "/"}}]},
        {"env": [{"name": "A", "value": "1", "privileged": True}]},
    ):
        body = copy.deepcopy(UNIFIED)
        body["pod"] = pod
        with pytest.raises(ValidationError):
            InferenceServiceSpec.model_validate(body)


def test_allowed_volume_sources_are_exactly_the_restricted_profiles() -> None:
    """Pod Security 'restricted' (and 'baseline') allow these inline sources; nothing else has a field."""
    from tidepool.operator.api.kube import VOLUME_SOURCES

    assert set(VOLUME_SOURCES) == {
        "config_map",
        "secret",
        "empty_dir",
        "persistent_volume_claim",
        "projected",
        "downward_api",
        "csi",
        "ephemeral",
    }


def test_the_sample_renders_what_its_comments_say() -> None:
    body = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "examples/inferenceservice-pod-overrides.yaml").read_text()
    )
    model = InferenceServiceSpec.model_validate(body["spec"])
    assert validate_spec(model, body["metadata"]["name"]) == []
    pods = {t["metadata"]["labels"]["tidepool.dev/pool"]: t["spec"] for t in engine_pods(model.to_wire())}
    assert pods["decode"]["nodeSelector"]["node.kubernetes.io/instance-type"] == "gpu-large"
    assert "node.kubernetes.io/instance-type" not in pods["prefill"].get("nodeSelector", {})
    assert pods["decode"]["containers"][0]["resources"]["limits"]["cpu"] == "8"
    assert pods["prefill"]["containers"][0]["resources"]["limits"]["cpu"] == "4"
    for pod in pods.values():
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
        assert "/etc/ssl/corporate" in {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}


def test_rendered_overrides_leave_out_what_the_api_server_omits() -> None:
    """false, "" and empty lists are dropped by the API server; rendering them would make every reconcile
    see a difference and write again."""
    pod = {
        "env": [{"name": "EMPTY", "value": ""}],
        "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "c", "readOnly": False}}],
        "volumeMounts": [{"name": "d", "mountPath": "/d", "readOnly": False}],
    }
    (template,) = engine_pods(spec(UNIFIED, pod=pod))
    engine = template["spec"]["containers"][0]
    assert {"name": "EMPTY"} in engine["env"]
    assert {"name": "d", "mountPath": "/d"} in engine["volumeMounts"]
    assert {"name": "d", "persistentVolumeClaim": {"claimName": "c"}} in template["spec"]["volumes"]


def test_a_spec_the_api_server_would_refuse_is_refused_by_the_operator_with_a_condition() -> None:
    """A request above its limit once spec.resources and pod.resources are merged (refused at admission, but an
    object may predate the rule): the operator refuses the spec (Degraded, InvalidSpec, the rule's message
    saying what to change) and applies nothing."""
    api, ctrl = with_controller({**SPEC, "pod": {"resources": {"limits": {"memory": "512Mi"}}}})  # requests 1Gi
    asyncio.run(ctrl.services.sync((NS, NAME), False))
    assert api.calls["apply"] == 0
    degraded = api.condition("Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert "pools.unified: a container request is above its limit" in degraded["message"]
