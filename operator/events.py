"""Kubernetes Events about an InferenceService (core/v1), posted by the controller itself.

Only real transitions become Events (children created, scaled, rolled out, drift corrected, pruned,
an invalid spec, a refused apply, autoscaler decisions, a cache claim that starts keeping what the spec
cannot change: ClaimKept, told once while it lasts); waiting for pods never does. Posting is
best effort: a refused or failed post is logged and never fails a reconcile. The requests go through
the operator's client, so they count against its QPS budget like everything else.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from tidepool.operator.api import API_VERSION, KIND, now_rfc3339
from tidepool.operator.k8s import ApiError, KubeClient

logger = logging.getLogger("tidepool.operator.events")
COMPONENT = "tidepool-operator"


class EventRecorder:
    def __init__(self, client: KubeClient) -> None:
        self.client = client
        self.host = os.environ.get("HOSTNAME", "")
        self.num_posted = 0

    async def post(self, obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        meta = obj["metadata"]
        now = now_rfc3339()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
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
            "message": message[:1024],
            "source": {"component": COMPONENT, "host": self.host},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.host or COMPONENT,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.client.create(event)
            self.num_posted += 1
        except (ApiError, OSError) as exc:
            logger.warning("could not post Event %s for %s/%s: %r", reason, meta["namespace"], meta["name"], exc)
        except Exception as exc:  # aiohttp errors: an Event is never worth failing a reconcile for
            logger.warning("could not post Event %s for %s/%s: %r", reason, meta["namespace"], meta["name"], exc)
