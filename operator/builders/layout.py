"""What the builders return: the desired children of one InferenceService and each pool's layout.

`Desired` is the whole desired state of one generation: the child manifests in apply order, and
per pool (and the router) a `PoolLayout` saying which workloads serve it, how many replicas the
operator drives towards, the minimum that must serve, the current pod template hash and the pods
of one replica. Status is counted against the layouts; nobody reads them back out of the manifests.

Invariants: plain data, built only by `desired_state()` (builders/__init__.py); a layout's
`spec_hash` is the `tidepool.dev/spec-hash` label of the template its workloads carry ("" and no
workloads when the pool has none, e.g. StatefulSet groups scaled to zero).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

ChildKey = tuple[str, str]  # (kind, name) of a child


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """The plan for one pool (or the router)."""

    name: str
    desired: int  # replicas the operator drives towards
    floor: int  # replicas that must be ready on the current template for the pool to serve
    spec_hash: str  # the pod template hash of the current spec ("" when no workload is planned)
    workloads: tuple[ChildKey, ...]  # its workload objects
    pods_per_replica: int = 1


@dataclass(slots=True)
class Desired:
    """What the builders want for one generation of one InferenceService."""

    children: list[dict[str, Any]]
    pools: list[PoolLayout]
    router: PoolLayout | None
    url: str  # status.url: the router Service, or the last pool's Service when there is no router
    selector: str  # status.selector: the scaled pool's pods
    scaled_pool: str

    def without_children(self) -> Desired:
        """The layouts, URL and selector only (what the fast path keeps between syncs)."""
        return dataclasses.replace(self, children=[])
