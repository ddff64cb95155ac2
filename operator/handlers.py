"""kopf wiring: every InferenceService handler calls the same `reconcile()`; this module stays thin.

- create / update / resume: reconcile; while the service is not Ready raise `kopf.TemporaryError`
  (short, growing delay) so status follows the pods; an impossible spec raises `kopf.PermanentError`
  after the status says why.
- timer (every `--resync-seconds`): reconcile again, which reverts hand edits to children and keeps
  status current when pods come and go. A kopf timer needs a finalizer; ours is
  `tidepool.dev/finalizer`, released by kopf at once on deletion (there is no deletion work: the
  children are garbage-collected through their owner references).
- a Deployment/StatefulSet event of one of ours: a status-only refresh of its InferenceService
  (looked up in a kopf index of InferenceService bodies), so Ready follows pods without polling.
- Events (create, scale, rollout, drift, errors) are posted with `kopf.event`.
- kopf keeps its handler progress in annotations under `tidepool.dev/` (not in status, which the
  CRD schema prunes); no peering (`--standalone`), no cluster scanning (needs no CRD read access).

Autoscaler seam: `memo.replicas_overrides[(namespace, name)] = {"decode": 3, ...}` then
`await reconcile_object(body, memo)`; the override wins over the spec's replicas until removed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf

from tidepool.operator.api import GROUP, PLURAL, VERSION, now_rfc3339
from tidepool.operator.builders import LABEL_SERVICE, MANAGED_BY, ClusterFeatures
from tidepool.operator.k8s import ApiError, Credentials, KubeClient
from tidepool.operator.reconcile import ReconcileResult, reconcile

FINALIZER = "tidepool.dev/finalizer"
FEATURE_TTL_S = 60.0  # how often optional CRDs (LWS, ServiceMonitor) are looked up again
MAX_CONCURRENT_RECONCILES = 16
MAX_WAIT_RETRIES = 240  # ~1 h of TemporaryError retries; the resync timer takes over after that


@dataclass(slots=True)
class OperatorOptions:
    resync_seconds: float = 60.0
    gpus_per_node: int = 8
    router_image: str | None = None
    hf_download_image: str | None = None
    s3_download_image: str = "amazon/aws-cli:2.22.35"


@dataclass(slots=True)
class OperatorState:
    """Lives in kopf's memo: one client, the detected features, the autoscaler's overrides."""

    client: KubeClient
    options: OperatorOptions
    features: ClusterFeatures | None = None
    features_at: float = 0.0
    # Bounds reconciles in flight: 1,000 objects arriving at once each get done quickly in turn,
    # instead of all crawling (and timing out) together.
    slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(MAX_CONCURRENT_RECONCILES))
    replicas_overrides: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)
    applied_generation: dict[tuple[str, str], int] = field(default_factory=dict)  # fully applied by this process
    scaling_limits: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)

    async def current_features(self) -> ClusterFeatures:
        if self.features is None or time.monotonic() - self.features_at > FEATURE_TTL_S:
            opts = self.options
            self.features = ClusterFeatures(
                has_lws=await self.client.has_kind("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
                has_service_monitor=await self.client.has_kind("monitoring.coreos.com/v1", "ServiceMonitor"),
                gpus_per_node=opts.gpus_per_node,
                router_image=opts.router_image,
                hf_download_image=opts.hf_download_image,
                s3_download_image=opts.s3_download_image,
            )
            self.features_at = time.monotonic()
        return self.features


async def reconcile_object(body: Mapping[str, Any], memo: Any, status_only: bool = False) -> ReconcileResult:
    """Reconcile one InferenceService body with the operator's state; posts the Events it yields."""
    state: OperatorState = memo.tidepool
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    async with state.slots:
        result = await reconcile(
            state.client,
            body,
            await state.current_features(),
            now_rfc3339(),
            replicas_override=state.replicas_overrides.get(key),
            scaling_limit=state.scaling_limits.get(key),
            status_only=status_only,
        )
    for type_, reason, message in result.events:
        kopf.event(dict(body), type=type_, reason=reason, message=message[:1000])
    return result


