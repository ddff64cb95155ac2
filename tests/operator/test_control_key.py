"""The control channel's key of a multi-node pool: its Secret, the pods that mount it, and the plan that creates it.

Every rank of a multi-node pool (StatefulSet groups or a LeaderWorkerSet's leader and workers) must find the
key file the engine reads (contract/wire.py); single-node pools get nothing. The plan creates each Secret with
fresh random bytes once and keeps an existing one (AlreadyExists), so a second plan, a resync or a spec edit
never changes the key the running ranks read.
"""

from __future__ import annotations

import asyncio
import copy
import posixpath
from pathlib import Path
from typing import Any

import pytest
from fake_api import NS, FakeApi

from tidepool.contract.wire import CONTROL_KEY_FILE_ENV, CONTROL_KEY_MOUNT_PATH, MIN_KEY_BYTES, read_key_file
from tidepool.operator.api import InferenceServiceSpec
from tidepool.operator.builders import ClusterFeatures, ServiceView, desired_state
from tidepool.operator.cache import Store
from tidepool.operator.controller import Controller, ControllerOptions
from tidepool.operator.k8s import ApiError
from tidepool.operator.reconcile import owner_reference, plan

NAME = "svc"
WORKLOADS = ("Deployment", "StatefulSet", "LeaderWorkerSet")
BASE: dict[str, Any] = {"model": {"uri": "hf://org/model"}, "engine": {"image": "tidepool:test"}}
MULTI_NODE = {**BASE, "parallelism": {"tensor": 2, "pipeline": 2}, "resources": {"gpusPerReplica": 4}}
MULTI_NODE_DISAGG = {
    **MULTI_NODE,
    "mode": "disaggregated",
    "pools": {"prefill": {"replicas": 2}, "decode": {"replicas": 1}},
}
CPU_MULTI_NODE = {**BASE, "parallelism": {"pipeline": 3}, "resources": {"gpusPerReplica": 0}}
SINGLE_NODE = {**BASE, "parallelism": {"tensor": 2}, "resources": {"gpusPerReplica": 2}}


def children(spec: dict[str, Any], features: ClusterFeatures | None = None) -> list[dict[str, Any]]:
    view = ServiceView.from_spec(InferenceServiceSpec.model_validate(spec).to_wire())
    return desired_state(NAME, NS, view, features, owner=owner_reference(NAME, "uid-1")).children


def templates(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(pool, pod template) of every workload; a LeaderWorkerSet's leaders and workers share workerTemplate."""
    out = []
    for obj in objs:
        if obj["kind"] == "LeaderWorkerSet":
            assert "leaderTemplate" not in obj["spec"]["leaderWorkerTemplate"]  # the leader runs the same template
            template = obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]
        elif obj["kind"] in WORKLOADS:
            template = obj["spec"]["template"]
        else:
            continue
        out.append((obj["metadata"]["labels"]["tidepool.dev/pool"], template))
    return out


def secrets_of(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == "Secret"}


@pytest.mark.parametrize(
    ("spec", "lws", "workload", "pools"),
    [
        (MULTI_NODE, False, "StatefulSet", ["unified"]),
        (MULTI_NODE, True, "LeaderWorkerSet", ["unified"]),
        (MULTI_NODE_DISAGG, False, "StatefulSet", ["decode", "prefill"]),
        (MULTI_NODE_DISAGG, True, "LeaderWorkerSet", ["decode", "prefill"]),
        (CPU_MULTI_NODE, True, "LeaderWorkerSet", ["unified"]),
    ],
)
def test_every_rank_of_a_multi_node_pool_mounts_its_pools_key(
    spec: dict[str, Any], lws: bool, workload: str, pools: list[str]
) -> None:
    objs = children(spec, ClusterFeatures(has_lws=lws))
    found = templates(objs)
    assert {o["kind"] for o in objs if o["kind"] in WORKLOADS} == {workload, "Deployment"}  # + the router's
    assert {pool for pool, _ in found} == {*pools, "router"}
    names = {f"{NAME}-{pool}-control-key" for pool in pools}
    assert set(secrets_of(objs)) == names
    for pool, template in found:
        if pool == "router":
            assert not any("secret" in v for v in template["spec"].get("volumes", []))
            continue
        (engine,) = [c for c in template["spec"]["containers"] if c["name"] == "engine"]
        env = {e["name"]: e for e in engine["env"]}
        assert env[CONTROL_KEY_FILE_ENV] == {"name": CONTROL_KEY_FILE_ENV, "value": CONTROL_KEY_MOUNT_PATH}
        (mount,) = [m for m in engine["volumeMounts"] if CONTROL_KEY_MOUNT_PATH.startswith(m["mountPath"] + "/")]
        assert mount["readOnly"] is True
        (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == mount["name"]]
        item = posixpath.relpath(CONTROL_KEY_MOUNT_PATH, mount["mountPath"])
        assert volume == {
            "name": mount["name"],
            "secret": {"secretName": f"{NAME}-{pool}-control-key", "defaultMode": 0o400},
        }
        assert "items" not in volume["secret"] and item == "key"  # the Secret's one key is the file's name
        for init in template["spec"].get("initContainers", []):  # the model download never sees the key
            assert mount["name"] not in {m["name"] for m in init.get("volumeMounts", [])}
            assert CONTROL_KEY_FILE_ENV not in {e["name"] for e in init.get("env", [])}


def test_the_secret_is_owned_by_the_service_and_carries_no_key_from_the_builders() -> None:
    objs = children(MULTI_NODE)
    (secret,) = secrets_of(objs).values()
    assert secret["metadata"]["ownerReferences"] == [owner_reference(NAME, "uid-1")]
    assert secret["metadata"]["namespace"] == NS and secret["type"] == "Opaque" and secret["immutable"] is True
    assert "data" not in secret and "stringData" not in secret  # builders are pure: the plan draws the key
    assert children(MULTI_NODE) == objs  # and so the same spec renders the same children


