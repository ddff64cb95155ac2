"""In-memory caches of InferenceServices and their children, fed by label-selected watches.

The controller never LISTs per reconcile: one `Informer` per kind (and per watched namespace) LISTs
once (paged), then WATCHes from the list's resourceVersion with bookmarks, reconnecting from the last
version it saw and re-listing only when the server answers 410 Gone. Children are selected on the
server by `CHILD_SELECTOR` (labels every child and pod of ours carries), so the operator never
receives other Deployments or Pods of the cluster, in all-namespace mode too.

`Store` keeps what the controller reads, compactly (1,000 services are ~10,000 children and ~2,000
pods): a child as JSON bytes without managedFields (and without status where nothing reads it),
plus the few fields read on every event; a pod as a `PodInfo` summary (a finished pod, Failed or
Succeeded, is kept for its problems but is not live: nothing counts it). An event whose stored form is
unchanged (a PDB's status, our own write echoed back) is dropped without waking the controller.

Invariants: a stored object is replaced only by one with a newer resourceVersion (when both are the
integers etcd issues), so the write-through of an apply response is never undone by the late watch
event of an older version; `on_change(namespace, service, full)` is called for every stored change of
an object labelled with that service (or of the InferenceService itself), and with full=True for the
other services in a changed child's ownerReferences (a shared claim: their fast path cannot see it,
so they compare it in full); a child is stored once, under the service its label names now (a
relabelled child moves, and both services hear of it), and `find` reaches it by kind and name
whatever its label (a cache claim several services share).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tidepool.operator.builders import LABEL_POOL, LABEL_SERVICE, LABEL_SPEC_HASH, MANAGED_BY
from tidepool.operator.builders.lora import LORA_GATE
from tidepool.operator.k8s import ApiError, KubeClient
from tidepool.operator.pod_problems import FINISHED_PHASES, download_started, problems_of, stopped_at

logger = logging.getLogger("tidepool.operator.cache")

CHILD_SELECTOR = f"app.kubernetes.io/managed-by={MANAGED_BY},{LABEL_SERVICE}"
SERVICE_KIND = "InferenceService"
# Kinds whose status the controller reads; other children are stored without it.
KEEP_STATUS = {"Deployment", "StatefulSet", "LeaderWorkerSet", "PersistentVolumeClaim", SERVICE_KIND}
# Kinds whose metadata.generation moves exactly when their spec does (status updates do not; an
# InferencePool's status is written by the gateways that reference it).
GENERATION_KINDS = {"Deployment", "StatefulSet", "LeaderWorkerSet", "PodDisruptionBudget", "InferencePool"}
GROUP_LABELS = ("tidepool.dev/group-index", "leaderworkerset.sigs.k8s.io/group-index")
RANK_LABELS = ("apps.kubernetes.io/pod-index", "leaderworkerset.sigs.k8s.io/worker-index")
DROPPED_ANNOTATIONS = ("kubectl.kubernetes.io/last-applied-configuration",)
MAX_TOMBSTONES = 10_000

Key = tuple[str, str]  # (namespace, name)


@dataclass(slots=True)
class Cached:
    """One object as last seen: hot fields parsed, the rest as compact JSON (`body()` parses it)."""

    kind: str
    namespace: str
    name: str
    uid: str
    owner: str  # the InferenceService it belongs to (its label; its own name for an InferenceService)
    owner_uids: tuple[str, ...]
    co_owners: tuple[str, ...]  # other InferenceServices in its ownerReferences (a shared cache claim)
    resource_version: str
    version: str  # changes when anything the operator sets may have changed
    raw: bytes

    def body(self) -> dict[str, Any]:
        obj = json.loads(self.raw)
        obj["metadata"]["resourceVersion"] = self.resource_version
        return obj


@dataclass(frozen=True, slots=True)
class PodInfo:
    """What the controller reads of a pod: readiness per template hash, problems, its address."""

    name: str
    pool: str
    spec_hash: str
    group: str | None  # the replica a multi-node pod belongs to (None: the pod is a replica)
    rank: int  # its rank within the replica (0: the leader, which serves HTTP and metrics)
    is_ready: bool
    is_terminating: bool  # being deleted (deletionTimestamp)
    ip: str | None
    problems: tuple[tuple[str, str], ...]  # (reason, message): InsufficientCapacity, Evicted, ImagePullBackOff, ...
    downloading_since: str | None = None  # its model download runs, started then (RFC 3339)
    is_serving: bool = False  # its containers are ready (it answers HTTP), whatever its readiness gates say
    lora_gate: bool | None = None  # the LoRA readiness gate's condition (None: the pod has no such gate)
    is_finished: bool = False  # phase Failed or Succeeded (evicted, node shutdown): it never runs again
    created: str = ""  # metadata.creationTimestamp (RFC 3339, compares as text)
    finished_at: str | None = None  # a finished pod: when it stopped (its conditions' latest transition)

    @property
    def is_live(self) -> bool:
        """Counts as (part of) a replica: neither being deleted nor finished. A finished pod stays in the API
        until deleted or garbage-collected while its workload controller has already replaced it."""
        return not self.is_terminating and not self.is_finished


def pod_info(obj: dict[str, Any]) -> PodInfo:
    meta, status = obj["metadata"], obj.get("status") or {}
    labels = meta.get("labels") or {}
    conditions = status.get("conditions") or []
    finished = status.get("phase") in FINISHED_PHASES
    # scheduling (told apart), failed downloads, image pulls, crash loops; an eviction
    problems = problems_of(obj.get("spec") or {}, status)
    group = next((labels[g] for g in GROUP_LABELS if g in labels), None)
    rank = next((labels[r] for r in RANK_LABELS if r in labels), "0") if group is not None else "0"
    running = status.get("phase") == "Running"
    ready = running and any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    gates = [g.get("conditionType") for g in (obj.get("spec") or {}).get("readinessGates") or []]
    lora_gate = None
    if LORA_GATE in gates:
        lora_gate = any(c.get("type") == LORA_GATE and c.get("status") == "True" for c in conditions)
    return PodInfo(
        name=meta["name"],
        pool=labels.get(LABEL_POOL, "?"),
        spec_hash=labels.get(LABEL_SPEC_HASH, ""),
        group=group,
        rank=int(rank) if rank.isdigit() else 0,
        is_ready=ready and not meta.get("deletionTimestamp"),
        is_terminating=bool(meta.get("deletionTimestamp")),
        ip=status.get("podIP"),
        problems=tuple(problems),
        downloading_since=None if finished else download_started(status),
        is_serving=running and _containers_ready(conditions) and not meta.get("deletionTimestamp"),
        lora_gate=lora_gate,
        is_finished=finished,
        created=meta.get("creationTimestamp") or "",
        finished_at=(stopped_at(status) or meta.get("creationTimestamp")) if finished else None,
    )


def _containers_ready(conditions: list[dict[str, Any]]) -> bool:
    return any(c.get("type") == "ContainersReady" and c.get("status") == "True" for c in conditions)


def _newer(new_rv: str, old_rv: str) -> bool:
    """Is new_rv at least as new as old_rv? Unknown formats count as newer (never block an update)."""
    try:
        return int(new_rv) >= int(old_rv)
    except ValueError:
        return True


def compact(obj: dict[str, Any]) -> Cached:
    kind, meta = obj["kind"], obj["metadata"]
    slim = dict(obj)
    slim_meta = {k: v for k, v in meta.items() if k not in ("managedFields", "resourceVersion")}
    annotations = slim_meta.get("annotations")
    if annotations and any(a in annotations for a in DROPPED_ANNOTATIONS):
        slim_meta["annotations"] = {k: v for k, v in annotations.items() if k not in DROPPED_ANNOTATIONS}
    slim["metadata"] = slim_meta
    if kind not in KEEP_STATUS:
        slim.pop("status", None)
    labels = meta.get("labels") or {}
    raw = json.dumps(slim, separators=(",", ":"), sort_keys=True).encode()
    rv = meta.get("resourceVersion", "")
    # Workloads and PDBs: status churn leaves generation alone; labels count (selectors, spec hash).
    version = f"g{meta.get('generation', 0)}:{json.dumps(labels, sort_keys=True)}" if kind in GENERATION_KINDS else rv
    owner = meta["name"] if kind == SERVICE_KIND else labels.get(LABEL_SERVICE, "")
    refs = meta.get("ownerReferences") or []
    return Cached(
        kind=kind,
        namespace=meta.get("namespace", ""),
        name=meta["name"],
        uid=meta.get("uid", ""),
        owner=owner,
        owner_uids=tuple(r.get("uid", "") for r in refs),
        co_owners=tuple(sorted({r["name"] for r in refs if r.get("kind") == SERVICE_KIND and r.get("name") != owner})),
        resource_version=rv,
        version=version,
        raw=raw,
    )


class Store:
    """Everything the informers saw, indexed by the InferenceService each object belongs to."""

    def __init__(self, on_change: Callable[[str, str, bool], None]) -> None:
        self.on_change = on_change  # (namespace, service, full)
        self.services: dict[Key, Cached] = {}
        self.children: dict[Key, dict[tuple[str, str], Cached]] = {}  # (ns, service) -> (kind, name) -> obj
        self.pods: dict[Key, dict[str, PodInfo]] = {}  # (ns, service) -> pod name -> info
        self._pod_owner: dict[Key, str] = {}  # (ns, pod) -> service
        self._child_owner: dict[tuple[str, str, str], str] = {}  # (kind, ns, name) -> service it is stored under
        self._pod_rv: dict[Key, str] = {}
        # (kind, ns, name) -> resourceVersion at deletion: an apply or status response that raced the
        # deletion must not bring the object back. Bounded; the oldest entries go first.
        self._tombstones: dict[tuple[str, str, str], str] = {}

    # ---- reads ------------------------------------------------------------------------------
    def service(self, key: Key) -> Cached | None:
        return self.services.get(key)

    def service_keys(self) -> list[Key]:
        return list(self.services)

    def children_of(self, key: Key, uid: str) -> dict[tuple[str, str], Cached]:
        """Children labelled with the service and owned by this incarnation of it (its uid)."""
        return {k: c for k, c in (self.children.get(key) or {}).items() if uid in c.owner_uids}

    def find(self, kind: str, namespace: str, name: str) -> Cached | None:
        """A stored child by kind and name, whichever service its label names."""
        owner = self._child_owner.get((kind, namespace, name))
        return None if owner is None else (self.children.get((namespace, owner)) or {}).get((kind, name))

    def pods_of(self, key: Key) -> list[PodInfo]:
        return list((self.pods.get(key) or {}).values())

    def pods_in(self, namespace: str, service: str) -> list[PodInfo]:
        return self.pods_of((namespace, service))

    def count(self) -> dict[str, int]:
        return {
            "services": len(self.services),
            "children": sum(map(len, self.children.values())),
            "pods": sum(map(len, self.pods.values())),
        }

    # ---- writes (informers, and write-through of the controller's own writes) -----------------
    def put(self, obj: dict[str, Any]) -> None:
        kind = obj["kind"]
        if kind == "Pod":
            self._put_pod(obj)
            return
        item = compact(obj)
        key = (item.namespace, item.owner)
        dead = self._tombstones.get((kind, item.namespace, item.name))
        if dead is not None:
            if not _newer(item.resource_version, dead) or item.resource_version == dead:
                return
            del self._tombstones[(kind, item.namespace, item.name)]  # created again since
        if kind == SERVICE_KIND:
            old = self.services.get(key)
            if old is not None and not _newer(item.resource_version, old.resource_version):
                return
            self.services[key] = item
        else:
            if not item.owner:
                return
            index = (kind, item.namespace, item.name)
            old = self.find(*index)
            if old is not None and not _newer(item.resource_version, old.resource_version):
                return
            before = self._child_owner.get(index)
            if before is not None and before != item.owner:  # relabelled: it leaves the other service
                self._drop_child(kind, item.namespace, item.name, before)
                old = None
            self.children.setdefault(key, {})[(kind, item.name)] = item
            self._child_owner[index] = item.owner
        if old is None or old.raw != item.raw:
            self.on_change(*key, False)
            self._wake_co_owners(item, old)

    def _wake_co_owners(self, item: Cached, old: Cached | None = None) -> None:
        """The other services that own a shared child (and any that just stopped owning it), for a full
        reconcile: the child is filed under another service's label, so their fast path cannot see it."""
        for name in sorted({*item.co_owners, *(old.co_owners if old is not None else ())}):
            self.on_change(item.namespace, name, True)

    def _drop_child(self, kind: str, namespace: str, name: str, owner: str) -> None:
        bucket = self.children.get((namespace, owner)) or {}
        dropped = bucket.pop((kind, name), None)
        if dropped is not None:
            if not bucket:
                self.children.pop((namespace, owner), None)
            self.on_change(namespace, owner, False)
            self._wake_co_owners(dropped)

    def delete(self, obj: dict[str, Any]) -> None:
        kind, meta = obj["kind"], obj["metadata"]
        namespace, name = meta.get("namespace", ""), meta["name"]
        if meta.get("resourceVersion") and kind != "Pod":
            self._tombstones[(kind, namespace, name)] = meta["resourceVersion"]
            if len(self._tombstones) > MAX_TOMBSTONES:
                del self._tombstones[next(iter(self._tombstones))]
        if kind == "Pod":
            owner = self._pod_owner.pop((namespace, name), None)
            self._pod_rv.pop((namespace, name), None)
            if owner is not None and (self.pods.get((namespace, owner)) or {}).pop(name, None) is not None:
                self.on_change(namespace, owner, False)
            return
        if kind == SERVICE_KIND:
            if self.services.pop((namespace, name), None) is not None:
                self.on_change(namespace, name, False)
            return
        owner = self._child_owner.pop((kind, namespace, name), None)
        if owner is not None:
            self._drop_child(kind, namespace, name, owner)

    def _put_pod(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        namespace, name = meta.get("namespace", ""), meta["name"]
        owner = (meta.get("labels") or {}).get(LABEL_SERVICE)
        rv = meta.get("resourceVersion", "")
        old_rv = self._pod_rv.get((namespace, name))
        if not owner or (old_rv is not None and not _newer(rv, old_rv)):
            return
        self._pod_rv[(namespace, name)] = rv
        self._pod_owner[(namespace, name)] = owner
        info = pod_info(obj)
        bucket = self.pods.setdefault((namespace, owner), {})
        if bucket.get(name) != info:
            bucket[name] = info
            self.on_change(namespace, owner, False)

    def keys_in_scope(self, kind: str, namespace: str | None) -> Iterator[tuple[str, str]]:
        """(namespace, name) of every stored object of `kind` (in `namespace`, or all)."""
        if kind == SERVICE_KIND:
            yield from (k for k in self.services if namespace is None or k[0] == namespace)
        elif kind == "Pod":
            yield from (k for k in self._pod_owner if namespace is None or k[0] == namespace)
        else:
            for (ns, _), bucket in self.children.items():
                if namespace is None or ns == namespace:
                    yield from ((ns, name) for k, name in bucket if k == kind)

    def stub(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """A minimal body of a stored object (for deleting it from the store after a relist)."""
        if kind == SERVICE_KIND:
            return {"kind": kind, "metadata": {"namespace": namespace, "name": name}}
        if kind == "Pod":
            return {"kind": kind, "metadata": {"namespace": namespace, "name": name}}
        owner = self._child_owner.get((kind, namespace, name))
        if owner is None:
            return None
        return {"kind": kind, "metadata": {"namespace": namespace, "name": name, "labels": {LABEL_SERVICE: owner}}}


class Informer:
    """LIST then WATCH one kind (in one namespace, or all) into a `Store`, forever, until cancelled."""

    def __init__(
        self, client: KubeClient, store: Store, kind: str, namespace: str | None, selector: str | None
    ) -> None:
        self.client, self.store, self.kind = client, store, kind
        self.namespace, self.selector = namespace, selector
        self.synced = asyncio.Event()
        self.task: asyncio.Task | None = None  # run(), when the controller started it
        self.resource_version = ""
        self.num_lists = 0
        self.num_watches = 0

    @property
    def name(self) -> str:
        return f"{self.kind} in {self.namespace or 'all namespaces'}"

    async def relist(self) -> None:
        """Replace this informer's part of the store with a fresh (paged) list."""
        seen: set[tuple[str, str]] = set()
        items, rv, cont = await self.client.list_page(self.kind, self.namespace, self.selector)
        while True:
            for item in items:
                item["kind"] = self.kind
                seen.add((item["metadata"].get("namespace", ""), item["metadata"]["name"]))
                self.store.put(item)
            if not cont:
                break
            items, _, cont = await self.client.list_page(self.kind, self.namespace, self.selector, cont=cont)
        for namespace, name in [k for k in self.store.keys_in_scope(self.kind, self.namespace) if k not in seen]:
            stub = self.store.stub(self.kind, namespace, name)
            if stub is not None:
                self.store.delete(stub)  # deleted while we were not watching
        self.resource_version = rv
        self.num_lists += 1

    async def run(self) -> None:
        backoff = 1.0
        while True:
            try:
                if not self.resource_version:
                    await self.relist()
                    self.synced.set()
                await self._watch_once()
                backoff = 1.0
            except asyncio.CancelledError:
                raise
            except ApiError as exc:
                if exc.status == 410:  # our resourceVersion is older than etcd's compaction window
                    logger.info("%s: watch expired (410 Gone); re-listing", self.name)
                    self.resource_version = ""
                    continue
                delay = exc.retry_after or backoff
                logger.warning("%s: %s; retrying in %.0fs", self.name, exc, delay)
                await asyncio.sleep(delay)
                backoff = min(backoff * 2, 30.0)
            except Exception as exc:  # network errors, a server that went away: reconnect from where we were
                logger.warning("%s: watch failed (%r); retrying in %.0fs", self.name, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    async def _watch_once(self) -> None:
        self.num_watches += 1
        timeout = random.randint(300, 600)  # spread reconnects, like client-go's 5-10 minutes
        stream = self.client.watch(self.kind, self.namespace, self.selector, self.resource_version, timeout)
        async for event in stream:
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                code = int(obj.get("code", 500))
                raise ApiError(code, obj.get("message", "watch error"), obj.get("reason", ""))
            rv = (obj.get("metadata") or {}).get("resourceVersion")
            if kind == "BOOKMARK":
                self.resource_version = rv or self.resource_version
                continue
            obj["kind"] = self.kind
            if kind == "DELETED":
                self.store.delete(obj)
            else:
                self.store.put(obj)
            if rv:
                self.resource_version = rv
