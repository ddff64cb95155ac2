"""What to do on one replica, and what status.lora says: pure functions over what the operator observed.

Inputs: the declared adapters (name -> lora_path, builders/lora.py), per replica the adapters it holds (its
`/v1/models` entries that have a `parent`: name -> root) and the operator's own attempts on it (name ->
`Attempt`). No clock (`now` is passed in), no I/O.

Rules:
- an adapter held but no longer declared is unloaded; one declared but not held is loaded, unless a load
  is in flight, a load of that same path ended after the list was asked for (the list predates it), or
  the last load of that path failed less than `retry_s` ago (a failure is kept and reported; it is
  retried after `retry_s`, so files uploaded later are picked up);
- an adapter held under a different path is reloaded (unload, then load) when the operator knows it:
  it loaded it itself with another path, or the declared path is a folder (a fetched source's `root`
  may be the engine's local copy, so a URI is compared only with what the operator loaded);
- a replica is *settled* when every declared adapter is held or has failed for its current path: the
  readiness gate then opens (a broken adapter must not keep a replica from serving the others).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from tidepool.operator.api.status import AdapterState, LoraAdapterStatus, LoraPoolStatus

MAX_HELD_BY = 64  # pods listed per adapter and pool in status.lora


@dataclass(frozen=True, slots=True)
class Attempt:
    """The operator's last load of one adapter on one replica."""

    path: str
    state: Literal["Loading", "Ready", "Failed"]
    message: str = ""
    at: float = 0.0  # when it started (Loading) or ended (Ready/Failed), the operator's clock


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    unloads: tuple[str, ...] = ()
    loads: tuple[tuple[str, str], ...] = ()  # (name, path)


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One serving replica as status sees it: its pool, what it holds, what the operator tried on it."""

    pod: str
    pool: str
    held: Mapping[str, str] | None  # None: it did not answer
    attempts: Mapping[str, Attempt] = field(default_factory=dict)


def _is_stale(declared: str, root: str, attempt: Attempt | None) -> bool:
    """Does the replica hold an older version of the adapter (loaded from another path)?"""
    if attempt is not None and attempt.state == "Ready":
        return attempt.path != declared
    return "://" not in declared and root != declared


def _is_waiting(attempt: Attempt, now: float, retry_s: float, listed_at: float) -> bool:
    """A load in flight, a failure too recent to try again, or a load that ended after the list was asked for
    (the list may predate it)."""
    if attempt.state == "Ready":
        return attempt.at >= listed_at
    return attempt.state == "Loading" or now - attempt.at < retry_s


def plan_replica(
    declared: Mapping[str, str],
    held: Mapping[str, str],
    attempts: Mapping[str, Attempt],
    now: float,
    retry_s: float,
    listed_at: float = float("-inf"),
) -> ReplicaPlan:
    """The unloads and loads that bring one replica to the declared adapters (see the module docstring);
    `listed_at`: when `held` was asked for."""
    stale = [n for n, root in held.items() if n in declared and _is_stale(declared[n], root, attempts.get(n))]
    unloads = [n for n in held if n not in declared] + stale
    loads = []
    for name, path in declared.items():
        if name in held and name not in stale:
            continue
        attempt = attempts.get(name)
        is_same = attempt is not None and attempt.path == path
        if is_same and attempt is not None and _is_waiting(attempt, now, retry_s, listed_at):
            continue
        loads.append((name, path))
    return ReplicaPlan(tuple(unloads), tuple(loads))


def is_settled(declared: Mapping[str, str], held: Mapping[str, str], attempts: Mapping[str, Attempt]) -> bool:
    """Every declared adapter is held, or its load of the current path failed (the gate may open)."""
    for name, path in declared.items():
        attempt = attempts.get(name)
        failed = attempt is not None and attempt.state == "Failed" and attempt.path == path
        if name not in held and not failed:
            return False
    return True


def _pool_status(name: str, path: str, pool: str, replicas: Sequence[ReplicaView]) -> LoraPoolStatus:
    holders = sorted(r.pod for r in replicas if r.held is not None and name in r.held)
    failures = []
    loading = 0
    for r in replicas:
        attempt = r.attempts.get(name)
        if r.pod in holders or attempt is None or attempt.path != path:
            continue
        if attempt.state == "Failed":
            failures.append(f"pod {r.pod}: {attempt.message}")
        elif attempt.state == "Loading":
            loading += 1
    state: AdapterState
    if failures:
        state, message = "Failed", "; ".join(failures)
    elif not replicas:
        state, message = "Pending", "no serving replica yet"
    elif len(holders) == len(replicas):
        state, message = "Ready", ""
    else:
        silent = sorted(r.pod for r in replicas if r.held is None)
        state, message = "Loading", f"loading on {len(replicas) - len(holders)} of {len(replicas)} replicas"
        if silent:
            message += f"; not answering: {', '.join(silent[:8])}"
    return LoraPoolStatus(
        pool=pool,
        state=state,
        ready_replicas=len(holders),
        replicas=len(replicas),
        held_by=holders[:MAX_HELD_BY],
        message=message[:4000],
    )


_SEVERITY: dict[str, int] = {"Ready": 0, "Pending": 1, "Loading": 2, "Failed": 3}


def lora_status(
    declared: Mapping[str, str], pools: Sequence[str], replicas: Sequence[ReplicaView]
) -> list[LoraAdapterStatus]:
    """status.lora: each declared adapter per pool, in spec order."""
    out = []
    for name, path in declared.items():
        per_pool = [_pool_status(name, path, pool, [r for r in replicas if r.pool == pool]) for pool in pools]
        worst = max((p.state for p in per_pool), key=_SEVERITY.__getitem__, default="Pending")
        out.append(LoraAdapterStatus(name=name, state=worst, pools=per_pool))
    return out


def failure_messages(status: Sequence[LoraAdapterStatus]) -> list[str]:
    """One line per adapter that failed somewhere (the Degraded condition's message)."""
    return [
        f"LoRA adapter {a.name!r} failed to load ({p.pool}): {p.message}"
        for a in status
        for p in a.pools
        if p.state == "Failed"
    ]
