"""vLLM's Prometheus metrics for one engine, fed from the engine thread after every step.

Role: turn `EngineStats` (per step) and `RequestOutput.metrics` (per request, monotonic
timestamps taken inside the engine) into the metrics named in `tidepool.contract.metrics_names`,
with the meanings vLLM gives them. One private `CollectorRegistry` per server, so tests and
several servers in one process never share counters.

Invariants:
- Only the engine thread calls `record_step`/`record_outputs`; prometheus-client's metric
  objects are thread-safe, so the HTTP thread may render `/metrics` at any time.
- Every token is counted once: each request's last seen token count is remembered until the
  request finishes, so prompt tokens and TTFT are recorded at its first token, ITL (also under
  vLLM's older name, time per output token) for each later one, and the per-request histograms
  once at the end.
- Cumulative engine counters (preemptions, prefix-cache queries/hits) are exported as deltas
  of successive snapshots, so the exported counters equal the engine's.
- The LoRA families (lora_metrics.py) are registered only by `enable_lora`, so an engine without
  adapters exports exactly vLLM's base families.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tidepool.contract import metrics_names as names

from ..outputs import RequestOutput
from ..stats import EngineStats
from .lora_metrics import LoRAMetrics

# vLLM's buckets, so histograms from Tidepool and vLLM pods can be aggregated together.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
logger = logging.getLogger(__name__)
SPEC_LOG_INTERVAL_S = 10.0  # how often the speculative-decoding acceptance rate goes to the log (when it moved)

ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def buckets_1_2_5(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, … up to max_value (vLLM's token-count buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(float(value))
        exponent += 1


@dataclass(slots=True)
class _Seen:
    num_tokens: int
    last_token_time: float | None


class _Families:
    """Registers metric families in one registry, each labelled `model_name` and bound to this server's model."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        self.model_name = model_name

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, [names.MODEL_NAME_LABEL], registry=self.registry).labels(self.model_name)

    def counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, [names.MODEL_NAME_LABEL], registry=self.registry).labels(self.model_name)

    def histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        family = Histogram(name, doc, [names.MODEL_NAME_LABEL], buckets=buckets, registry=self.registry)
        return family.labels(self.model_name)  # bound once: `.labels()` looks up a dict per call, per token