@pytest.mark.parametrize("spec", [SINGLE_NODE, BASE, {**BASE, "resources": {"gpusPerReplica": 0}}])
def test_single_node_pools_get_no_key(spec: dict[str, Any]) -> None:
    objs = children(spec, ClusterFeatures(has_lws=True))
    assert not secrets_of(objs)
    for _, template in templates(objs):
        for container in template["spec"]["containers"]:
            assert CONTROL_KEY_FILE_ENV not in {e["name"] for e in container.get("env", [])}
            assert not any(m["mountPath"].startswith("/etc/tidepool") for m in container.get("volumeMounts", []))
        assert not any("secret" in v for v in template["spec"]["volumes"])


def test_changing_pipeline_rolls_the_pool_with_the_key_added_or_removed() -> None:
    def engine_hash(spec: dict[str, Any]) -> str:
        (template,) = [t for pool, t in templates(children(spec, ClusterFeatures(has_lws=True))) if pool != "router"]
        return template["metadata"]["labels"]["tidepool.dev/spec-hash"]

    assert engine_hash(MULTI_NODE) != engine_hash(SINGLE_NODE)


# --- the plan: create once, keep what exists ----------------------------------------------------------------


class SecretApi(FakeApi):
    """FakeApi that keeps Secrets as the API server does: a create of an existing name is 409 AlreadyExists."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse_create: ApiError | None = None

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] != "Secret":
            return await super().create(obj)
        self.calls["create_secret"] += 1
        if self.refuse_create is not None:
            raise self.refuse_create
        key = (obj["kind"], obj["metadata"]["name"])
        if key in self.objects:
            raise ApiError(409, f'secrets "{key[1]}" already exists', "AlreadyExists")
        stored = copy.deepcopy(obj)
        stored["data"] = {k: v.encode() for k, v in stored.pop("stringData").items()}  # the bytes, not base64
        self.objects[key] = stored
        return copy.deepcopy(stored)

    def key(self, name: str) -> bytes:
        return self.objects[("Secret", name)]["data"]["key"]


def execute(api: SecretApi, objs: list[dict[str, Any]]) -> str | None:
    todo = plan(objs, {}, "uid-1")
    _, error = asyncio.run(todo.execute(api, Store(lambda *_: None), {}, (NAME, "uid-1")))  # type: ignore[arg-type]
    return error


def test_the_plan_creates_each_key_once_and_never_applies_it(tmp_path: Path) -> None:
    objs = children(MULTI_NODE_DISAGG)
    todo = plan(objs, {}, "uid-1")
    assert sorted(o["metadata"]["name"] for o in todo.create) == [
        f"{NAME}-decode-control-key",
        f"{NAME}-prefill-control-key",
    ]
    assert not [o for o in todo.apply if o["kind"] == "Secret"]
    assert all("Secret/" not in message for _, _, message in todo.events)  # created every time: no event claims it

    api = SecretApi()
    assert execute(api, objs) is None
    keys = {name: api.key(name) for name in secrets_of(objs)}
    assert len(set(keys.values())) == 2  # one key per pool, each drawn afresh
    for name, key in keys.items():
        (tmp_path / name).write_bytes(key)  # what the ranks read from the mounted file
        assert read_key_file(str(tmp_path / name)) == key and len(key) >= MIN_KEY_BYTES
        assert api.objects[("Secret", name)]["metadata"]["ownerReferences"] == [owner_reference(NAME, "uid-1")]

    assert execute(api, children(MULTI_NODE_DISAGG)) is None  # AlreadyExists is done
    assert {name: api.key(name) for name in keys} == keys
    assert api.calls["create_secret"] == 4 and api.calls["apply"] == 2 * len([o for o in objs if o["kind"] != "Secret"])


def test_a_refused_create_is_an_error_and_a_transient_one_is_retried() -> None:
    api = SecretApi()
    api.refuse_create = ApiError(403, 'secrets is forbidden: cannot create resource "secrets"', "Forbidden")
    error = execute(api, children(MULTI_NODE))
    assert error is not None and error.startswith(f"creating Secret {NAME}-unified-control-key: secrets is forbidden")
    assert api.calls["apply"] > 0  # the rest is still applied; status says what failed
    api.refuse_create = ApiError(503, "etcd is unavailable", "ServiceUnavailable")
    with pytest.raises(ApiError, match="etcd"):
        execute(api, children(MULTI_NODE))


def test_the_controller_keeps_the_key_across_resyncs_and_spec_edits() -> None:
    api = SecretApi()
    ctrl = Controller(api, ControllerOptions(), [NS])  # type: ignore[arg-type]
    api.store = ctrl.store
    api.put_service(MULTI_NODE)
    name = f"{NAME}-unified-control-key"
    asyncio.run(ctrl.services.sync((NS, NAME)))
    key = api.key(name)
    asyncio.run(ctrl.services.sync((NS, NAME)))  # the fast path: nothing built, nothing created
    assert api.calls["create_secret"] == 1
    asyncio.run(ctrl.services.sync((NS, NAME), True))  # the resync: created again, AlreadyExists
    edited = copy.deepcopy(MULTI_NODE)
    edited["engine"]["maxNumSeqs"] = 64
    api.put_service(edited, generation=2)
    asyncio.run(ctrl.services.sync((NS, NAME)))
    assert api.calls["create_secret"] == 3 and api.key(name) == key
    assert "Degraded" not in {c["type"] for c in api.service()["status"]["conditions"] if c["status"] == "True"}
