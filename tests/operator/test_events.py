"""The EventRecorder aggregates: one Event object per (object, type, reason, message key), updated with a count.

Against a small in-memory Events API (create answers 409 for a name that exists, patch 404 for one that does
not) and a fake clock: identical repeats are held back for the refresh period and folded into the count, a
changed message under one key updates the same object at once, a restarted recorder counts on from the object
an earlier process created, an Event the API server expired is created again, and failures never raise.
"""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from typing import Any

from tidepool.operator.events import REFRESH_S, EventRecorder, event_name
from tidepool.operator.k8s import ApiError

SERVICE = {"metadata": {"name": "svc", "namespace": "ns", "uid": "u-1", "resourceVersion": "7"}}


class EventsApi:
    """Events by name, with the API server's answers for create (409 when the name exists) and patch (404)."""

    def __init__(self) -> None:
        self.events: dict[str, dict[str, Any]] = {}
        self.calls: Counter[str] = Counter()
        self.fail: ApiError | None = None

    def _check(self, verb: str) -> None:
        self.calls[verb] += 1
        if self.fail is not None:
            raise self.fail

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._check("create")
        name = obj["metadata"]["name"]
        if name in self.events:
            raise ApiError(409, f'events "{name}" already exists', "AlreadyExists")
        self.events[name] = copy.deepcopy(obj)
        return copy.deepcopy(obj)

    async def get_object(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self._check("get")
        assert kind == "Event"
        return copy.deepcopy(self.events.get(name))

    async def patch_merge(self, kind: str, namespace: str, name: str, body: dict[str, Any], sub=None) -> dict:
        self._check("patch")
        assert kind == "Event" and sub is None
        if name not in self.events:
            raise ApiError(404, f'events "{name}" not found', "NotFound")
        event = self.events[name]
        for key, value in body.items():
            if isinstance(value, dict):
                event.setdefault(key, {}).update(value)
            else:
                event[key] = value
        return copy.deepcopy(event)


def recorder(api: EventsApi, now: list[float], **kwargs: Any) -> EventRecorder:
    return EventRecorder(api, clock=lambda: now[0], **kwargs)  # type: ignore[arg-type]


def post(rec: EventRecorder, reason: str, message: str, key: str | None = None, obj: Any = SERVICE) -> None:
    asyncio.run(rec.post(obj, "Normal", reason, message, key))


def test_identical_repeats_are_held_back_then_folded_into_the_count():
    api, now = EventsApi(), [0.0]
    rec = recorder(api, now)
    for _ in range(10):  # e.g. every 15 s for 150 s
        post(rec, "Scaled", "scaled unified 1->2")
        now[0] += 15.0
    ((name, event),) = api.events.items()
    assert event["count"] == 1 and api.calls == Counter(create=1)
    assert rec.num_suppressed == 9
    now[0] = REFRESH_S + 1.0
    post(rec, "Scaled", "scaled unified 1->2")
    assert api.events[name]["count"] == 11  # the first, the nine held back, this one
    assert api.calls == Counter(create=1, patch=1) and len(api.events) == 1
    assert api.events[name]["involvedObject"]["uid"] == "u-1"


def test_a_changed_message_under_one_key_updates_the_same_event_at_once():
    api, now = EventsApi(), [0.0]
    rec = recorder(api, now)
    post(rec, "AdvisoryScale", "advisory: unified 2->4", key="decision")
    post(rec, "AdvisoryScale", "advisory: unified 2->4", key="decision")  # the same: nothing written
    post(rec, "AdvisoryScale", "advisory: unified 2->6", key="decision")
    ((event),) = api.events.values()
    assert event["message"] == "advisory: unified 2->6" and event["count"] == 3
    assert api.calls == Counter(create=1, patch=1)
    assert event["firstTimestamp"] <= event["lastTimestamp"]


def test_without_a_key_each_message_is_its_own_event_and_each_reason_and_object_too():
    api, now = EventsApi(), [0.0]
    rec = recorder(api, now)
    post(rec, "ClaimKept", "claim a keeps 40Gi")
    post(rec, "ClaimKept", "claim b keeps 40Gi")
    post(rec, "ApplyFailed", "claim a keeps 40Gi")
    other = {"metadata": {**SERVICE["metadata"], "name": "other", "uid": "u-2"}}
    post(rec, "ClaimKept", "claim a keeps 40Gi", obj=other)
    post(rec, "ClaimKept", "claim a keeps 40Gi")
    assert len(api.events) == 4 and api.calls == Counter(create=4)
    assert sorted(e["involvedObject"]["name"] for e in api.events.values()) == ["other", "svc", "svc", "svc"]


def test_a_restarted_recorder_counts_on_from_the_event_an_earlier_process_created():
    api, now = EventsApi(), [0.0]
    first = recorder(api, now)
    post(first, "Scaled", "scaled", key="decision")
    post(first, "Scaled", "scaled again", key="decision")
    restarted = recorder(api, now)  # a new process (or the newly elected replica): nothing in memory
    post(restarted, "Scaled", "scaled once more", key="decision")
    ((name, event),) = api.events.items()
    assert name == event_name("svc", ("u-1", "Normal", "Scaled", "decision"))
    assert event["count"] == 3 and event["message"] == "scaled once more"
    assert api.calls["create"] == 2 and api.calls["get"] == 1


def test_an_expired_event_is_created_again_with_its_count_carried_on():
    api, now = EventsApi(), [0.0]
    rec = recorder(api, now)
    post(rec, "Scaled", "up", key="decision")
    api.events.clear()  # the API server's event TTL
    post(rec, "Scaled", "down", key="decision")
    ((event),) = api.events.values()
    assert event["count"] == 2 and event["message"] == "down"


def test_what_is_remembered_is_bounded_least_recently_used_first_out():
    api, now = EventsApi(), [0.0]
    rec = recorder(api, now, max_records=2)
    post(rec, "A", "a")
    post(rec, "B", "b")
    post(rec, "A", "a")  # A is used again: B is now the least recently used
    post(rec, "C", "c")  # B is forgotten
    post(rec, "A", "a")  # still remembered: held back
    assert api.calls == Counter(create=3)
    post(rec, "B", "b")  # forgotten: create answers 409, the recorder counts on from the object
    assert api.calls == Counter(create=4, get=1, patch=1)
    assert [e["count"] for e in api.events.values()] == [1, 2, 1]


def test_a_failed_post_is_logged_never_raised_and_retried_by_the_next_post():
    api, now = EventsApi(), [0.0]
    rec = recorder(api, now)
    api.fail = ApiError(500, "etcd is sad", "InternalError")
    post(rec, "Scaled", "up")
    assert not api.events and rec.num_posted == 0
    api.fail = None
    post(rec, "Scaled", "up")
    assert [e["count"] for e in api.events.values()] == [1] and rec.num_posted == 1


def test_messages_are_cut_to_the_api_limit_and_names_are_valid():
    api, now = EventsApi(), [0.0]
    rec = recorder(api, now)
    post(rec, "ApplyFailed", "x" * 5000)
    ((name, event),) = api.events.items()
    assert len(event["message"]) == 1024
    assert name.startswith("svc.") and len(name) == len("svc.") + 16 and name == name.lower()