class EngineMetrics:
    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        max_num_batched_tokens: int,
        cache_config: dict[str, str],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self._seen: dict[str, _Seen] = {}
        self._last: EngineStats | None = None
        self._spec_logged = (0, 0, time.monotonic())  # (draft, accepted, when) at the last acceptance log line
        # Registered in vLLM's order, which is the order /metrics lists them in.
        families = _Families(self.registry, model_name)
        self._add_gauges(families, cache_config)
        self._add_counters(families)
        self._add_latency_histograms(families)
        self._add_size_histograms(families, max_model_len, max_num_batched_tokens)
        self._startup = Gauge(names.STARTUP_PHASE_SECONDS, "Seconds each start phase of the engine took.",
                              [names.MODEL_NAME_LABEL, names.STARTUP_PHASE_LABEL], registry=self.registry)  # fmt: skip
        self.lora: LoRAMetrics | None = None  # with --enable-lora only (lora_metrics.py)

    def enable_lora(self, max_loras: int) -> LoRAMetrics:
        """Export the LoRA families (an engine started with --enable-lora); the engine thread records them."""
        self.lora = LoRAMetrics(self.registry, self.model_name, max_loras)
        return self.lora

    def _add_gauges(self, new: _Families, cache_config: dict[str, str]) -> None:
        """The engine's load now: running and waiting requests, KV-cache usage, and the cache configuration."""
        self._running = new.gauge(names.NUM_REQUESTS_RUNNING, "Number of requests in model execution batches.")
        self._waiting = new.gauge(names.NUM_REQUESTS_WAITING, "Number of requests waiting to be processed.")
        self._kv_usage = new.gauge(names.KV_CACHE_USAGE_PERC, "KV-cache usage. 1 means 100 percent usage.")
        info = Gauge(names.CACHE_CONFIG_INFO, "Information of the LLMEngine CacheConfig", sorted(cache_config),
                     registry=self.registry)  # fmt: skip
        info.labels(**cache_config).set(1)

    def _add_counters(self, new: _Families) -> None:
        """Totals since start: tokens, finished requests by reason, preemptions, prefix-cache and speculation."""
        self._prompt_tokens = new.counter(names.PROMPT_TOKENS, "Number of prefill tokens processed.")
        self._generation_tokens = new.counter(names.GENERATION_TOKENS, "Number of generation tokens processed.")
        by_reason = [names.MODEL_NAME_LABEL, names.FINISHED_REASON_LABEL]
        self._success = Counter(
            names.REQUEST_SUCCESS, "Count of successfully processed requests.", by_reason, registry=self.registry
        )
        self._preemptions = new.counter(names.NUM_PREEMPTIONS, "Cumulative number of preemption from the engine.")
        self._prefix_queries = new.counter(
            names.PREFIX_CACHE_QUERIES, "Prefix cache queries, in terms of number of queried tokens."
        )
        self._prefix_hits = new.counter(
            names.PREFIX_CACHE_HITS, "Prefix cache hits, in terms of number of cached tokens."
        )
        self._spec_draft = new.counter(names.SPEC_DECODE_NUM_DRAFT_TOKENS, "Number of draft tokens.")
        self._spec_accepted = new.counter(names.SPEC_DECODE_NUM_ACCEPTED_TOKENS, "Number of accepted tokens.")

    def _add_latency_histograms(self, new: _Families) -> None:
        """Where a request's time went: to its first token, between tokens, end to end, and per phase."""
        self._ttft = new.histogram(
            names.TIME_TO_FIRST_TOKEN_SECONDS, "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self._itl = new.histogram(
            names.INTER_TOKEN_LATENCY_SECONDS, "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self._tpot = new.histogram(
            names.TIME_PER_OUTPUT_TOKEN_SECONDS, "Histogram of time per output token in seconds.", ITL_BUCKETS
        )
        self._e2e = new.histogram(
            names.E2E_REQUEST_LATENCY_SECONDS, "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self._queue = new.histogram(
            names.REQUEST_QUEUE_TIME_SECONDS,
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._prefill = new.histogram(
            names.REQUEST_PREFILL_TIME_SECONDS,
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._decode = new.histogram(
            names.REQUEST_DECODE_TIME_SECONDS,
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )

    def _add_size_histograms(self, new: _Families, max_model_len: int, max_num_batched_tokens: int) -> None:
        """Token counts: per finished request (prompt, generated) and per engine step."""
        token_buckets = buckets_1_2_5(max_model_len)
        self._req_prompt = new.histogram(
            names.REQUEST_PROMPT_TOKENS, "Number of prefill tokens processed.", token_buckets
        )
        self._req_generation = new.histogram(
            names.REQUEST_GENERATION_TOKENS, "Number of generation tokens processed.", token_buckets
        )
        self._iteration = new.histogram(
            names.ITERATION_TOKENS_TOTAL,
            "Histogram of number of tokens per engine_step.",
            [b for b in ITERATION_BUCKETS if b <= max_num_batched_tokens],
        )

    def record_startup(self, phases: dict[str, float]) -> None:
        """Where this engine's start-up went (`LLMEngine.startup_phases`), once, when it is ready."""
        for phase, seconds in phases.items():
            self._startup.labels(self.model_name, phase).set(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def record_stats(self, stats: EngineStats, num_pending: int = 0) -> None:
        """Gauges and cumulative counters from a snapshot; `num_pending` are requests not yet handed to the engine."""
        self._running.set(stats.num_running)
        self._waiting.set(stats.num_waiting + num_pending)
        self._kv_usage.set(stats.kv_cache_usage)
        last = self._last
        self._preemptions.inc(max(0, stats.num_preemptions_total - (last.num_preemptions_total if last else 0)))
        self._prefix_queries.inc(max(0, stats.prefix_cache_queries - (last.prefix_cache_queries if last else 0)))
        self._prefix_hits.inc(max(0, stats.prefix_cache_hits - (last.prefix_cache_hits if last else 0)))
        self._spec_draft.inc(max(0, stats.spec_num_draft_tokens - (last.spec_num_draft_tokens if last else 0)))
        self._spec_accepted.inc(max(0, stats.spec_num_accepted_tokens - (last.spec_num_accepted_tokens if last else 0)))
        self._last = stats
        self._log_acceptance(stats)

    def _log_acceptance(self, stats: EngineStats) -> None:
        """Every SPEC_LOG_INTERVAL_S, when proposals were verified since the last line: the acceptance rate."""
        draft, accepted, when = self._spec_logged
        now = time.monotonic()
        if stats.spec_num_draft_tokens == draft or now - when < SPEC_LOG_INTERVAL_S:
            return
        new_draft, new_accepted = stats.spec_num_draft_tokens - draft, stats.spec_num_accepted_tokens - accepted
        logger.info(
            "spec decode: acceptance rate %.1f%% (%d of %d proposed tokens in the last %.0f s), %.1f%% overall",
            100.0 * new_accepted / max(new_draft, 1),
            new_accepted,
            new_draft,
            now - when,
            100.0 * stats.spec_num_accepted_tokens / max(stats.spec_num_draft_tokens, 1),
        )
        self._spec_logged = (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens, now)

    def record_step(self, step: EngineStats) -> None:
        """Per-step numbers of `LLMEngine.last_stats`, once per executed step."""
        if step.step_num_batched_tokens > 0:
            self._iteration.observe(step.step_num_batched_tokens)

    def record_outputs(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            m = output.metrics
            if m is None:
                continue
            seen = self._seen.get(output.request_id)
            num_new = m.num_generation_tokens - (seen.num_tokens if seen else 0)
            if num_new > 0:
                self._generation_tokens.inc(num_new)
                if seen is None:
                    self._prompt_tokens.inc(m.num_prompt_tokens)
                    if m.first_token_time is not None:
                        self._ttft.observe(m.first_token_time - m.arrival_time)
                elif seen.last_token_time is not None and m.last_token_time is not None:
                    interval = m.last_token_time - seen.last_token_time
                    self._itl.observe(interval)
                    self._tpot.observe(interval)
                seen = _Seen(m.num_generation_tokens, m.last_token_time)
                self._seen[output.request_id] = seen
            if output.finished:
                self._seen.pop(output.request_id, None)
                self._record_finished(output)

    def _record_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        if m is None:
            return
        reason = output.outputs[0].finish_reason if output.outputs else None
        self._success.labels(self.model_name, reason or "abort").inc()
        if m.finished_time is not None:
            self._e2e.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self._queue.observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                self._prefill.observe(m.first_token_time - m.first_scheduled_time)
        if m.first_token_time is not None and m.last_token_time is not None:
            self._decode.observe(m.last_token_time - m.first_token_time)
        self._req_prompt.observe(m.num_prompt_tokens)
        self._req_generation.observe(m.num_generation_tokens)
