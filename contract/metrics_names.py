"""The metrics contract: vLLM's Prometheus metric names, shared by the engine server and the operator.

Torch-free and import-free on purpose: the operator image has no torch, yet its autoscaler
reads these exact names from every engine pod's `/metrics`. Names and meanings follow vLLM
(V1), so dashboards, KEDA scalers and gateways built for vLLM work unchanged.

Invariants:
- The constants are the metric *family* names as registered with `prometheus_client` (and as
  vLLM registers them). A counter family `X` is exposed as the sample `X_total`; a histogram
  family `X` as `X_bucket`, `X_sum` and `X_count`. `sample_total()` gives the counter sample
  name that PromQL and scrapers see (e.g. `vllm:prompt_tokens_total`).
- Every metric carries the label `MODEL_NAME_LABEL` except `CACHE_CONFIG_INFO` (an info metric of the
  cache's settings, unlabelled in vLLM too) and `LORA_REQUESTS_INFO` (the gateway protocol's labels
  only, as in vLLM); `REQUEST_SUCCESS` also carries
  `FINISHED_REASON_LABEL` ("stop", "length" or "abort").
- Timestamps behind the histograms come from the engine's monotonic clock, in seconds.
- Tidepool's own metrics (no vLLM equivalent) are named `tidepool:*` and listed apart.
"""

from __future__ import annotations

MODEL_NAME_LABEL = "model_name"
FINISHED_REASON_LABEL = "finished_reason"

# Gauges
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"  # requests in the running batch
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"  # requests queued for their (first or resumed) schedule
KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"  # fraction (0..1) of KV blocks held by live requests
CACHE_CONFIG_INFO = "vllm:cache_config_info"  # value 1; the KV cache configuration in its labels

# Counters (exposed with a `_total` suffix)
PROMPT_TOKENS = "vllm:prompt_tokens"  # prompt tokens of requests that produced their first token
GENERATION_TOKENS = "vllm:generation_tokens"  # tokens generated
REQUEST_SUCCESS = "vllm:request_success"  # finished requests, by finished_reason
NUM_PREEMPTIONS = "vllm:num_preemptions"  # preemptions by the scheduler
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"  # prompt tokens looked up in the prefix cache
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"  # of those, tokens found

# Speculative decoding counters (exposed with `_total`; stay 0 on an engine without speculation).
# Kept out of COUNTERS so that tuple stays the always-present core set.
SPEC_DECODE_NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"  # proposed tokens verified by the target
SPEC_DECODE_NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"  # of those, accepted
SPEC_DECODE_COUNTERS = (SPEC_DECODE_NUM_DRAFT_TOKENS, SPEC_DECODE_NUM_ACCEPTED_TOKENS)

# Histograms
TIME_TO_FIRST_TOKEN_SECONDS = "vllm:time_to_first_token_seconds"  # arrival -> first token
INTER_TOKEN_LATENCY_SECONDS = "vllm:inter_token_latency_seconds"  # between consecutive tokens of a request
# The same intervals under vLLM's older name, which dashboards and autoscalers built for vLLM still read.
TIME_PER_OUTPUT_TOKEN_SECONDS = "vllm:time_per_output_token_seconds"
E2E_REQUEST_LATENCY_SECONDS = "vllm:e2e_request_latency_seconds"  # arrival -> finished
REQUEST_QUEUE_TIME_SECONDS = "vllm:request_queue_time_seconds"  # arrival -> first scheduled
REQUEST_PREFILL_TIME_SECONDS = "vllm:request_prefill_time_seconds"  # first scheduled -> first token
REQUEST_DECODE_TIME_SECONDS = "vllm:request_decode_time_seconds"  # first token -> last token
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"  # prompt length per finished request
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"  # generated tokens per finished request
ITERATION_TOKENS_TOTAL = "vllm:iteration_tokens_total"  # tokens computed per engine step (a histogram)

GAUGES = (NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, KV_CACHE_USAGE_PERC, CACHE_CONFIG_INFO)
COUNTERS = (PROMPT_TOKENS, GENERATION_TOKENS, REQUEST_SUCCESS, NUM_PREEMPTIONS, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS)
HISTOGRAMS = (
    TIME_TO_FIRST_TOKEN_SECONDS,
    INTER_TOKEN_LATENCY_SECONDS,
    TIME_PER_OUTPUT_TOKEN_SECONDS,
    E2E_REQUEST_LATENCY_SECONDS,
    REQUEST_QUEUE_TIME_SECONDS,
    REQUEST_PREFILL_TIME_SECONDS,
    REQUEST_DECODE_TIME_SECONDS,
    REQUEST_PROMPT_TOKENS,
    REQUEST_GENERATION_TOKENS,
    ITERATION_TOKENS_TOTAL,
)


def sample_total(counter: str) -> str:
    """The sample name a counter family is scraped as: `vllm:prompt_tokens` -> `vllm:prompt_tokens_total`."""
    return f"{counter}_total"


# Tidepool's own (no vLLM equivalent)
STARTUP_PHASE_SECONDS = "tidepool:startup_phase_seconds"  # gauge: seconds each engine start phase took
STARTUP_PHASE_LABEL = "phase"  # engine/startup_phases.PHASES: import, resolve, tokenizer, weights, ...

# LoRA adapters (issue #37); exported only by an engine started with --enable-lora.
# The Gateway API Inference Extension's model-server protocol (docs/proposals/003-model-server-protocol),
# as vLLM implements it: a gauge whose VALUE is the wall-clock time (seconds since the epoch) the label set
# last changed, so a reader takes the sample with the largest value as the current one; its labels are
# LORA_MAX_LORA_LABEL (device slots, an integer as a string) and the adapters of the running and the waiting
# requests as names joined by "," (no spaces; "" for none). It carries no model_name label, as in vLLM.
# Readers do as the protocol's endpoint picker does: skip samples whose two lists are both empty (the
# server is idle; the last non-empty set still says which adapters it holds). The engine keeps at most two
# samples: the current label set and the last one with an adapter in it.
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
LORA_MAX_LORA_LABEL = "max_lora"
LORA_RUNNING_ADAPTERS_LABEL = "running_lora_adapters"
LORA_WAITING_ADAPTERS_LABEL = "waiting_lora_adapters"
LORA_ADAPTER_SEPARATOR = ","
# Tidepool's per-adapter counters (with MODEL_NAME_LABEL, the base model's served name, and LORA_ADAPTER_LABEL).
LORA_REQUESTS = "tidepool:lora_requests"  # counter (`_total`): engine requests admitted with this adapter
LORA_ADAPTER_LABEL = "adapter"
LORA_ADAPTERS_LOADED = "tidepool:lora_adapters_loaded"  # gauge (model_name only): adapters registered now
LORA_FAMILIES = (LORA_REQUESTS_INFO, sample_total(LORA_REQUESTS), LORA_ADAPTERS_LOADED)

# Sleep mode (issue #43; contract/sleep.py); exported only by an engine started with --enable-sleep-mode, as in
# vLLM: one sample per SLEEP_STATE_LABEL value ("awake", "weights_offloaded", "discard_all"), 1 for the current
# state and 0 for the others, with MODEL_NAME_LABEL (vLLM adds its `engine` index; one engine here, no label).
ENGINE_SLEEP_STATE = "vllm:engine_sleep_state"
SLEEP_STATE_LABEL = "sleep_state"
