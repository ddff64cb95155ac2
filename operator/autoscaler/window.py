"""Per-pool windows of scrapes and the snapshot the policy decides from (pure, no I/O, no clock).

Role: the collector appends one `Scrape` per pool per interval (whatever pods answered); the
window turns the scrapes of the last `window_s` seconds into a `PoolSnapshot`: latency
percentiles from histogram bucket deltas (not lifetime averages), rates from counter deltas,
gauges from the latest scrape.

Invariants:
- Deltas are per pod: a pod's baseline is the oldest scrape in the window that has it; a pod
  seen only in the latest scrape is new and counts from zero; a pod that restarted (counters
  went down) counts from zero too. Pods gone since the baseline contribute nothing.
- A snapshot never invents data: a value the scrapes cannot give is None, and `num_pods_scraped`
  says how many pods the gauges come from, so the policy can tell "no traffic" (complete data,
  zero requests) from "no data" (failed or missing scrapes), which must never shrink a pool.
- Times are caller-supplied seconds (monotonic or wall clock, but one of them per window).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from tidepool.contract import metrics_names as names

from .metrics import Histogram, PodMetrics
from .policy_types import PoolSnapshot

QUANTILE = 0.95
_PREEMPTIONS = names.sample_total(names.NUM_PREEMPTIONS)
_PROMPT_TOKENS = names.sample_total(names.PROMPT_TOKENS)
_GENERATION_TOKENS = names.sample_total(names.GENERATION_TOKENS)


@dataclass(frozen=True, slots=True)
class Scrape:
    """One collection round of one pool."""

    time: float
    pods: Mapping[str, PodMetrics] = field(default_factory=dict)  # by pod name: the pods that answered
    num_pods_failed: int = 0  # ready pods whose scrape failed or timed out
    held_requests: float = 0.0  # router's held requests for this pool


class PoolWindow:
    """The scrapes of one pool over the last `window_s` seconds (plus one older baseline)."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError(f"metrics window must be positive, got {window_s}")
        self.window_s = window_s
        self._scrapes: deque[Scrape] = deque()

    def add(self, scrape: Scrape) -> None:
        if self._scrapes and scrape.time < self._scrapes[-1].time:
            raise ValueError("scrapes must be added in time order")
        self._scrapes.append(scrape)
        # Keep exactly one scrape older than the window start: it is the baseline of the deltas.
        start = scrape.time - self.window_s
        while len(self._scrapes) > 1 and self._scrapes[1].time <= start:
            self._scrapes.popleft()

    def __len__(self) -> int:
        return len(self._scrapes)

    def snapshot(self) -> PoolSnapshot:
        if not self._scrapes:
            return PoolSnapshot()
        latest = self._scrapes[-1]
        older = list(self._scrapes)[:-1]
        span = latest.time - older[0].time if older else 0.0
        ttft: Histogram | None = None
        itl: Histogram | None = None
        preemptions = 0.0
        tokens: dict[str, float] = {}  # token counters' increases, for the counters the pods report
        for pod_name, now in latest.pods.items():
            baseline = next((s.pods[pod_name] for s in older if pod_name in s.pods), None)
            ttft = _add(ttft, _delta(now, baseline, names.TIME_TO_FIRST_TOKEN_SECONDS))
            itl = _add(itl, _delta(now, baseline, names.INTER_TOKEN_LATENCY_SECONDS))
            preemptions += _counter_delta(now, baseline, _PREEMPTIONS)
            for sample in (_PROMPT_TOKENS, _GENERATION_TOKENS):
                if sample in now.counters:
                    tokens[sample] = tokens.get(sample, 0.0) + _counter_delta(now, baseline, sample)
        pods = list(latest.pods.values())
        has_window = bool(older) and span > 0
        return PoolSnapshot(
            ttft_p95_s=ttft.quantile(QUANTILE) if ttft is not None and has_window else None,
            itl_p95_s=itl.quantile(QUANTILE) if itl is not None and has_window else None,
            num_requests=ttft.count if ttft is not None and has_window else (0.0 if has_window else None),
            kv_cache_usage=_mean(p.gauges.get(names.KV_CACHE_USAGE_PERC) for p in pods),
            num_waiting=_sum(p.gauges.get(names.NUM_REQUESTS_WAITING) for p in pods),
            num_running=_sum(p.gauges.get(names.NUM_REQUESTS_RUNNING) for p in pods),
            preemptions_per_s=preemptions / span if has_window else None,
            prompt_tokens_per_s=tokens[_PROMPT_TOKENS] / span if has_window and _PROMPT_TOKENS in tokens else None,
            generation_tokens_per_s=(
                tokens[_GENERATION_TOKENS] / span if has_window and _GENERATION_TOKENS in tokens else None
            ),
            held_requests=latest.held_requests,
            num_pods_scraped=len(pods),
            num_pods_failed=latest.num_pods_failed,
            window_s=span,
        )


def _delta(now: PodMetrics, baseline: PodMetrics | None, family: str) -> Histogram | None:
    hist = now.histograms.get(family)
    if hist is None:
        return None
    return hist.minus(baseline.histograms.get(family) if baseline is not None else None)


def _counter_delta(now: PodMetrics, baseline: PodMetrics | None, sample: str) -> float:
    """Increase of a counter since the baseline; a counter that went down (pod restarted) counts from zero."""
    new_count = now.counters.get(sample, 0.0)
    old_count = baseline.counters.get(sample, 0.0) if baseline is not None else 0.0
    return new_count - old_count if new_count >= old_count else new_count


def _add(acc: Histogram | None, hist: Histogram | None) -> Histogram | None:
    if hist is None:
        return acc
    return hist if acc is None else acc.plus(hist)


def _mean(values) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _sum(values) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None
