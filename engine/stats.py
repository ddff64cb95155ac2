"""Engine statistics: per-step and per-request numbers the server turns into vLLM's metrics.

Timestamps are `time.monotonic()` seconds taken inside the engine. Counters are cumulative
since the engine started. Plain slotted dataclasses; computing them costs a few attribute
reads per step, so the step loop stays light.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class EngineStats:
    """A snapshot, valid whenever it is taken (also between steps)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by live requests, 0..1
    num_kv_blocks: int
    block_size: int
    num_free_blocks: int
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found there
    num_preemptions_total: int
    # Speculative decoding (cumulative; zero when it is off):
    spec_num_draft_tokens: int = 0  # proposed tokens verified by the target
    spec_num_accepted_tokens: int = 0  # of which accepted
    # Of the last step (zero before the first):
    step_num_batched_tokens: int = 0  # tokens computed in the step (prefill + decode)
    step_num_prompt_tokens: int = 0  # of which prompt tokens (prefill and recompute after preemption)
    step_num_generation_tokens: int = 0  # tokens sampled
    step_num_preemptions: int = 0
    step_duration_s: float = 0.0


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    num_preemptions: int
