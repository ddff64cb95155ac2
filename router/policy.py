"""Routing policies: which ready replica gets a request. Pure code: no I/O, no clock, no asyncio.

A policy sees one `ReplicaLoad` per ready replica (a snapshot the pool builds) and the
request's prefix key (`prefix.prefix_key`, or None), and returns a `Choice`.

- `RoundRobinPolicy`: the next replica in id order.
- `LeastLoadPolicy`: the smallest `load` (waiting + running as scraped from the engine, or the
  router's own in-flight count if larger, since scrapes lag); ties go to the lower KV-cache
  usage, then to the replica this router sent fewer requests to (so an idle pool is spread).
- `PrefixAwarePolicy`: consistent hashing (a ring with `num_virtual_nodes` points per
  replica) of the prefix key, so requests sharing their leading prompt blocks meet on the
  replica whose prefix cache already holds them, and a replica joining or leaving moves only
  ~1/N of the keys. Falls back to least-load when the target is hot (see `is_hot`).

Invariants: `choose` is only called with at least one replica; it never returns a replica
outside the given list; the same key and the same replica set give the same target.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

POLICIES = ("prefix-aware", "least-load", "round-robin")


@dataclass(slots=True, frozen=True)
class ReplicaLoad:
    replica_id: str  # the replica's base URL
    num_waiting: int = 0  # vllm:num_requests_waiting at the last scrape
    num_running: int = 0  # vllm:num_requests_running at the last scrape
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc (0..1) at the last scrape
    num_inflight: int = 0  # this router's requests on the replica right now
    num_dispatched: int = 0  # requests this router has sent to it so far (tie-break)

    @property
    def load(self) -> int:
        # The scrape sees every router's traffic but lags; the in-flight count is exact but local.
        return max(self.num_waiting + self.num_running, self.num_inflight)


@dataclass(slots=True, frozen=True)
class Choice:
    replica_id: str
    reason: str  # "round_robin", "least_load", "prefix" or "prefix_fallback"
    affinity: Literal["hit", "miss"] | None = None  # adapter requests: a replica holding it, or none did (`lora`)


@dataclass(slots=True, frozen=True)
class HotThresholds:
    max_waiting: int = 4  # more requests than this queued on the target: hot
    load_ratio: float = 2.0  # target load above ratio * least load + slack: hot
    load_slack: int = 4  # so that 3 vs 0 requests is not "hot"


class Policy(Protocol):
    def choose(self, replicas: Sequence[ReplicaLoad], key: bytes | None) -> Choice: ...


def least_loaded(replicas: Sequence[ReplicaLoad]) -> ReplicaLoad:
    if not replicas:
        raise ValueError("least_loaded needs at least one replica")
    return min(replicas, key=lambda r: (r.load, r.kv_usage, r.num_dispatched, r.replica_id))


def is_hot(target: ReplicaLoad, least: ReplicaLoad, thresholds: HotThresholds) -> bool:
    """Whether sending to `target` instead of `least` costs more queueing than a prefix hit saves."""
    if target.replica_id == least.replica_id:
        return False
    if target.num_waiting > thresholds.max_waiting:
        return True
    return target.load > thresholds.load_ratio * least.load + thresholds.load_slack


class RoundRobinPolicy:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, replicas: Sequence[ReplicaLoad], key: bytes | None) -> Choice:
        ordered = sorted(r.replica_id for r in replicas)
        replica_id = ordered[self._next % len(ordered)]
        self._next += 1
        return Choice(replica_id, "round_robin")


class LeastLoadPolicy:
    def choose(self, replicas: Sequence[ReplicaLoad], key: bytes | None) -> Choice:
        return Choice(least_loaded(replicas).replica_id, "least_load")


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """A consistent-hash ring: each replica owns `num_virtual_nodes` points; a key goes to the next point."""

    def __init__(self, replica_ids: Sequence[str], num_virtual_nodes: int = 160) -> None:
        if num_virtual_nodes < 1:
            raise ValueError(f"num_virtual_nodes must be >= 1, got {num_virtual_nodes}")
        if not replica_ids:
            raise ValueError("a hash ring needs at least one replica")
        points = sorted(
            (_point(f"{replica_id}#{i}".encode()), replica_id)
            for replica_id in set(replica_ids)
            for i in range(num_virtual_nodes)
        )
        self._hashes = [h for h, _ in points]
        self._owners = [owner for _, owner in points]
        self.replica_ids = frozenset(replica_ids)

    def lookup(self, key: bytes) -> str:
        index = bisect.bisect(self._hashes, _point(key)) % len(self._hashes)
        return self._owners[index]


class PrefixAwarePolicy:
    MAX_RINGS = 16  # rings kept: the ready set, plus the holders of each adapter in use (see `lora`)

    def __init__(self, thresholds: HotThresholds | None = None, num_virtual_nodes: int = 160) -> None:
        self.thresholds = thresholds or HotThresholds()
        self.num_virtual_nodes = num_virtual_nodes
        self._rings: dict[frozenset[str], HashRing] = {}

    def ring(self, replica_ids: Sequence[str]) -> HashRing:
        # Built once per replica set; consistent hashing keeps the other keys in place when the set changes.
        ids = frozenset(replica_ids)
        ring = self._rings.pop(ids, None) or HashRing(replica_ids, self.num_virtual_nodes)
        self._rings[ids] = ring  # most recently used last
        if len(self._rings) > self.MAX_RINGS:
            del self._rings[next(iter(self._rings))]
        return ring

    def choose(self, replicas: Sequence[ReplicaLoad], key: bytes | None) -> Choice:
        least = least_loaded(replicas)
        if key is None:
            return Choice(least.replica_id, "least_load")
        target_id = self.ring([r.replica_id for r in replicas]).lookup(key)
        target = next(r for r in replicas if r.replica_id == target_id)
        if is_hot(target, least, self.thresholds):
            return Choice(least.replica_id, "prefix_fallback")
        return Choice(target_id, "prefix")


def make_policy(name: str, thresholds: HotThresholds | None = None, num_virtual_nodes: int = 160) -> Policy:
    if name == "prefix-aware":
        return PrefixAwarePolicy(thresholds, num_virtual_nodes)
    if name == "least-load":
        return LeastLoadPolicy()
    if name == "round-robin":
        return RoundRobinPolicy()
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
