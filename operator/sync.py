"""One InferenceService key's sync, from the caches: what a worker runs for a key it took.

`sync(key)`:
1. read the InferenceService from the cache (gone: forget its `ServiceState`, and delete the cache
   claims that claims.py says go now (reclaimPolicy Delete, creator gone, named by no service); being
   deleted: nothing to do, the garbage collector removes the children through their owner references (a
   cache claim has none); a finalizer left by an older operator is removed so deletes never wait for us);
2. parse the spec once (`ServiceView.from_body`; a spec equal to the last one parsed reuses its view,
   `ServiceState.view_of`): an invalid spec is reported (InvalidSpec) and nothing else happens; the view
   is what the autoscaler and the builders read;
3. the autoscaler's tick when it is due (autoscaler/handlers.py; it writes `status.autoscaling`); with
   the autoscaler off or external, a `status.autoscaling` an earlier mode left is removed once; then
   spec.model's floating hf:// revision is pinned to its commit, resolved once per spec and kept in
   `status.model` (revision.py); a failure is reported (RevisionUnresolved) and nothing is applied;
4. reconcile, as a short list of steps (`_reconcile`), the API-key Secret check (api_keys.py: spec.auth's
   Secret present, its key for the pods' protected endpoints) and the LoRA step among them (operator/lora/sync.py:
   declared adapters onto serving replicas, status.lora). Fast path: when the generation, the
   autoscaler's replicas and the cluster features are those last verified and every child's version
   (generation for workloads, resourceVersion otherwise) is one already verified to match the spec,
   nothing is built or compared: only status is recomputed from cached workloads and pods. Otherwise
   (a `full` key: the jittered resync, the safety net for anything a watch could miss) the builders
   run, `plan()` compares every child and `Plan.execute` applies and prunes (reconcile.py); the
   make-before-break leftovers go once the new pools serve (`Plan.prune_deferred`). Before executing,
   pause and the operator-wide rollout budget have their say (rollout.py `steer`: a paused service gets
   nothing applied, a rollout without a slot is held and queued); after status is computed, the budget
   learns what the sync saw (`observed_rollout`: a finished or stalled rollout frees its slot and wakes
   the next waiting services);
5. write status if it changed, with the resourceVersion it was computed from. A transition (a
   condition's status or reason, observedGeneration, URL, selector, the set of pools) is written at
   once; a routine change (counts, messages: `is_routine`) at most once per `status_interval_seconds`
   per key, by a wake-up timer that syncs the key again, so the latest state is what gets written.

Invariants: everything kept about a key is in its `ServiceState` (state.py); a child version is recorded
as verified only from the cache snapshot this reconcile compared or from what its own writes returned;
one pending wake-up timer per key (autoscaler ticks, paced status); an error raises (the worker
re-queues the key with backoff) after status says why. Events are posted for real transitions only
(Created, Scaled, RollingOut, DriftCorrected, Pruned, InvalidSpec, ApplyFailed), and ClaimKept when a
claim starts keeping what the spec cannot change, ClaimExists when a claim the spec would create exists
and is used as it is (each once while it lasts). The recorder aggregates them (events.py: one Event per
object, reason and message, its count moved). Status is written only when it differs from the object's
(`status_patch`); a condition's lastTransitionTime moves only with its status, and nothing in status is a
clock that moves by itself, so a steady service costs no status write.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from tidepool.operator.api import Condition, InferenceServiceStatus, ServiceView, now_rfc3339
from tidepool.operator.api.status import ModelStatus, OperatorDefaults
from tidepool.operator.api_keys import ApiKeys
from tidepool.operator.autoscaler.handlers import Autoscaler, applied_replicas
from tidepool.operator.builders import WORKLOAD_KINDS, ChildKey, ClusterFeatures, Desired, SpecError
from tidepool.operator.builders.common import inherited_labels
from tidepool.operator.cache import SERVICE_KIND, Cached, Key, PodInfo, Store
from tidepool.operator.claims import created_claims, with_shared_claims
from tidepool.operator.events import EventRecorder
from tidepool.operator.features import refused_optional, sticky_kinds
from tidepool.operator.k8s import ApiError, KubeClient
from tidepool.operator.legacy import LEGACY_FINALIZER, drop_legacy_finalizer
from tidepool.operator.lora.sync import LoraOutcome, LoraSync
from tidepool.operator.metrics import STATUS_DEFERRED, STATUS_WRITES
from tidepool.operator.observe import downloads_in_progress, observe, observe_pool, old_pools, pod_problems
from tidepool.operator.reconcile import Event, Plan, desire, plan, pruned_event
from tidepool.operator.revision import Resolver
from tidepool.operator.rollout import Held, RolloutBudget, is_paused, observed_rollout, show_held, steer
from tidepool.operator.state import ServiceState, Verified
from tidepool.operator.status import Outcome, build_status
from tidepool.operator.status_write import is_routine, status_patch, write_status
from tidepool.operator.sync_steps import SyncSteps
from tidepool.operator.workqueue import WorkQueue

logger = logging.getLogger("tidepool.operator")
ONCE_WHILE_IT_LASTS = ("ClaimKept", "ClaimExists")  # Event reasons told once while their message stays the same


@dataclass(frozen=True, slots=True)
class ControllerOptions:
    resync_seconds: float = 600.0
    workers: int = 16
    features: ClusterFeatures = field(default_factory=ClusterFeatures)  # options; CRD presence is detected
    feature_recheck_seconds: float = 300.0  # how often optional CRDs (LWS, ServiceMonitor, InferencePool) are looked up
    # Routine status writes (counts, messages) of one key at most this often; transitions are written at once. 5 s,
    # not 1: a new service's counts change once or twice in the seconds before it turns Ready, and each write is a
    # custom-resource PATCH the API server validates (bench/README.md "Operator at scale"); counts lag <= 5 s.
    status_interval_seconds: float = 5.0
    max_concurrent_rollouts: int = 5  # services replacing pods at once (rollout.py); 0: no limit


@dataclass(slots=True)
class Pass:
    """One reconcile of one key: the desired state, the plan carried out (empty on the fast path), what it
    established and the Events it tells."""

    desired: Desired
    # The child versions this reconcile checks against the spec: the cache snapshot it compares, then what
    # its own writes returned. Never re-read from the cache afterwards: a hand edit or delete arriving while
    # this reconcile awaits must not be recorded as verified (it would take the fast path next time and stay
    # until the resync).
    versions: dict[ChildKey, str]
    workloads: dict[ChildKey, Mapping[str, Any]]
    plan: Plan = field(default_factory=Plan)
    error: str | None = None  # the API server refused a child
    events: list[Event] = field(default_factory=list)
    held: Held | None = None  # paused, or its rollout queued (rollout.py): what Progressing says instead
    is_applied: bool = True  # every change of this generation carried out (not paused or queued with changes)
    defaults: OperatorDefaults | None = None  # the operator defaults to record in status (None: keep them)


def _workloads(objs: Mapping[ChildKey, Mapping[str, Any]]) -> dict[ChildKey, Mapping[str, Any]]:
    return {k: v for k, v in objs.items() if k[0] in WORKLOAD_KINDS}


def _message(exc: Exception) -> str:
    return str(exc).replace("\n", " ")


class ServiceSync(SyncSteps):
    """The per-key sync and the per-key state (one `ServiceState` per InferenceService)."""

    def __init__(
        self,
        client: KubeClient,
        options: ControllerOptions,
        store: Store,
        queue: WorkQueue,
        events: EventRecorder,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client, self.options, self.store, self.queue, self.events = client, options, store, queue, events
        self._clock = clock
        self.features = options.features  # the controller updates them when optional CRDs come or go
        self.autoscaler: Autoscaler | None = None
        self.lora: LoraSync | None = None  # the LoRA step; None: adapters are not managed (tests of other parts)
        self.api_keys = ApiKeys(client, events, clock)  # spec.auth's Secret: checked, its key sent to pods
        # Floating hf:// revisions -> commits (revision.py); None: each pod resolves its own (--no-resolve-revisions).
        self.revisions: Resolver | None = None
        self.pins: dict[Key, ModelStatus] = {}  # each key's resolved revision until status records it
        self.states: dict[Key, ServiceState] = {}
        self.budget = RolloutBudget(options.max_concurrent_rollouts)  # which services may replace pods now
        self.recheck_features = asyncio.Event()  # set when an optional kind's apply failed
        self.num_syncs = 0
        self.num_full = 0

    def is_known(self, key: Key) -> bool:
        """Reconciled before, successfully (the work queue serves such keys first)."""
        state = self.states.get(key)
        return state is not None and state.verified is not None

    def due_for_resync(self, now: float) -> list[Key]:
        """The keys whose safety-net full reconcile is due (each returned once per full reconcile)."""
        due = [key for key, state in self.states.items() if state.resync_due is not None and state.resync_due <= now]
        for key in due:
            self.states[key].resync_due = None
        return due

    def forget(self, key: Key) -> None:
        """The service is gone: drop its state, its autoscaler metric series with it."""
        self.pins.pop(key, None)
        state = self.states.pop(key, None)
        if state is not None:
            state.autoscale.reset()
            state.lora.cancel()
        self._let_start(self.budget.forget(key))

    def _let_start(self, keys: list[Key]) -> None:
        """Sync the waiting services a freed rollout slot lets start (rollout.py)."""
        for key in keys:
            self.queue.add(key)

    def _wake(self, key: Key, state: ServiceState, delay_s: float) -> None:
        """Sync `key` again in `delay_s`: one timer per key (syncs triggered by events must not add more).

        A pending timer due no later than this one covers it: the sync it runs asks again for
        whatever is still ahead (the next tick, a status write still paced)."""
        now = self._clock()
        pending = state.wake_at
        if pending is not None and now <= pending <= now + delay_s + 0.5:
            return
        state.wake_at = now + delay_s
        self.queue.add_after(key, delay_s + 0.01)

    async def sync(self, key: Key, full: bool = False) -> None:
        self.num_syncs += 1
        if not self.budget.is_started:  # the caches are filled before the first sync: every service known now
            self.budget.start(self.store.service_keys())
        cached = self.store.service(key)
        if cached is None:
            self.forget(key)
            await self._reclaim(key[0])
            return
        body = cached.body()
        if LEGACY_FINALIZER in (body["metadata"].get("finalizers") or []):
            body = await drop_legacy_finalizer(self.client, body)
            self.store.put({**body, "kind": SERVICE_KIND})
            logger.info("[%s/%s] removed the finalizer of an older operator version", *key)
        if body["metadata"].get("deletionTimestamp"):
            self._let_start(self.budget.forget(key))
            return
        state = self.states.setdefault(key, ServiceState())
        try:
            view = state.view_of(body)
        except (ValidationError, SpecError) as exc:
            await self._invalid(key, body, state, _message(exc))
            return
        body = await self._autoscale(key, view, body, state)
        view = await self._pin(key, body, view, state)
        await self._reconcile(key, body, view, state, full)

    async def _autoscale(
        self, key: Key, view: ServiceView, body: dict[str, Any], state: ServiceState
    ) -> dict[str, Any]:
        """The autoscaler's step (a tick when due; or, when it does not tick for this spec, clearing what an
        earlier mode left); returns the object as it is after the step's status write."""
        if self.autoscaler is None:
            return body
        if view.is_autoscaled:
            updated = body
            if self.autoscaler.seconds_until_due(state.autoscale) <= 0:
                updated = await self.autoscaler.tick(key, view, body, state.autoscale, state.api_key.key)
            self._wake(key, state, self.autoscaler.seconds_until_due(state.autoscale))
        else:  # off or external: forget it, and clear the status.autoscaling an earlier mode left
            updated = await self.autoscaler.clear(key, body, state.autoscale)
        if updated is body:
            return body
        self.store.put({**updated, "kind": SERVICE_KIND})
        return dict(updated)

    async def _reconcile(
        self, key: Key, body: dict[str, Any], view: ServiceView, state: ServiceState, full: bool
    ) -> None:
        meta = body["metadata"]
        generation = int(meta.get("generation", 1))
        replicas, scaling_limit = applied_replicas(view, body.get("status") or {})
        replicas_key = tuple(sorted((replicas or {}).items()))
        inherited = tuple(inherited_labels(meta.get("labels")).items())  # the children carry them: not in generation
        fingerprint = (
            meta["uid"], generation, replicas_key, self.features, is_paused(meta), view.model.revision, inherited
        )  # fmt: skip
        children = {**self.store.children_of(key, meta["uid"]), **created_claims(self.store, key)}
        pods = self.store.pods_of(key)
        previous = InferenceServiceStatus.model_validate(body.get("status") or {})
        versions = {k: c.version for k, c in children.items()}
        verified = None if full else state.verified
        if verified is not None and verified.covers(fingerprint, versions):
            done = Pass(verified.desired, versions, _workloads({k: c.body() for k, c in children.items()}))
        else:
            verified = None
            done = await self._carry_out(key, body, view, replicas, children, pods, versions, state)
            if done is None:  # the builders refused the spec: status says why
                return
        auth = await self._api_key(key, body, view, state)
        lora = await self._lora(key, view, pods, state, auth.key)
        status = await self._settle(key, done, previous, pods, scaling_limit, generation, lora, auth.problem)
        status.model = self.pins.get(key)
        self._steered(key, done, pods, previous.condition("Progressing"), status)
        self._remember(state, fingerprint, done, is_full=verified is None)
        await self._write(key, body, state, previous, status)
        for type_, reason, message in done.events:
            await self.events.post(body, type_, reason, message)
        if done.error:
            raise ApiError(422, done.error, "ApplyFailed")  # retried with backoff; status already says why

    async def _carry_out(
        self,
        key: Key,
        body: dict[str, Any],
        view: ServiceView,
        replicas: Mapping[str, int] | None,
        children: Mapping[ChildKey, Cached],
        pods: list[PodInfo],
        versions: dict[ChildKey, str],
        state: ServiceState,
    ) -> Pass | None:
        """The full path: build, compare every child, apply and prune. None when the builders refuse the spec."""
        self.num_full += 1
        uid = body["metadata"]["uid"]
        cached = {k: c.body() for k, c in children.items()}
        kinds = sticky_kinds(cached)  # an existing multi-node pool keeps its workload kind
        observed = cached

        def planned(features: ClusterFeatures) -> tuple[Desired, Plan]:
            nonlocal observed
            desired = desire(view, body["metadata"], features, replicas, kinds)
            observed = with_shared_claims(cached, desired.children, lambda kind, name: self._found(key, kind, name))
            todo = plan(desired.children, observed, uid)
            if todo.deferred:  # a mode or topology switch: make before break
                before, _ = observe(desired, _workloads(observed), pods)
                todo.hold_router(desired, observed, all(p.is_serving_current for p in before))
            return desired, todo

        recorded = InferenceServiceStatus.model_validate(body.get("status") or {}).operator_defaults
        try:  # pause and the rollout budget have their say (rollout.py)
            now = self._clock()
            steering = steer(key, body["metadata"], recorded, self.features, cached, planned, self.budget, now)
        except (ValidationError, SpecError) as exc:
            await self._invalid(key, body, state, _message(exc))
            return None
        self._let_start(steering.wake)
        desired, todo = steering.desired, steering.plan
        applied, error = await todo.execute(self.client, self.store, versions, (key[1], uid))
        if error and refused_optional(todo.apply, applied):
            self.recheck_features.set()  # its CRD may be gone: discovery now, not at the next period
        events = self._untold(state, todo.events) + ([pruned_event(todo.prune)] if todo.prune else [])
        workloads = _workloads({**observed, **applied})
        done = Pass(desired, versions, workloads, todo, error, events, steering.held, steering.is_applied)
        done.defaults = steering.defaults
        return done

    def _steered(
        self, key: Key, done: Pass, pods: list[PodInfo], before: Condition | None, status: InferenceServiceStatus
    ) -> None:
        """After status is computed: the rollout budget learns what the sync saw (a finished or stalled rollout
        frees its slot), status records the operator defaults rolled out and says paused or queued (rollout.py)."""
        replacing, now = bool(done.plan.deferred), self._clock()
        self._let_start(observed_rollout(self.budget, key, done.desired, done.workloads, pods, replacing, status, now))
        if done.defaults is not None:
            status.operator_defaults = done.defaults
        if done.held is not None:
            done.events += show_held(status, done.held, before, now_rfc3339())

    async def _settle(
        self,
        key: Key,
        done: Pass,
        previous: InferenceServiceStatus,
        pods: list[PodInfo],
        scaling_limit: tuple[str, str] | None,
        generation: int,
        lora: LoraOutcome,
        auth_problem: str | None = None,
    ) -> InferenceServiceStatus:
        """Observe the pools, prune what make-before-break kept once the new pools serve, and compute status."""
        pools, router = observe(done.desired, done.workloads, pods)
        members = [*pools, *([router] if router else [])]
        serving = all(m.is_serving_current for m in members)
        if done.plan.deferred and not done.error and not done.plan.held_router and serving:
            done.events.append(await done.plan.prune_deferred(self.client, self.store, done.versions))
        elif done.plan.deferred:
            logger.info("[%s/%s] keeping %d old children until the new pools serve", *key, len(done.plan.deferred))
        old = old_pools(done.plan.deferred, done.desired)
        replaced = [observe_pool(layout, done.workloads, pods) for layout in old]
        applied = done.error is None and done.is_applied  # paused or queued with changes: generation not applied
        outcome = Outcome(apply_error=done.error, applied=applied, scaling_limit=scaling_limit)
        outcome.adapter_failures = lora.failures
        outcome.auth_problem = auth_problem
        if not all(m.is_complete for m in members):
            outcome.pod_problems = pod_problems(pods)
            outcome.downloading = downloads_in_progress(pods)
        if done.error:
            degraded = previous.condition("Degraded")
            if degraded is None or degraded.message != done.error:
                done.events.append(("Warning", "ApplyFailed", done.error))
        d = done.desired
        status = build_status(
            previous, generation, pools, router, outcome, d.url, d.selector, d.scaled_pool, now_rfc3339(), replaced
        )
        status.lora = lora.status
        return status

    def _remember(self, state: ServiceState, fingerprint: tuple[Any, ...], done: Pass, is_full: bool) -> None:
        """What this reconcile established: the fast path's evidence (none after an error) and, after a full
        reconcile, when the next safety-net resync is due."""
        if done.error:
            state.verified = None
        else:
            waiting = bool(done.plan.deferred) or done.plan.held_router or done.held is not None
            state.verified = Verified(fingerprint, done.versions, done.desired.without_children(), waiting)
        if is_full:
            state.resync_due = time.monotonic() + self.options.resync_seconds * random.uniform(0.9, 1.1)

    def _untold(self, state: ServiceState, events: list[Event]) -> list[Event]:
        """A full reconcile's events, less the ClaimKept and ClaimExists ones its previous one already told (a
        claim keeps what the spec cannot change, or is used as it is, for as long as both stay as they are: say
        so once, and again only after it stopped)."""
        told = state.claims_kept
        state.claims_kept = {message for _, reason, message in events if reason in ONCE_WHILE_IT_LASTS}
        return [e for e in events if e[1] not in ONCE_WHILE_IT_LASTS or e[2] not in told]

    def _found(self, key: Key, kind: str, name: str) -> dict[str, Any] | None:
        found = self.store.find(kind, key[0], name)
        return None if found is None else found.body()

    async def _write(
        self,
        key: Key,
        body: dict[str, Any],
        state: ServiceState,
        previous: InferenceServiceStatus,
        status: InferenceServiceStatus,
    ) -> None:
        patch = status_patch(previous, status)
        if patch is None:
            return
        routine = is_routine(previous, status)
        if routine:
            # Counts and messages only: at most one write per interval, the latest state when it comes (a
            # pool of thousands of pods would otherwise cost a status write per pod event).
            last = state.status_written_at
            wait = 0.0 if last is None else last + self.options.status_interval_seconds - self._clock()
            if wait > 0:
                STATUS_DEFERRED.inc()
                self._wake(key, state, wait)
                return
        updated = await write_status(self.client, body, patch)
        state.status_written_at = self._clock()
        if updated is not None:
            STATUS_WRITES.labels("routine" if routine else "transition").inc()
            self.store.put({**updated, "kind": SERVICE_KIND})
        ready = status.condition("Ready")
        if ready is not None:
            logger.info("[%s/%s] Ready=%s %s: %s", *key, ready.status, ready.reason, ready.message[:300])

    async def _invalid(self, key: Key, body: dict[str, Any], state: ServiceState, message: str) -> None:
        previous = InferenceServiceStatus.model_validate(body.get("status") or {})
        generation = int(body["metadata"].get("generation", 1))
        outcome = Outcome(spec_error=message)
        status = build_status(previous, generation, [], None, outcome, None, None, None, now_rfc3339())
        degraded = previous.condition("Degraded")
        state.verified = None
        self._let_start(self.budget.observe(key, None, False, False, True, self._clock()))  # a stalled rollout
        await self._write(key, body, state, previous, status)
        if degraded is None or degraded.reason != "InvalidSpec" or degraded.message != message:
            logger.info("[%s/%s] invalid spec: %s", *key, message)
            await self.events.post(body, "Warning", "InvalidSpec", message[:1000])
