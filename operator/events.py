"""Kubernetes Events about an InferenceService (core/v1), posted by the controller itself, aggregated.

Only real transitions become Events (children created, scaled, rolled out, drift corrected, pruned,
an invalid spec, a refused apply, autoscaler decisions, a cache claim that starts keeping what the spec
cannot change: ClaimKept, told once while it lasts); waiting for pods never does.

Aggregation, as client-go's EventRecorder/EventCorrelator does it: one Event object per (object uid,
type, reason, message key), its `count` and `lastTimestamp` moved instead of a new object per
occurrence. The message key is the message unless the caller names one (the autoscaler names one per
reason, so a changed recommendation updates the service's one AdvisoryScale Event in place).
- A new key creates the Event; its name is derived from the key (`<name>.<hash>`), so a restarted or
  newly elected operator finds the same object (create answers 409: read it, count on from it).
- A changed message under the same key is written at once (count + 1, the new message).
- An identical repeat within `refresh_s` (5 min) writes nothing: it is counted in memory and folded
  into `count` by the first write after the refresh period (client-go's spam filter drops them).
- An Event gone meanwhile (the API server's event TTL) is created again, its count carried on.
What is remembered per key is bounded (`max_records`, least recently used first out, 4096 as in
client-go). Posts for one object come from its key's worker only, one at a time (the controller's
work queue guarantees it), so a key's record is never updated by two posts at once.

Posting is best effort: a refused or failed post is logged and never fails a reconcile. The requests
go through the operator's client, so they count against its QPS budget like everything else. RBAC:
create, get and patch on events.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from tidepool.operator.api import API_VERSION, KIND, now_rfc3339
from tidepool.operator.k8s import ApiError, KubeClient

logger = logging.getLogger("tidepool.operator.events")
COMPONENT = "tidepool-operator"
REFRESH_S = 300.0  # an identical repeat rewrites its Event at most this often
MAX_RECORDS = 4096  # keys remembered (client-go's LRU size)
MAX_MESSAGE = 1024
EVENT_WRITES = Counter(
    "tidepool_operator_events_total",
    "Events told: created (a new Event object), updated (count/message of an existing one), "
    "suppressed (an identical repeat within the refresh period, counted but not written)",
    ["action"],
)

EventKey = tuple[str, str, str, str]  # (involved object's uid, type, reason, message key)


@dataclass(slots=True)
class _Told:
    """What the cluster's Event for one key says (as far as this process knows)."""

    name: str  # the Event object's name
    message: str  # its message
    count: int  # its count, plus the repeats not written yet (`pending`)
    pending: int  # identical repeats counted but not written (folded into `count` at the next write)
    written_at: float  # the recorder's clock at the last write


def event_name(object_name: str, key: EventKey) -> str:
    """The Event object's name for `key`: the object's name and a hash of the key (stable across restarts)."""
    digest = hashlib.sha256("\x00".join(key).encode()).hexdigest()[:16]
    return f"{object_name}.{digest}"


