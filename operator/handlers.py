"""kopf wiring: the operator process's lifecycle, with the controller (controller.py) inside it.

kopf runs the process: credentials (login handler), startup and cleanup, signal handling, logging,
and the liveness endpoint (`/healthz`, with a probe reporting the role, the cache and the queue).
The InferenceService logic is not a set of kopf resource handlers: kopf's per-object handler
progress (annotation patches per handler run, a finalizer for timers, TemporaryError retries, a
global handler semaphore) is what made 1,000 services cost ~100 API calls each; the controller
keeps watch-fed caches and a coalescing work queue instead, and the resync is a safety net.

Startup spawns one task: wait for leadership (a coordination.k8s.io Lease, leader.py; skipped with
`--no-leader-elect`), then fill the caches and start the workers. A stand-by replica stays alive
and healthy (its liveness endpoint answers) while it waits. A leader that loses its Lease exits the
process at once (exit code 1): it must not write another reconcile, and a restarted pod becomes a
clean stand-by. Cleanup (SIGTERM) stops the workers and releases the Lease, so a stand-by takes
over on its next poll.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import httpx
import kopf
from prometheus_client import start_http_server

from tidepool.operator.api import DEFAULT_ENGINE_IMAGE
from tidepool.operator.autoscaler.handlers import Autoscaler, metrics_source
from tidepool.operator.autoscaler.sleep import HttpSleepApi
from tidepool.operator.builders import ClusterFeatures
from tidepool.operator.builders.common import Collector
from tidepool.operator.controller import Controller, ControllerOptions
from tidepool.operator.k8s import Credentials, KubeClient
from tidepool.operator.leader import LeaderElector, LeaseConfig
from tidepool.operator.lora.client import HttpReplicaApi
from tidepool.operator.lora.sync import LoraSync
from tidepool.operator.metrics import LEADER
from tidepool.operator.revision import Resolver

logger = logging.getLogger("tidepool.operator")


_CONTROLLER = ControllerOptions()  # the controller's and the cluster's defaults, not restated here
_CLUSTER = ClusterFeatures()


@dataclass(slots=True)
class OperatorOptions:
    namespaces: list[str] = field(default_factory=list)  # empty: every namespace
    resync_seconds: float = _CONTROLLER.resync_seconds
    feature_recheck_seconds: float = _CONTROLLER.feature_recheck_seconds  # optional CRDs are looked up again
    workers: int = _CONTROLLER.workers
    max_concurrent_rollouts: int = _CONTROLLER.max_concurrent_rollouts  # 0: no limit (operator/rollout.py)
    kube_api_qps: float = 200.0
    kube_api_burst: int = 400
    lease: LeaseConfig | None = None  # None: no leader election (a single replica)
    gpus_per_node: int = _CLUSTER.gpus_per_node
    engine_image: str | None = None  # None: DEFAULT_ENGINE_IMAGE
    router_image: str | None = None
    router_cluster_role: str = _CLUSTER.router_cluster_role  # the router's RoleBinding names it (bind: the chart)
    hf_download_image: str | None = None
    s3_download_image: str = _CLUSTER.s3_download_image
    metrics_port: int = 9090  # 0: no metrics endpoint
    resolve_revisions: bool = True  # pin floating hf:// revisions to a commit per spec (operator/revision.py)
    collector: Collector = _CLUSTER.collector  # let in by the services' NetworkPolicies (collector_flags.py)


@dataclass(slots=True)
class OperatorState:
    """Lives in kopf's memo."""

    client: KubeClient
    controller: Controller
    elector: LeaderElector | None
    http: httpx.AsyncClient
    role: str = "stand-by"
    task: asyncio.Task | None = None


async def lead_and_run(state: OperatorState, autoscaler: Autoscaler) -> None:
    if state.elector is not None:
        await state.elector.acquire()
    state.role = "leader"
    await state.controller.start(autoscaler)
    if state.elector is None:
        await asyncio.Event().wait()  # runs until cleanup cancels it
        return
    await state.elector.hold()
    # Lost the Lease: another replica may already be reconciling. Stop writing now, not after a clean
    # shutdown that could still flush a reconcile; the restarted pod comes back as a stand-by.
    logger.critical("leadership lost; exiting so that only the new leader reconciles")
    logging.shutdown()
    os._exit(1)


