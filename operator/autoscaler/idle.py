"""`autoscaling.idle: sleep`: when idle pools go to sleep and when they wake (pure: no client, no clock, no I/O).

Where scale-to-zero would take every pool to zero replicas (policy.py, step 7), a service with `idle: sleep`
keeps its replicas and puts their engines to sleep (vLLM's `POST /sleep`, level 1: the KV cache is freed, the
weights stay in host memory), so a wake costs far less than a cold start; the operator carries the state out
(sleep.py). The state is one time, `History.asleep_since` (None: awake), kept in `status.autoscaling.asleepSince`
so a restarted operator resumes it.

The rules, in order:
- not `idle: sleep` (any more): a sleeping service is woken, an awake one stays awake;
- asleep: a request the router holds (it holds them while no replica serves, as at zero) wakes every pool;
  otherwise the pools stay asleep;
- awake: after `idle_seconds` without any request, with complete data from every pool and at least one
  replica, the pools go to sleep.

Invariants: a held request always wakes; a wake counts as activity (the caller sets lastActiveTime to the
tick that saw the held request), so a woken service sleeps again only after another full `idle_seconds`
without requests: no flapping between sleep and wake; sleeping never changes replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

from .policy_types import SleepChange


@dataclass(frozen=True, slots=True)
class SleepStep:
    asleep_since: float | None  # the pools' sleep state after this decision (None: awake)
    change: SleepChange | None  # "sleep" or "wake" when this decision changes it
    note: str  # a clause for the decision's reason ("" when there is nothing to say)


AWAKE = SleepStep(None, None, "")


def sleep_step(
    asleep_since: float | None,
    *,
    is_enabled: bool,
    is_held: bool,
    idle_for: float,
    idle_seconds: float,
    is_complete: bool,
    has_replicas: bool,
    now: float,
) -> SleepStep:
    """The sleep state after one decision, from the state before it (`asleep_since`) and the tick's inputs:
    `is_held` (the router holds requests for a pool), `idle_for` (seconds since the last request),
    `is_complete` (every pool's data complete) and `has_replicas` (any pool has a replica)."""
    if asleep_since is not None:
        if not is_enabled:
            return SleepStep(None, "wake", "autoscaling.idle is no longer sleep: waking the pools")
        if is_held:
            return SleepStep(None, "wake", "router holds requests: waking the pools")
        if not has_replicas:
            return AWAKE  # nothing left asleep (every pool at zero): the next replica starts awake
        return SleepStep(asleep_since, None, "asleep (idle): a request held by the router wakes the pools")
    if is_enabled and has_replicas and is_complete and not is_held and idle_for >= idle_seconds:
        note = f"no requests for {idle_for:.0f}s >= idleSeconds {idle_seconds:g}: putting the pools to sleep"
        return SleepStep(now, "sleep", note)
    return AWAKE
