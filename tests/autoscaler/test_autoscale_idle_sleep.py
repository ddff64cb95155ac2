"""`autoscaling.idle: sleep` in the pure policy: when idle pools go to sleep, what wakes them, and no flapping.

The policy is driven tick by tick on a fake clock (`now` is an argument, the History it returns is fed back),
as the autoscaler's timer does every 15 s: a busy service that goes quiet sleeps after idleSeconds with its
replicas kept, stays asleep (told once), wakes on the first request the router holds, and sleeps again only
after another full idleSeconds. `sleep_step` (idle.py) is also checked rule by rule.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from autoscale_helpers import pd_config, snap, state, unified_config

from tidepool.operator.autoscaler.idle import AWAKE, sleep_step
from tidepool.operator.autoscaler.policy import decide
from tidepool.operator.autoscaler.policy_types import (
    AutoscaleConfig,
    Decision,
    History,
    PoolBounds,
    PoolSnapshot,
    PoolState,
)

STEP_S = 15.0
IDLE_S = 300.0


def busy(pods: int) -> PoolSnapshot:
    return snap(pods, kv_cache_usage=0.5)


def quiet(pods: int) -> PoolSnapshot:
    """A complete scrape of `pods` idle pods: no request in the window, nothing running or waiting."""
    return snap(pods, num_requests=0.0, num_running=0.0, ttft_p95_s=None, itl_p95_s=None, kv_cache_usage=0.0)


def held(pods: int) -> PoolSnapshot:
    """Idle pods while the router holds requests for the pool (it does so while the engines sleep)."""
    return replace(quiet(pods), held_requests=2.0)


class Clock:
    """Successive decisions STEP_S apart, each one's History and replicas fed to the next (the operator's loop)."""

    def __init__(self, config: AutoscaleConfig, replicas: dict[str, int], now: float = 10_000.0) -> None:
        self.config, self.replicas, self.now = config, dict(replicas), now
        self.history = History(last_active_time=now)
        self.decisions: list[Decision] = []

    def tick(self, make_snapshot, **per_pool) -> Decision:
        """One decision; `make_snapshot(pods)` gives each pool's scrape, or `per_pool[name]` that pool's."""
        snaps = {name: per_pool.get(name, make_snapshot)(n) for name, n in self.replicas.items()}
        current = {name: PoolState(n) for name, n in self.replicas.items()}
        decision = decide(self.config, snaps, current, self.history, self.now)
        self.history, self.replicas = decision.history, dict(decision.replicas)
        self.decisions.append(decision)
        self.now += STEP_S
        return decision

    def ticks(self, make_snapshot, seconds: float) -> list[Decision]:
        return [self.tick(make_snapshot) for _ in range(int(seconds / STEP_S))]


def sleepy(**overrides) -> AutoscaleConfig:
    return unified_config(sleep_when_idle=True, idle_seconds=IDLE_S, pools={"unified": PoolBounds(1, 8)}, **overrides)


def test_idle_pools_sleep_after_idle_seconds_with_their_replicas_kept() -> None:
    clock = Clock(sleepy(), {"unified": 2})
    clock.ticks(busy, 60)
    before = clock.ticks(quiet, IDLE_S - STEP_S)
    assert not any(d.is_asleep for d in before)
    slept = clock.tick(quiet)
    assert slept.is_asleep and slept.sleep_change == "sleep"
    assert "putting the pools to sleep" in slept.reason and "idleSeconds 300" in slept.sleep_reason
    assert slept.history.asleep_since == clock.now - STEP_S
    assert slept.replicas["unified"] >= 1  # kept (scale-down to minReplicas may have happened while idle)
    later = clock.ticks(quiet, 3600)
    assert all(d.is_asleep and d.sleep_change is None for d in later)  # told once, not per tick
    assert all(d.replicas["unified"] >= 1 for d in later)  # never to zero


def test_a_held_request_wakes_the_pools_and_counts_as_activity() -> None:
    clock = Clock(sleepy(), {"unified": 1})
    clock.ticks(quiet, IDLE_S + STEP_S)
    assert clock.decisions[-1].is_asleep
    woke = clock.tick(held)
    assert not woke.is_asleep and woke.sleep_change == "wake" and "router holds requests" in woke.reason
    assert woke.history.last_active_time == clock.now - STEP_S
    assert woke.replicas == {"unified": 1}


def test_no_flapping_one_sleep_and_one_wake_per_quiet_period() -> None:
    """Held requests linger for a few ticks after a wake (the router releases them on its next probe), and then
    the service is quiet again: it sleeps once more only after a further full idleSeconds."""
    clock = Clock(sleepy(), {"unified": 1})
    for _ in range(3):
        clock.ticks(quiet, IDLE_S + STEP_S)
        clock.ticks(held, 3 * STEP_S)
    assert [d.sleep_change for d in clock.decisions if d.sleep_change] == ["sleep", "wake"] * 3
    sleeps = [d for d in clock.decisions if d.sleep_change == "sleep"]
    wakes = [i for i, d in enumerate(clock.decisions) if d.sleep_change == "wake"]
    for wake, sleep in zip(wakes, [clock.decisions.index(s) for s in sleeps][1:], strict=False):
        last_held = wake + 2  # the wake is the first of three ticks with held requests
        assert (sleep - last_held) * STEP_S >= IDLE_S  # a full quiet period after the last held request


def test_steady_load_never_sleeps() -> None:
    clock = Clock(sleepy(), {"unified": 2})
    assert not any(d.is_asleep or d.sleep_change for d in clock.ticks(busy, 4 * IDLE_S))


def test_incomplete_data_never_sleeps() -> None:
    clock = Clock(sleepy(), {"unified": 2})
    missing = lambda pods: replace(quiet(pods), num_pods_failed=1)  # noqa: E731
    assert not any(d.is_asleep for d in clock.ticks(missing, 3 * IDLE_S))


def test_scale_to_zero_stays_the_default_behaviour() -> None:
    clock = Clock(unified_config(scale_to_zero=True, idle_seconds=IDLE_S, pools={"unified": PoolBounds(0, 8)}),
                  {"unified": 2})  # fmt: skip
    clock.ticks(quiet, IDLE_S + STEP_S)
    assert clock.replicas == {"unified": 0}
    assert not any(d.is_asleep or d.sleep_change for d in clock.decisions)


def test_both_disaggregated_pools_sleep_and_wake_together() -> None:
    config = pd_config(sleep_when_idle=True, idle_seconds=IDLE_S)
    clock = Clock(config, {"prefill": 1, "decode": 2})
    clock.ticks(quiet, IDLE_S + STEP_S)
    assert clock.decisions[-1].is_asleep and clock.replicas["prefill"] >= 1 and clock.replicas["decode"] >= 1
    only_decode_held = clock.tick(quiet, decode=held)
    assert only_decode_held.sleep_change == "wake" and not only_decode_held.is_asleep


def test_advisory_reports_the_sleep_but_never_sleeps() -> None:
    clock = Clock(sleepy(is_advisory=True), {"unified": 1})
    decisions = clock.ticks(quiet, 2 * IDLE_S)
    assert not any(d.is_asleep or d.sleep_change for d in decisions)
    assert "advisory (not applied)" in decisions[-1].reason and "to sleep" in decisions[-1].reason


def test_no_longer_idle_sleep_wakes_a_sleeping_service() -> None:
    clock = Clock(sleepy(), {"unified": 1})
    clock.ticks(quiet, IDLE_S + STEP_S)
    clock.config = unified_config(idle_seconds=IDLE_S, pools={"unified": PoolBounds(1, 8)})
    woke = clock.tick(quiet)
    assert woke.sleep_change == "wake" and not woke.is_asleep and "no longer sleep" in woke.reason


def test_a_restored_history_keeps_sleeping() -> None:
    """An operator restarted while the pools sleep resumes from status (asleepSince) without telling again."""
    now = 50_000.0
    history = History(last_active_time=now - 2 * IDLE_S, asleep_since=now - IDLE_S)
    decision = decide(sleepy(), {"unified": quiet(1)}, {"unified": state(1)}, history, now)
    assert decision.is_asleep and decision.sleep_change is None and decision.history.asleep_since == now - IDLE_S


@pytest.mark.parametrize(
    ("asleep_since", "inputs", "expected"),
    [
        (None, dict(idle_for=IDLE_S), (1000.0, "sleep")),
        (None, dict(idle_for=IDLE_S - 1), (None, None)),
        (None, dict(idle_for=IDLE_S, is_complete=False), (None, None)),
        (None, dict(idle_for=IDLE_S, has_replicas=False), (None, None)),  # at zero: nothing to put to sleep
        (None, dict(idle_for=IDLE_S, is_enabled=False), (None, None)),
        (None, dict(idle_for=IDLE_S, is_held=True), (None, None)),
        (900.0, dict(idle_for=IDLE_S), (900.0, None)),
        (900.0, dict(idle_for=0.0, is_held=True), (None, "wake")),
        (900.0, dict(idle_for=IDLE_S, is_enabled=False), (None, "wake")),
        (900.0, dict(idle_for=IDLE_S, has_replicas=False), (None, None)),
    ],
)
def test_sleep_step_rules(asleep_since: float | None, inputs: dict, expected: tuple) -> None:
    args = dict(is_enabled=True, is_held=False, is_complete=True, has_replicas=True, idle_seconds=IDLE_S, now=1000.0)
    step = sleep_step(asleep_since, **{**args, **inputs})
    assert (step.asleep_since, step.change) == expected
    assert bool(step.note) == (step != AWAKE)