async def start(creds: Credentials, options: OperatorOptions) -> OperatorState:
    """The client, the controller (not started yet), the autoscaler and the elector; leading and running
    happen in a task (`lead_and_run`), so a stand-by stays alive and healthy while it waits."""
    if options.metrics_port:
        start_http_server(options.metrics_port)
    client = KubeClient(creds, max_connections=64, qps=options.kube_api_qps, burst=options.kube_api_burst)
    await client.open()
    features = ClusterFeatures(
        gpus_per_node=options.gpus_per_node,
        engine_image=options.engine_image or DEFAULT_ENGINE_IMAGE,
        router_image=options.router_image,
        router_cluster_role=options.router_cluster_role,
        hf_download_image=options.hf_download_image,
        s3_download_image=options.s3_download_image,
        collector=options.collector,
    )
    controller_options = ControllerOptions(
        resync_seconds=options.resync_seconds,
        workers=options.workers,
        features=features,
        feature_recheck_seconds=options.feature_recheck_seconds,
        max_concurrent_rollouts=options.max_concurrent_rollouts,
    )
    controller = Controller(client, controller_options, options.namespaces)
    http = httpx.AsyncClient()
    pods_in = controller.store.pods_in
    source = metrics_source(pods_in, http)
    autoscaler = Autoscaler(client, pods_in, controller.events.post, source, sleep_api=HttpSleepApi(http))
    controller.services.lora = LoraSync(HttpReplicaApi(http), client, lambda key: controller.queue.add(key))
    if options.resolve_revisions:
        controller.services.revisions = Resolver(client)  # its own client: follows redirects (renamed repos)
    elector = LeaderElector(client, options.lease) if options.lease else None
    if elector is not None:
        LEADER.labels(elector.config.name).set_function(lambda: float(elector.is_leader))
    state = OperatorState(client, controller, elector, http)
    state.task = asyncio.create_task(lead_and_run(state, autoscaler), name="lead-and-run")
    return state


async def stop(state: OperatorState) -> None:
    """Stop the workers, release the Lease (a stand-by takes over at its next poll), close the clients."""
    if state.task is not None:
        state.task.cancel()
        await asyncio.gather(state.task, return_exceptions=True)
    await state.controller.stop()
    if state.elector is not None:
        await state.elector.release()
    await state.http.aclose()
    await state.client.close()


def health(state: OperatorState) -> dict[str, Any]:
    """The liveness probe's report; raises when the controller or one of its tasks died."""
    if state.task is not None and state.task.done() and not state.task.cancelled() and state.task.exception():
        raise RuntimeError(f"the controller stopped: {state.task.exception()!r}")
    failed = state.controller.failed_task()
    if failed:
        raise RuntimeError(f"a controller task died: {failed}")
    queue = state.controller.queue
    return {
        "role": state.role,
        "synced": state.controller.is_synced,
        "cache": state.controller.store.count(),
        "queue": {"ready": len(queue), "processing": queue.num_processing, "delayed": queue.num_delayed},
        "api_requests": state.client.num_requests,
    }


def register(registry: kopf.OperatorRegistry, creds: Credentials, options: OperatorOptions) -> None:
    """Register the process-level handlers on `registry` (no decorators at import time)."""

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
        settings.scanning.disabled = True  # no CRD/namespace watching: needs no cluster-wide read access
        settings.posting.enabled = False  # Events come from the controller, for transitions only
        memo.tidepool = await start(creds, options)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        state: OperatorState | None = getattr(memo, "tidepool", None)
        if state is not None:
            await stop(state)

    @kopf.on.probe(registry=registry, id="controller")
    def probe(memo: kopf.Memo, **_: Any) -> dict[str, Any]:
        state: OperatorState | None = getattr(memo, "tidepool", None)
        return {"role": "starting"} if state is None else health(state)


def identity() -> str:
    """A leader-election identity unique per process: the pod's name plus a random suffix."""
    import uuid

    host = os.environ.get("HOSTNAME") or os.uname().nodename
    return f"{host}_{uuid.uuid4().hex[:8]}"


def lease_namespace(creds: Credentials, flag: str | None) -> str:
    """The flag, else the pod's own namespace (in-cluster), else the kubeconfig context's, else default."""
    return flag or os.environ.get("POD_NAMESPACE") or creds.namespace or "default"
