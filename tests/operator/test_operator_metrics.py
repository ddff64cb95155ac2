"""The operator's own metrics (operator/metrics.py) count what happened: work-queue adds, waits and
retries on a fake clock, reconciles by result, status writes by kind, and API requests by status code
(a real aiohttp server on loopback answering 200, 429 then 200, 404, and a watch)."""

from __future__ import annotations

import asyncio
import copy
import itertools

from aiohttp import web
from fake_api import NAME, NS, SPEC, with_controller
from prometheus_client import REGISTRY

from tidepool.operator.credentials import Credentials
from tidepool.operator.k8s import ApiError, KubeClient
from tidepool.operator.metrics import CONTROLLER
from tidepool.operator.workqueue import WorkQueue

_names = itertools.count()


def sample(metric: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(metric, labels) or 0.0


def test_work_queue_counts_adds_retries_and_times_waiting_and_processing():
    now = [100.0]
    name = f"test-queue-{next(_names)}"
    q = WorkQueue(clock=lambda: now[0], name=name)

    async def run() -> None:
        q.add("a")
        q.add("a")  # coalesces into the waiting key: not an add
        q.add("b")
        assert sample("workqueue_adds_total", name=name) == 2
        assert sample("workqueue_depth", name=name) == 2
        now[0] += 2.0
        key, _ = await q.get()
        assert key == "a" and sample("workqueue_queue_duration_seconds_sum", name=name) == 2.0
        q.add("a")  # while processed: an add, queued again on done()
        assert sample("workqueue_adds_total", name=name) == 3
        now[0] += 0.5
        q.done("a")
        assert sample("workqueue_work_duration_seconds_count", name=name) == 1
        assert sample("workqueue_work_duration_seconds_sum", name=name) == 0.5
        assert sample("workqueue_adds_total", name=name) == 3  # the re-queue on done() is the same add
        q.add_rate_limited("b")
        assert sample("workqueue_retries_total", name=name) == 1
        assert sample("workqueue_depth", name=name) == len(q) == 2

    asyncio.run(run())


def test_reconciles_and_status_writes_are_counted_by_result_and_kind():
    api, ctrl = with_controller()
    before = {
        "success": sample("controller_runtime_reconcile_total", controller=CONTROLLER, result="success"),
        "error": sample("controller_runtime_reconcile_total", controller=CONTROLLER, result="error"),
        "errors": sample("controller_runtime_reconcile_errors_total", controller=CONTROLLER),
        "transition": sample("tidepool_operator_status_writes_total", kind="transition"),
        "retries": sample("workqueue_retries_total", name=CONTROLLER),
    }

    async def run() -> None:
        await ctrl._process((NS, NAME), False)  # creates the children; the first status is a transition
        spec = copy.deepcopy(SPEC)
        spec["engine"] = {"maxNumSeqs": 64}
        api.put_service(spec, generation=2)
        api.fail_apply.add("Deployment")  # the API server refuses the new template: an error, retried
        await ctrl._process((NS, NAME), False)

    asyncio.run(run())
    assert (
        sample("controller_runtime_reconcile_total", controller=CONTROLLER, result="success") == before["success"] + 1
    )
    assert sample("controller_runtime_reconcile_total", controller=CONTROLLER, result="error") == before["error"] + 1
    assert sample("controller_runtime_reconcile_errors_total", controller=CONTROLLER) == before["errors"] + 1
    assert sample("workqueue_retries_total", name=CONTROLLER) == before["retries"] + 1
    # Two writes, both transitions: the first status, then Degraded=True (ApplyFailed).
    assert sample("tidepool_operator_status_writes_total", kind="transition") == before["transition"] + 2
    assert sample("tidepool_operator_cached_objects", kind="services") == 1


def test_api_requests_are_counted_by_code_method_and_host():
    async def run() -> None:
        throttled = [1]

        async def handle(request: web.Request) -> web.Response:
            if request.path.endswith("/throttled") and throttled[0]:
                throttled[0] -= 1
                return web.json_response({"message": "slow down"}, status=429, headers={"Retry-After": "0"})
            if request.path.endswith("/missing"):
                return web.json_response({"message": "not found", "reason": "NotFound"}, status=404)
            if request.query.get("watch") == "1":
                return web.Response(text='{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"7"}}}\n')
            return web.json_response({"kind": "Thing"})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        host = f"127.0.0.1:{port}"  # a port of its own: these series start at zero
        try:
            async with KubeClient(Credentials(server=f"http://{host}")) as client:
                await client.request("GET", "/api/v1/namespaces/ns/things/throttled")
                try:
                    await client.request("GET", "/api/v1/namespaces/ns/things/missing")
                except ApiError as exc:
                    assert exc.status == 404
                else:
                    raise AssertionError("a 404 must raise")
                events = [e async for e in client.watch("Pod", "ns", None, "1", 5)]
                assert events[0]["type"] == "BOOKMARK"
        finally:
            await runner.cleanup()
        assert sample("rest_client_requests_total", code="429", method="GET", host=host) == 1
        assert sample("rest_client_requests_total", code="200", method="GET", host=host) == 2  # the retry + watch
        assert sample("rest_client_requests_total", code="404", method="GET", host=host) == 1

    asyncio.run(run())


def test_each_cached_service_condition_is_a_series_and_goes_with_the_service():
    api, ctrl = with_controller()
    asyncio.run(ctrl.services.sync((NS, NAME)))
    labels = {"namespace": NS, "name": NAME}
    metric = "tidepool_inferenceservice_status_condition"
    assert sample(metric, **labels, type="Ready", status="False") == 1  # no pods yet
    assert sample(metric, **labels, type="Progressing", status="True") == 1
    assert sample(metric, **labels, type="Ready", status="True") == 0  # one series per condition: its status
    ctrl.store.delete(api.service())
    assert REGISTRY.get_sample_value(metric, {**labels, "type": "Ready", "status": "False"}) is None