class EventRecorder:
    def __init__(
        self,
        client: KubeClient,
        clock: Callable[[], float] = time.monotonic,
        refresh_s: float = REFRESH_S,
        max_records: int = MAX_RECORDS,
    ) -> None:
        self.client = client
        self.host = os.environ.get("HOSTNAME", "")
        self._clock, self.refresh_s, self.max_records = clock, refresh_s, max_records
        self._told: OrderedDict[EventKey, _Told] = OrderedDict()
        self.num_posted = 0  # writes to the API server (creates and updates)
        self.num_suppressed = 0  # repeats counted without a write

    async def post(self, obj: Mapping[str, Any], type_: str, reason: str, message: str, key: str | None = None) -> None:
        """Tell `reason`/`message` about `obj`: create its Event, update it, or count a repeat (module docstring).

        `key` groups messages into one Event (default: the message itself)."""
        meta = obj["metadata"]
        message = message[:MAX_MESSAGE]
        ident: EventKey = (
            meta.get("uid") or f"{meta['namespace']}/{meta['name']}",
            type_,
            reason,
            message if key is None else key,
        )
        now = self._clock()
        told = self._told.get(ident)
        if told is not None:
            self._told.move_to_end(ident)
            if told.message == message and now - told.written_at < self.refresh_s:
                told.pending += 1
                self.num_suppressed += 1
                EVENT_WRITES.labels("suppressed").inc()
                return
        try:
            if told is None:
                told = await self._create(obj, ident, type_, reason, message)
                self._remember(ident, told)
            else:
                await self._update(obj, told, type_, reason, message)
            told.written_at = now
        except (ApiError, OSError) as exc:
            logger.warning("could not post Event %s for %s/%s: %r", reason, meta["namespace"], meta["name"], exc)
        except Exception as exc:  # aiohttp errors: an Event is never worth failing a reconcile for
            logger.warning("could not post Event %s for %s/%s: %r", reason, meta["namespace"], meta["name"], exc)

    def _remember(self, ident: EventKey, told: _Told) -> None:
        self._told[ident] = told
        self._told.move_to_end(ident)
        while len(self._told) > self.max_records:
            self._told.popitem(last=False)

    async def _create(
        self, obj: Mapping[str, Any], ident: EventKey, type_: str, reason: str, message: str, count: int = 1
    ) -> _Told:
        """Create the key's Event; when it exists already (an earlier process told it), count on from it."""
        meta = obj["metadata"]
        name = event_name(meta["name"], ident)
        now = now_rfc3339()
        event = self._event(obj, name, type_, reason, message, count, now, now)
        try:
            await self.client.create(event)
        except ApiError as exc:
            if exc.status != 409:
                raise
            existing = await self.client.get_object("Event", meta["namespace"], name)
            if existing is None:  # deleted between the two calls: ours is the one to create
                await self.client.create(event)
            else:
                told = _Told(name, str(existing.get("message", "")), int(existing.get("count") or 1), count - 1, 0.0)
                await self._update(obj, told, type_, reason, message)
                return told
        self._count_write("created")
        return _Told(name, message, count, 0, 0.0)

    async def _update(self, obj: Mapping[str, Any], told: _Told, type_: str, reason: str, message: str) -> None:
        """Move the Event's count (this occurrence and the repeats held back) and lastTimestamp, set its message."""
        meta = obj["metadata"]
        count = told.count + told.pending + 1
        patch = {
            "message": message,
            "count": count,
            "lastTimestamp": now_rfc3339(),
            "involvedObject": {"resourceVersion": meta.get("resourceVersion", "")},
        }
        try:
            await self.client.patch_merge("Event", meta["namespace"], told.name, patch)
        except ApiError as exc:
            if exc.status != 404:
                raise
            # Gone (the API server's event TTL): the same object again, its count carried on.
            now = now_rfc3339()
            await self.client.create(self._event(obj, told.name, type_, reason, message, count, now, now))
            told.count, told.pending, told.message = count, 0, message
            self._count_write("created")
            return
        told.count, told.pending, told.message = count, 0, message
        self._count_write("updated")

    def _count_write(self, action: str) -> None:
        self.num_posted += 1
        EVENT_WRITES.labels(action).inc()

    def _event(
        self,
        obj: Mapping[str, Any],
        name: str,
        type_: str,
        reason: str,
        message: str,
        count: int,
        first: str,
        last: str,
    ) -> dict[str, Any]:
        meta = obj["metadata"]
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid", ""),
                "resourceVersion": meta.get("resourceVersion", ""),
            },
            "type": type_,
            "reason": reason,
            "message": message,
            "source": {"component": COMPONENT, "host": self.host},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.host or COMPONENT,
            "firstTimestamp": first,
            "lastTimestamp": last,
            "count": count,
        }
