"""The router's Prometheus metric names: a contract with the autoscaler and dashboards.

Torch-free and import-free: the operator's autoscaler scrapes router pods for
`HELD_REQUESTS` to scale a pool up from zero replicas, and imports this module for the name.

Invariants:
- Every router metric carries `POOL_LABEL` ("unified", "prefill" or "decode").
- `HELD_REQUESTS` is the number of client requests waiting, right now, for a pool that has
  no ready replica; it goes back to 0 when a replica becomes ready or the hold times out.
- Counter families are exposed with a `_total` suffix (prometheus_client's convention):
  `REQUESTS` is scraped as `tidepool_router_requests_total`, `RETRIES` as
  `tidepool_router_retries_total`.
"""

from __future__ import annotations

POOL_LABEL = "pool"
REPLICA_LABEL = "replica"  # host:port of the replica that answered ("" when none did)
CODE_LABEL = "code"  # the HTTP status sent to the client, or "stream_error" for a stream cut mid-way
STATE_LABEL = "state"  # a replica's state: "ready", "unready" or "ejected"

POOLS = ("unified", "prefill", "decode")

# Gauges
HELD_REQUESTS = "tidepool_router_held_requests"  # requests held while their pool has no ready replica
REPLICAS = "tidepool_router_replicas"  # known replicas per pool and state

# Counters (family names; exposed as `<name>_total`)
REQUESTS = "tidepool_router_requests"  # client requests answered, by pool, replica and code
RETRIES = "tidepool_router_retries"  # attempts repeated on another replica (nothing streamed yet)
PREFIX_FALLBACKS = "tidepool_router_prefix_fallbacks"  # prefix-aware choices overridden: target was hot
# LoRA affinity, one count per replica chosen for an adapter request (a retry counts again); base-model requests
# count in neither. Hit: a ready replica listing the adapter in its /v1/models got it. Miss: none did, sent by load.
LORA_AFFINITY_HITS = "tidepool_router_lora_affinity_hits"
LORA_AFFINITY_MISSES = "tidepool_router_lora_affinity_misses"

# Histograms
REQUEST_DURATION_SECONDS = "tidepool_router_request_duration_seconds"  # arrival -> last byte sent
