"""The operator's own Prometheus metrics: the one place their names are written.

Controller metrics use the names and labels of controller-runtime and client-go, so dashboards and
alerts written for Go controllers (e.g. on `controller_runtime_reconcile_errors_total`,
`workqueue_depth`, `rest_client_requests_total`) read this one unchanged:
- `controller_runtime_reconcile_total{controller,result}` (result: success | error),
  `controller_runtime_reconcile_errors_total{controller}`, `controller_runtime_reconcile_time_seconds`,
  `controller_runtime_active_workers`, `controller_runtime_max_concurrent_reconciles`;
- `workqueue_depth`, `workqueue_adds_total`, `workqueue_retries_total`, `workqueue_queue_duration_seconds`
  (added to taken), `workqueue_work_duration_seconds` (taken to done), label `name`;
- `rest_client_requests_total{code,method,host}` (code "<error>" when no answer came);
- `leader_election_master_status{name}`: 1 while this replica holds the Lease.
Tidepool's own: `tidepool_operator_status_writes_total{kind}` (transition | routine: see sync.py),
`tidepool_operator_status_writes_deferred_total` (routine writes left to a later sync),
`tidepool_operator_cached_objects{kind}` (services | children | pods), and
`tidepool_inferenceservice_status_condition{namespace,name,type,status}` = 1 for each condition of each
InferenceService in the leader's cache (kube-state-metrics' shape; a stand-by replica exports none),
which the chart's PrometheusRule alerts on. The autoscaler's metrics are in autoscaler/handlers.py.

Gauges that mirror a live count are read at scrape time (`set_function`), never kept in step by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

CONTROLLER = "inferenceservice"  # the `controller` label, and the work queue's `name`

# controller-runtime's reconcile-time buckets (seconds), and client-go's work-queue buckets (1e-8 s to 10 s) with
# minutes added: the chart's alert on a queue wait over a minute needs buckets above it to ever fire.
_RECONCILE_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0,
    1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5, 6, 7, 8, 9, 10, 15, 20, 25, 30, 40, 50, 60,
)  # fmt: skip
_QUEUE_BUCKETS = (*(10.0**e for e in range(-8, 2)), 30.0, 60.0, 120.0, 300.0)

RECONCILE_TOTAL = Counter(
    "controller_runtime_reconcile_total", "Reconciles per controller, by result", ["controller", "result"]
)
RECONCILE_ERRORS = Counter("controller_runtime_reconcile_errors_total", "Reconcile errors", ["controller"])
RECONCILE_TIME = Histogram(
    "controller_runtime_reconcile_time_seconds", "Time of one reconcile", ["controller"], buckets=_RECONCILE_BUCKETS
)
ACTIVE_WORKERS = Gauge("controller_runtime_active_workers", "Workers reconciling now", ["controller"])
MAX_WORKERS = Gauge("controller_runtime_max_concurrent_reconciles", "Workers", ["controller"])

QUEUE_DEPTH = Gauge("workqueue_depth", "Keys waiting in the work queue", ["name"])
QUEUE_ADDS = Counter("workqueue_adds_total", "Adds to the work queue (coalesced ones included)", ["name"])
QUEUE_RETRIES = Counter("workqueue_retries_total", "Keys added again after an error (with backoff)", ["name"])
QUEUE_WAIT = Histogram(
    "workqueue_queue_duration_seconds", "Time a key waited in the queue", ["name"], buckets=_QUEUE_BUCKETS
)
QUEUE_WORK = Histogram(
    "workqueue_work_duration_seconds", "Time a key was being processed", ["name"], buckets=_QUEUE_BUCKETS
)

REST_REQUESTS = Counter(
    "rest_client_requests_total", "API server requests, by status code, method and host", ["code", "method", "host"]
)
LEADER = Gauge("leader_election_master_status", "1 while this replica holds the Lease", ["name"])

STATUS_WRITES = Counter(
    "tidepool_operator_status_writes_total", "InferenceService status writes, by kind of change", ["kind"]
)
STATUS_DEFERRED = Counter(
    "tidepool_operator_status_writes_deferred_total", "Routine status writes left to a later sync (paced)"
)
CACHED = Gauge("tidepool_operator_cached_objects", "Objects in the operator's caches", ["kind"])


class ConditionsCollector:
    """`tidepool_inferenceservice_status_condition`, read from the controller's cache at scrape time (so a
    deleted service's series go with it). `read` yields (namespace, name, conditions) per service."""

    NAME = "tidepool_inferenceservice_status_condition"
    HELP = "1 for each condition of an InferenceService, by type and status (the operator's cache)"

    def __init__(self) -> None:
        self.read: Callable[[], Iterable[tuple[str, str, list[dict]]]] | None = None

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self.NAME, self.HELP, labels=["namespace", "name", "type", "status"])

    def describe(self) -> list[GaugeMetricFamily]:
        return [self._family()]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        for namespace, name, conditions in self.read() if self.read is not None else ():
            for condition in conditions:
                family.add_metric([namespace, name, str(condition.get("type")), str(condition.get("status"))], 1.0)
        yield family


SERVICE_CONDITIONS = ConditionsCollector()
REGISTRY.register(SERVICE_CONDITIONS)
