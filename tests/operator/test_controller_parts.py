"""The controller's machinery without a cluster: the cache and its informer, the work queue, the token
bucket, quantities."""

from __future__ import annotations

import asyncio
from fractions import Fraction
from typing import Any

import pytest

from tidepool.operator.api.quantity import quantity_value, same_quantity
from tidepool.operator.cache import CHILD_SELECTOR, Informer, Store, compact
from tidepool.operator.k8s import ApiError
from tidepool.operator.ratelimit import TokenBucket
from tidepool.operator.workqueue import WorkQueue

SVC = "tidepool.dev/inferenceservice"


def child(name: str, rv: str, service: str = "svc", generation: int = 1, **extra: Any) -> dict[str, Any]:
    meta = {
        "name": name,
        "namespace": "ns",
        "uid": f"u-{name}",
        "resourceVersion": rv,
        "generation": generation,
        "labels": {SVC: service},
        "ownerReferences": [{"uid": "owner"}],
        "managedFields": [{"manager": "x" * 500}],
    }
    return {"kind": "Deployment", "metadata": meta, "spec": {"replicas": 1}, **extra}


# ---- Store ------------------------------------------------------------------------------------
def test_store_indexes_by_service_and_wakes_it_only_on_real_changes():
    woken: list[tuple[str, str]] = []
    store = Store(lambda ns, name, full: woken.append((ns, name)))
    store.put(child("a", "10"))
    assert woken == [("ns", "svc")] and set(store.children_of(("ns", "svc"), "owner")) == {("Deployment", "a")}
    assert store.children_of(("ns", "svc"), "another-uid") == {}
    assert b"managedFields" not in store.children[("ns", "svc")][("Deployment", "a")].raw
    store.put(child("a", "11"))  # only the resourceVersion moved: nothing the controller reads changed
    assert len(woken) == 1
    store.put(child("a", "12", status={"readyReplicas": 1}))  # Deployments keep their status
    assert len(woken) == 2
    store.put(child("a", "9", status={"readyReplicas": 0}))  # older than what we hold: ignored
    assert store.children[("ns", "svc")][("Deployment", "a")].body()["status"] == {"readyReplicas": 1}


def test_store_tombstones_stop_a_late_write_through_resurrecting_a_deleted_child():
    store = Store(lambda *_: None)
    store.put(child("a", "10"))
    store.delete(child("a", "20"))
    store.put(child("a", "15"))  # an apply answer that raced the deletion
    assert store.children_of(("ns", "svc"), "owner") == {}
    store.put(child("a", "30"))  # created again later
    assert set(store.children_of(("ns", "svc"), "owner")) == {("Deployment", "a")}


def test_versions_of_workloads_ignore_status_but_not_generation_or_labels():
    base = compact(child("a", "1"))
    assert compact(child("a", "2", status={"replicas": 3})).version == base.version
    assert compact(child("a", "3", generation=2)).version != base.version
    relabelled = child("a", "4")
    relabelled["metadata"]["labels"]["x"] = "y"
    assert compact(relabelled).version != base.version


def test_pods_are_summarised():
    store = Store(lambda *_: None)
    pod = {
        "kind": "Pod",
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "resourceVersion": "5",
            "labels": {
                SVC: "svc",
                "tidepool.dev/pool": "decode",
                "tidepool.dev/spec-hash": "h",
                "tidepool.dev/group-index": "1",
                "apps.kubernetes.io/pod-index": "2",
            },
        },
        "status": {
            "phase": "Pending",
            "podIP": "10.1.1.1",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "m"}],
            "containerStatuses": [{"state": {"waiting": {"reason": "ImagePullBackOff", "message": "nope"}}}],
        },
    }
    store.put(pod)
    (info,) = store.pods_in("ns", "svc")
    assert (info.pool, info.spec_hash, info.group, info.rank, info.is_ready) == ("decode", "h", "1", 2, False)
    assert info.problems == (("Unschedulable", "m"), ("ImagePullBackOff", "nope"))


# ---- Informer ---------------------------------------------------------------------------------
class FakeWatchClient:
    """Pages for list_page, then scripted watch streams (each a list of events, or an exception)."""

    def __init__(self, pages: list[list[dict]], streams: list[Any], relist_pages: list[list[dict]] | None = None):
        self.pages, self.streams, self.relist_pages = pages, streams, relist_pages
        self.lists: list[tuple] = []
        self.watches: list[tuple] = []

    async def list_page(self, kind, namespace, selector, limit=500, cont=""):
        self.lists.append((kind, namespace, selector, cont))
        if not cont and len(self.lists) > 1 and self.relist_pages is not None:
            self.pages = self.relist_pages
        index = int(cont or 0)
        next_cont = str(index + 1) if index + 1 < len(self.pages) else ""
        return [dict(i) for i in self.pages[index]], "100", next_cont

    async def watch(self, kind, namespace, selector, rv, timeout):
        self.watches.append((kind, rv, selector))
        if not self.streams:
            await asyncio.Event().wait()  # no more scripted events: a quiet watch
        stream = self.streams.pop(0)
        if isinstance(stream, Exception):
            raise stream
        for event in stream:
            yield event