async def _handle(body: Mapping[str, Any], memo: Any, logger: logging.Logger, retry: int) -> None:
    state: OperatorState = memo.tidepool
    meta = body["metadata"]
    key, generation = (meta["namespace"], meta["name"]), meta.get("generation")
    # A retry that only waits for pods (this generation fully applied by this process) reads status
    # and applies nothing: at 1,000 services full reconciles on every retry would swamp the API server.
    waiting = retry > 0 and state.applied_generation.get(key) == generation
    try:
        result = await reconcile_object(body, memo, status_only=waiting)
    except (ApiError, aiohttp.ClientError, TimeoutError) as exc:
        raise kopf.TemporaryError(f"API server: {exc!r}", delay=min(5 + 5 * retry, 60)) from exc
    if result.permanent_error:
        raise kopf.PermanentError(f"invalid spec: {result.permanent_error}")
    if result.apply_error:
        raise kopf.TemporaryError(result.apply_error, delay=min(5 + 5 * retry, 60))
    if result.applied or result.pruned:
        logger.info("applied %s; pruned %s", result.applied or "nothing", result.pruned or "nothing")
    if not waiting:
        state.applied_generation[key] = generation
    if not result.ready and retry < MAX_WAIT_RETRIES:
        ready = result.status.condition("Ready")
        # Child workload events refresh status as pods become ready; this retry is the fallback.
        raise kopf.TemporaryError(f"not ready yet: {ready.message if ready else ''}", delay=min(10 + 5 * retry, 60))


async def on_change(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, retry: int, **_: Any) -> None:
    await _handle(body, memo, logger, retry)


async def on_resync(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    if body["metadata"].get("deletionTimestamp"):
        return
    try:
        result = await reconcile_object(body, memo)
    except (ApiError, aiohttp.ClientError, TimeoutError) as exc:
        logger.warning("resync failed: %r", exc)
        return
    if result.applied or result.pruned:
        logger.info("resync re-applied %s; pruned %s", result.applied or "nothing", result.pruned or "nothing")


def index_services(body: kopf.Body, namespace: str, name: str, **_: Any) -> dict[tuple[str, str], dict]:
    """kopf index: (namespace, name) -> the latest InferenceService body, for child-event lookups."""
    return {(namespace, name): {"metadata": dict(body.metadata), "spec": dict(body.spec), "status": dict(body.status)}}


async def on_child_event(
    body: kopf.Body, namespace: str, memo: kopf.Memo, logger: logging.Logger, services: kopf.Index, **_: Any
) -> None:
    """A Deployment/StatefulSet of ours changed: refresh its InferenceService's status (no apply)."""
    owner = (body.metadata.labels or {}).get(LABEL_SERVICE)
    for parent in services.get((namespace, owner), []) if owner else []:
        if parent["metadata"].get("deletionTimestamp"):
            continue
        try:
            await reconcile_object(parent, memo, status_only=True)
        except (ApiError, aiohttp.ClientError, TimeoutError) as exc:
            logger.warning("status refresh of %s failed: %r", owner, exc)


def register(registry: kopf.OperatorRegistry, creds: Credentials, options: OperatorOptions) -> None:
    """Register every handler on `registry` (no decorators at import time: options come from the CLI)."""
    resource = (GROUP, VERSION, PLURAL)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(
            server=creds.server,
            ca_path=creds.ca_file,
            insecure=creds.insecure,
            scheme="Bearer" if creds.current_token() else None,
            token=creds.current_token(),  # re-read on every re-login: projected tokens rotate
            certificate_path=creds.cert_file,
            private_key_path=creds.key_file,
            default_namespace=creds.namespace,
        )

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=GROUP, key="last-handled-configuration"
        )
        settings.scanning.disabled = True  # no CRD watching: needs no apiextensions RBAC
        settings.posting.level = logging.WARNING  # Events come from reconcile(), not from every log line
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        memo.tidepool = OperatorState(client=KubeClient(creds, max_connections=64), options=options)
        await memo.tidepool.client.open()

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        state = getattr(memo, "tidepool", None)
        if state is not None:
            await state.client.close()

    kopf.on.create(*resource, registry=registry, id="create")(on_change)
    kopf.on.update(*resource, registry=registry, id="update", field="spec")(on_change)
    kopf.on.resume(*resource, registry=registry, id="resume")(on_change)
    kopf.index(*resource, registry=registry, id="services")(index_services)
    ours = {LABEL_SERVICE: kopf.PRESENT, "app.kubernetes.io/managed-by": MANAGED_BY}
    for plural in ("deployments", "statefulsets"):
        kopf.on.event("apps", "v1", plural, registry=registry, labels=ours, id=f"{plural}-status")(on_child_event)
    every = options.resync_seconds
    kopf.timer(*resource, registry=registry, id="resync", interval=every, initial_delay=every)(on_resync)
