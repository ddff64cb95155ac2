"""Status writes are paced per key: counts and messages at most once per `status_interval_seconds`
(the latest state, written by one wake-up timer), transitions at once. A pool of thousands of pods
must not cost a status write per pod event (an operator fuzz run with `router.replicas: 7032` made
~5,100 status PATCHes in 4 minutes before this)."""

from __future__ import annotations

import asyncio
import copy

from fake_api import NAME, NS, SPEC, with_controller

from tidepool.operator.api import InferenceServiceStatus, PoolStatus
from tidepool.operator.status_write import is_routine

KEY = (NS, NAME)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def status(
    ready: str = "False", reason: str = "ReplicasNotReady", message: str = "0/4", **fields
) -> InferenceServiceStatus:
    base = InferenceServiceStatus(
        observed_generation=1,
        pools={"unified": PoolStatus(replicas=0, ready_replicas=0, updated_replicas=0, desired_replicas=4)},
        url="http://svc",
        selector="a=b",
    )
    base.set_condition("Ready", ready, reason, message, 1, "2026-01-01T00:00:00Z")  # type: ignore[arg-type]
    return base.model_copy(update=fields)


def test_only_counts_and_messages_are_routine():
    before = status()
    counted = status(message="2/4", pools={"unified": PoolStatus(replicas=3, ready_replicas=2, desired_replicas=4)})
    assert is_routine(before, counted)
    assert is_routine(before, status(replicas=3))
    assert not is_routine(before, status(ready="True", message="2/4"))  # a condition's status
    assert not is_routine(before, status(reason="Unschedulable"))  # its reason
    assert not is_routine(before, status(observed_generation=2))
    assert not is_routine(before, status(url="http://other"))
    assert not is_routine(before, status(selector="a=c"))
    assert not is_routine(before, status(pools={}))  # a pool goes (or comes)
    renewed = status()
    renewed.conditions[0] = renewed.conditions[0].model_copy(update={"observed_generation": 2})
    assert not is_routine(before, renewed)  # a condition about a newer generation


def pool_spec(replicas: int) -> dict:
    spec = copy.deepcopy(SPEC)
    spec["pools"] = {"unified": {"replicas": replicas, "minReplicas": 1, "maxReplicas": replicas}}
    return spec


def test_counts_are_paced_transitions_are_not_and_the_latest_count_is_written():
    clock = Clock()
    api, ctrl = with_controller(pool_spec(40), clock)
    interval = ctrl.options.status_interval_seconds
    assert interval > 0

    async def run() -> None:
        await ctrl.services.sync(KEY)  # the first status: written
        assert api.calls["patch_status"] == 1
        router = f"{NAME}-router"
        for i in range(2):  # router.replicas defaults to 2
            api.add_pod(f"{router}-{i}", "router", api.hash_of(router))
        api.add_pod(f"{NAME}-unified-0", "unified", api.hash_of(f"{NAME}-unified"))
        await ctrl.services.sync(KEY)  # Ready goes True: a transition, written at once however recent the last write
        assert api.calls["patch_status"] == 2 and api.condition("Ready")["status"] == "True"

        # 38 pods, each its own event and sync, inside one interval: counts only, nothing written yet.
        for i in range(1, 39):
            clock.now += interval / 50
            api.add_pod(f"{NAME}-unified-{i}", "unified", api.hash_of(f"{NAME}-unified"))
            await ctrl.services.sync(KEY)
        assert api.calls["patch_status"] == 2
        assert api.service()["status"]["pools"]["unified"]["readyReplicas"] == 1
        assert ctrl.queue.num_delayed == 1  # one wake-up for the key, not one per deferred sync

        assert 0 < ctrl.queue.fire_due() <= interval  # not due yet
        clock.now += interval  # due: the timer adds the key, and its sync writes the latest counts
        assert ctrl.queue.fire_due() is None and ctrl.queue.num_delayed == 0
        await ctrl.services.sync(KEY)
        assert api.calls["patch_status"] == 3
        assert api.service()["status"]["pools"]["unified"]["readyReplicas"] == 39

        # The 40th pod completes the rollout (Progressing goes False): written at once.
        clock.now += interval / 50
        api.add_pod(f"{NAME}-unified-39", "unified", api.hash_of(f"{NAME}-unified"))
        await ctrl.services.sync(KEY)
        assert api.calls["patch_status"] == 4
        assert api.condition("Progressing")["status"] == "False"
        assert api.service()["status"]["pools"]["unified"]["readyReplicas"] == 40

        # Nothing changed: nothing written, nothing scheduled.
        clock.now += 10 * interval
        await ctrl.services.sync(KEY)
        assert api.calls["patch_status"] == 4 and ctrl.queue.fire_due() is None

    asyncio.run(run())


def test_a_routine_change_after_a_quiet_interval_is_written_at_once():
    clock = Clock()
    api, ctrl = with_controller(pool_spec(4), clock)

    async def run() -> None:
        await ctrl.services.sync(KEY)
        api.add_pod(f"{NAME}-unified-0", "unified", api.hash_of(f"{NAME}-unified"), ready=False)
        clock.now += ctrl.options.status_interval_seconds  # the last write is an interval old
        await ctrl.services.sync(KEY)
        assert api.calls["patch_status"] == 2 and ctrl.queue.num_delayed == 0
        assert api.service()["status"]["pools"]["unified"]["replicas"] == 1

    asyncio.run(run())