def test_informer_lists_in_pages_watches_from_the_list_version_and_relists_on_410():
    store = Store(lambda *_: None)
    pages = [[child("a", "50")], [child("b", "51")]]
    streams: list[Any] = [
        [
            {"type": "MODIFIED", "object": child("a", "101", status={"readyReplicas": 1})},
            {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "150"}}},
        ],
        [{"type": "DELETED", "object": child("b", "160")}],
        ApiError(410, "too old resource version", "Expired"),
    ]
    # "b" is recreated after its deletion: the relist after the 410 sees the new one.
    client = FakeWatchClient(pages, streams, relist_pages=[[child("a", "101")], [child("b", "200")]])

    async def run() -> None:
        informer = Informer(client, store, "Deployment", "ns", CHILD_SELECTOR)  # type: ignore[arg-type]
        task = asyncio.create_task(informer.run())
        await informer.synced.wait()
        for _ in range(200):
            if len(client.lists) >= 4:  # 2 pages, then 2 pages again after the 410
                break
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    assert [c[3] for c in client.lists] == ["", "1", "", "1"]
    assert client.watches[0] == ("Deployment", "100", CHILD_SELECTOR)
    assert client.watches[1][1] == "150"  # reconnected from the bookmark, no relist
    assert client.watches[2][1] == "160"
    # after the relist "b" is back (the list has it), "a" carries the newest status it saw
    assert set(store.children_of(("ns", "svc"), "owner")) == {("Deployment", "a"), ("Deployment", "b")}


def test_relist_removes_objects_deleted_while_not_watching():
    store = Store(lambda *_: None)
    store.put(child("gone", "5"))
    client = FakeWatchClient([[child("kept", "6")]], [])

    async def run() -> None:
        await Informer(client, store, "Deployment", "ns", CHILD_SELECTOR).relist()  # type: ignore[arg-type]

    asyncio.run(run())
    assert set(store.children_of(("ns", "svc"), "owner")) == {("Deployment", "kept")}


# ---- WorkQueue --------------------------------------------------------------------------------
def test_queue_coalesces_serialises_and_requeues_dirty_keys():
    async def run() -> None:
        q = WorkQueue()
        q.add("a")
        q.add("b")
        q.add("a", full=True)  # coalesces with the queued "a", full OR-ed in
        assert len(q) == 2 and q.num_coalesced == 1
        key, full = await q.get()
        assert (key, full) == ("a", True)
        q.add("a")  # while "a" is processed: marked dirty, not queued twice
        assert len(q) == 1
        key2, _ = await q.get()
        assert key2 == "b" and len(q) == 0
        q.done("a")  # now it goes back in
        assert len(q) == 1 and (await q.get())[0] == "a"

    asyncio.run(run())


def test_queue_serves_keys_reconciled_before_ahead_of_new_ones():
    known = {"old1", "old2"}

    async def run() -> None:
        q = WorkQueue(is_known=lambda key: key in known)
        for key in ("new1", "new2", "old1", "new3", "old2"):
            q.add(key)
        order = []
        for _ in range(5):
            key, _ = await q.get()
            order.append(key)
            q.done(key)
        # the known lane first (FIFO within it), then the new keys in arrival order
        assert order == ["old1", "old2", "new1", "new2", "new3"]
        # a waiting worker wakes for a key added later
        waiter = asyncio.create_task(q.get())
        await asyncio.sleep(0)
        assert not waiter.done()
        q.add("new4")
        assert (await asyncio.wait_for(waiter, 5))[0] == "new4"

    asyncio.run(run())


def test_queue_timers_and_backoff_use_the_given_clock():
    now = [0.0]

    async def run() -> None:
        q = WorkQueue(base_delay_s=1.0, max_delay_s=4.0, clock=lambda: now[0])
        assert [q.add_rate_limited("k") for _ in range(4)] == [1.0, 2.0, 4.0, 4.0]
        q.forget("k")
        assert q.add_rate_limited("k") == 1.0
        q.add_after("t", 10.0)
        now[0] = 5.0
        q.fire_due()
        assert len(q) == 1  # "k" (due at 1, 2, 4, 4, 6...) fired once coalesced; "t" not yet
        now[0] = 10.0
        q.fire_due()
        assert len(q) == 2

    asyncio.run(run())


# ---- TokenBucket ------------------------------------------------------------------------------
def test_token_bucket_allows_the_burst_then_spaces_requests_at_qps():
    now = [0.0]
    bucket = TokenBucket(qps=10, burst=3, clock=lambda: now[0])
    assert [bucket.reserve() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.reserve() == pytest.approx(0.1)
    assert bucket.reserve() == pytest.approx(0.2)
    now[0] = 10.0  # a quiet period refills up to the burst only
    assert [bucket.reserve() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.reserve() > 0
    assert TokenBucket(qps=0, burst=1).reserve() == 0.0  # disabled


# ---- quantities -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "value"),
    [("500m", Fraction(1, 2)), ("0.5", Fraction(1, 2)), ("1Gi", 2**30), ("1024Mi", 2**30), ("1e3", 1000),
     ("1k", 1000), (4, 4), ("1.5", Fraction(3, 2)), ("5E-1", Fraction(1, 2))],
)  # fmt: skip
def test_quantity_value(text, value):
    assert quantity_value(text) == value


def test_same_quantity():
    assert same_quantity("0.5", "500m") and same_quantity("1Gi", "1024Mi") and same_quantity(2, "2")
    assert not same_quantity("1G", "1Gi") and not same_quantity("abc", "abc") and not same_quantity(True, 1)
