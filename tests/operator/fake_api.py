"""An in-memory stand-in for the API server and the informers, for controller unit tests.

`FakeApi` implements the KubeClient verbs the controller uses (apply, delete, patch_status,
patch_merge, create, has_kind) on a dict of objects with resourceVersions and generations, and
echoes every write into a `Store`, as the informers would. Workload status is what a Deployment
controller reports once it has seen the generation; pods are added by the test (`add_pod`).
Counts every request by verb, so tests can assert that nothing was written.
"""

from __future__ import annotations

import copy
import itertools
import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from tidepool.operator.controller import Controller, ControllerOptions
from tidepool.operator.k8s import ApiError

NS, NAME, UID = "ns", "svc", "uid-1"
SPEC: dict[str, Any] = {
    "model": {"uri": "hf://org/model"},
    "resources": {"gpusPerReplica": 1, "cpu": "0.5", "memory": "1024Mi"},
    "mode": "unified",
    "pools": {"unified": {"replicas": 2, "minReplicas": 1, "maxReplicas": 4}},
}


class FakeApi:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}  # (kind, name) -> object
        self.rv = itertools.count(100)
        self.calls: Counter[str] = Counter()
        self.events: list[dict[str, Any]] = []
        self.status_patches: list[dict[str, Any]] = []
        self.store = None  # set by the test: writes are echoed into it like watch events
        self.fail_apply: set[str] = set()  # kinds whose apply the server refuses (422)
        self.conflict_next_status = False

    def _echo(self, obj: dict[str, Any]) -> None:
        if self.store is not None:
            self.store.put(copy.deepcopy(obj))

    def _bump(self, obj: dict[str, Any]) -> None:
        obj["metadata"]["resourceVersion"] = str(next(self.rv))

    # ---- the service -------------------------------------------------------------------------
    def put_service(self, spec: dict[str, Any] = SPEC, generation: int = 1, **meta: Any) -> dict[str, Any]:
        old = self.objects.get(("InferenceService", NAME))
        obj = {
            "apiVersion": "tidepool.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": NAME, "namespace": NS, "uid": UID, "generation": generation, **meta},
            "spec": copy.deepcopy(spec),
            "status": copy.deepcopy((old or {}).get("status") or {}),
        }
        self._bump(obj)
        self.objects[("InferenceService", NAME)] = obj
        self._echo(obj)
        return obj

    def service(self) -> dict[str, Any]:
        return self.objects[("InferenceService", NAME)]

    # ---- KubeClient verbs --------------------------------------------------------------------
    async def apply(self, obj: dict[str, Any], force: bool = True) -> dict[str, Any]:
        self.calls["apply"] += 1
        if obj["kind"] in self.fail_apply:
            raise ApiError(422, f"{obj['kind']} is invalid: admission refused it", "Invalid")
        key = (obj["kind"], obj["metadata"]["name"])
        old = self.objects.get(key)
        if old is not None and "roleRef" in old and old["roleRef"] != obj.get("roleRef"):  # as the API server
            raise ApiError(422, f"{obj['kind']} is invalid: roleRef: Invalid value: cannot change roleRef", "Invalid")
        stored = copy.deepcopy(obj)
        stored["metadata"]["uid"] = f"uid-{key[0]}-{key[1]}"
        spec_changed = old is None or json.dumps(old.get("spec"), sort_keys=True) != json.dumps(obj.get("spec"))
        generation = (old["metadata"]["generation"] if old else 0) + (1 if spec_changed else 0)
        stored["metadata"]["generation"] = generation
        if obj["kind"] in ("Deployment", "StatefulSet"):
            stored["status"] = {"observedGeneration": generation}
        self._bump(stored)
        self.objects[key] = stored
        self._echo(stored)
        return copy.deepcopy(stored)

    async def delete(self, obj: dict[str, Any]) -> None:
        self.calls["delete"] += 1
        gone = self.objects.pop((obj["kind"], obj["metadata"]["name"]), None)
        if gone is not None and self.store is not None:
            self._bump(gone)
            self.store.delete(gone)

    async def patch_status(
        self, kind: str, namespace: str, name: str, status: dict[str, Any], resource_version: str | None = None
    ) -> dict[str, Any]:
        self.calls["patch_status"] += 1
        obj = self.objects[(kind, name)]
        if self.conflict_next_status or (resource_version and resource_version != obj["metadata"]["resourceVersion"]):
            self.conflict_next_status = False
            raise ApiError(409, "the object has been modified", "Conflict")
        self.status_patches.append(copy.deepcopy(status))
        merged = obj.setdefault("status", {})
        _merge(merged, copy.deepcopy(status))
        self._bump(obj)
        self._echo(obj)
        return copy.deepcopy(obj)

    async def patch_merge(self, kind: str, namespace: str, name: str, body: dict[str, Any], sub=None) -> dict:
        self.calls["patch_merge"] += 1
        obj = self.objects[(kind, name)]
        body = copy.deepcopy(body)
        rv = body.get("metadata", {}).pop("resourceVersion", None)
        if rv and rv != obj["metadata"]["resourceVersion"]:
            raise ApiError(409, "the object has been modified", "Conflict")
        _merge(obj, body)
        self._bump(obj)
        self._echo(obj)
        return copy.deepcopy(obj)

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.calls["create"] += 1
        if obj["kind"] == "Event":
            self.events.append(obj)
        if obj["kind"] == "PersistentVolumeClaim":  # kept as the API server does: a second create is 409
            key = (obj["kind"], obj["metadata"]["name"])
            if key in self.objects:
                raise ApiError(409, f"persistentvolumeclaims {key[1]!r} already exists", "AlreadyExists")
            stored = copy.deepcopy(obj)
            stored["metadata"]["uid"] = f"uid-{key[0]}-{key[1]}"
            self._bump(stored)
            self.objects[key] = stored
            self._echo(stored)
            return copy.deepcopy(stored)
        return obj

    async def has_kind(self, group_version: str, kind: str) -> bool:
        return False

    # ---- what controllers and kubelets would do ----------------------------------------------
    def add_pod(self, name: str, pool: str, spec_hash: str, ready: bool = True, **extra: Any) -> dict[str, Any]:
        labels = {
            "tidepool.dev/inferenceservice": NAME,
            "tidepool.dev/pool": pool,
            "tidepool.dev/spec-hash": spec_hash,
            "app.kubernetes.io/managed-by": "tidepool-operator",
        }
        conditions = [{"type": "Ready", "status": "True" if ready else "False"}, *extra.pop("conditions", [])]
        pod = {
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": labels, "resourceVersion": str(next(self.rv))},
            "status": {"phase": "Running" if ready else "Pending", "conditions": conditions, "podIP": "10.0.0.1"},
        }
        pod["status"].update(extra)
        self.objects[("Pod", name)] = pod
        self._echo(pod)
        return pod

    def remove_pod(self, name: str) -> None:
        pod = self.objects.pop(("Pod", name))
        self._bump(pod)
        if self.store is not None:
            self.store.delete(pod)

    def hash_of(self, workload: str) -> str:
        return self.objects[("Deployment", workload)]["spec"]["template"]["metadata"]["labels"][
            "tidepool.dev/spec-hash"
        ]

    def condition(self, type_: str) -> dict[str, Any]:
        return next(c for c in self.service()["status"]["conditions"] if c["type"] == type_)


def _merge(into: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if value is None:
            into.pop(key, None)
        elif isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def with_controller(
    spec: dict[str, Any] = SPEC, clock: Callable[[], float] = time.monotonic, **meta: Any
) -> tuple[FakeApi, Controller]:
    """A FakeApi holding the service `spec`, and a Controller (production options) whose cache it feeds."""
    api = FakeApi()
    ctrl = Controller(api, ControllerOptions(), [NS], clock)  # type: ignore[arg-type]
    api.store = ctrl.store
    api.put_service(spec, **meta)
    return api, ctrl
