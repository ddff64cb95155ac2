"""Prometheus text parsing, cumulative histograms and PromQL-style quantiles (pure, no I/O).

Role: turn one scrape of an engine pod's `/metrics` (Prometheus text exposition format 0.0.4)
into a `PodMetrics` — the few gauges, counters and histograms the autoscaler reads — and
compute `histogram_quantile` on bucket *deltas* exactly the way PromQL does, so the latency
percentiles the policy acts on match what a Grafana panel over the same window shows.

Invariants:
- Samples of one name are aggregated over their label sets (several `model_name`s, the
  `finished_reason` of `request_success`): counters and histogram buckets are summed, gauges
  are summed except fractions (`MAX_GAUGES`), which take the maximum.
- A `Histogram` holds cumulative counts per upper bound, bounds ascending, the last one +Inf.
- `Histogram.minus(old)` is the delta over a window; when any bucket went down (the pod
  restarted: counters reset) the newer histogram alone is the delta, like PromQL's `increase`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tidepool.contract import metrics_names as names
from tidepool.contract import router_metrics_names as router_names

MAX_GAUGES = frozenset({names.KV_CACHE_USAGE_PERC})
HISTOGRAM_FAMILIES = (names.TIME_TO_FIRST_TOKEN_SECONDS, names.INTER_TOKEN_LATENCY_SECONDS)
COUNTER_SAMPLES = (
    names.sample_total(names.NUM_PREEMPTIONS),
    names.sample_total(names.REQUEST_SUCCESS),
    names.sample_total(names.PROMPT_TOKENS),
    names.sample_total(names.GENERATION_TOKENS),
)
GAUGE_SAMPLES = (
    names.NUM_REQUESTS_RUNNING,
    names.NUM_REQUESTS_WAITING,
    names.KV_CACHE_USAGE_PERC,
    router_names.HELD_REQUESTS,
)

_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


class MetricsParseError(ValueError):
    """A `/metrics` body that is not Prometheus text format; the message quotes the bad line."""


@dataclass(frozen=True, slots=True)
class Sample:
    name: str  # sample name as exposed, e.g. `vllm:time_to_first_token_seconds_bucket`
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True, slots=True)
class Histogram:
    bounds: tuple[float, ...]  # bucket upper bounds (`le`), ascending, last is +Inf
    counts: tuple[float, ...]  # cumulative observation count per bound
    total: float = 0.0  # `_sum`: sum of observed values

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def minus(self, old: Histogram | None) -> Histogram:
        """Observations made since `old`; the whole of `self` when `old` is absent or reset."""
        if old is None or old.bounds != self.bounds:
            return self
        if any(new < prev for new, prev in zip(self.counts, old.counts, strict=True)):
            return self
        counts = tuple(new - prev for new, prev in zip(self.counts, old.counts, strict=True))
        return Histogram(self.bounds, counts, max(self.total - old.total, 0.0))

    def plus(self, other: Histogram) -> Histogram:
        """Two pods' histograms together (same bucket layout: every engine uses vLLM's buckets)."""
        if other.bounds != self.bounds:
            raise ValueError(f"histogram bucket layouts differ: {self.bounds} vs {other.bounds}")
        counts = tuple(a + b for a, b in zip(self.counts, other.counts, strict=True))
        return Histogram(self.bounds, counts, self.total + other.total)

    def quantile(self, q: float) -> float | None:
        return histogram_quantile(q, self.bounds, self.counts)


@dataclass(frozen=True, slots=True)
class PodMetrics:
    """What the autoscaler reads from one scrape of one pod."""

    gauges: Mapping[str, float] = field(default_factory=dict)
    counters: Mapping[str, float] = field(default_factory=dict)  # by sample name (`..._total`)
    histograms: Mapping[str, Histogram] = field(default_factory=dict)  # by family name


def _unescape(value: str) -> str:
    return re.sub(r'\\[\\"n]', lambda m: _ESCAPES[m.group(0)], value)


def _parse_value(text: str, line: str) -> float:
    lowered = text.lower()
    if lowered in ("+inf", "inf"):
        return math.inf
    if lowered == "-inf":
        return -math.inf
    try:
        return float(text)
    except ValueError:
        raise MetricsParseError(f"not a number {text!r} in metrics line {line!r}") from None


def parse_text(text: str) -> list[Sample]:
    """All samples of a Prometheus text-format body (comments and blank lines skipped)."""
    samples = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE_RE.match(line)
        if match is None:
            raise MetricsParseError(f"cannot parse metrics line {line!r}")
        name, label_text, value_text = match.groups()
        labels: dict[str, str] = {}
        if label_text:
            body = label_text[1:-1]
            pos = 0
            while pos < len(body):
                label = _LABEL_RE.match(body, pos)
                if label is None:
                    raise MetricsParseError(f"cannot parse labels in metrics line {line!r}")
                labels[label.group(1)] = _unescape(label.group(2))
                pos = label.end()
        samples.append(Sample(name, labels, _parse_value(value_text, line)))
    return samples


def histograms_from_samples(samples: Iterable[Sample], families: Iterable[str]) -> dict[str, Histogram]:
    """Cumulative histograms per family, summed over label sets other than `le`."""
    wanted = set(families)
    buckets: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    for sample in samples:
        if sample.name.endswith("_bucket") and sample.name[: -len("_bucket")] in wanted:
            family = sample.name[: -len("_bucket")]
            le = _parse_value(sample.labels.get("le", ""), f"{sample.name}{dict(sample.labels)}")
            per_le = buckets.setdefault(family, {})
            per_le[le] = per_le.get(le, 0.0) + sample.value
        elif sample.name.endswith("_sum") and sample.name[: -len("_sum")] in wanted:
            family = sample.name[: -len("_sum")]
            sums[family] = sums.get(family, 0.0) + sample.value
    result = {}
    for family, per_le in buckets.items():
        bounds = tuple(sorted(per_le))
        result[family] = Histogram(bounds, tuple(per_le[b] for b in bounds), sums.get(family, 0.0))
    return result


def pod_metrics_from_text(text: str) -> PodMetrics:
    """The autoscaler's view of one `/metrics` body (engine or router pod)."""
    samples = parse_text(text)
    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    for sample in samples:
        if sample.name in GAUGE_SAMPLES:
            previous = gauges.get(sample.name)
            if previous is None:
                gauges[sample.name] = sample.value
            elif sample.name in MAX_GAUGES:
                gauges[sample.name] = max(previous, sample.value)
            else:
                gauges[sample.name] = previous + sample.value
        elif sample.name in COUNTER_SAMPLES:
            counters[sample.name] = counters.get(sample.name, 0.0) + sample.value
    return PodMetrics(gauges, counters, histograms_from_samples(samples, HISTOGRAM_FAMILIES))


def held_requests_by_pool(text: str) -> dict[str, float]:
    """`tidepool_router_held_requests` per `pool` label from a router pod's `/metrics` body."""
    held: dict[str, float] = {}
    for sample in parse_text(text):
        if sample.name == router_names.HELD_REQUESTS:
            pool = sample.labels.get(router_names.POOL_LABEL, "")
            held[pool] = held.get(pool, 0.0) + sample.value
    return held


def histogram_quantile(q: float, bounds: tuple[float, ...], counts: tuple[float, ...]) -> float | None:
    """PromQL's `histogram_quantile(q, ...)` on cumulative bucket counts; None when empty.

    The q-th observation (rank q * total) is located in its bucket and interpolated linearly
    between the bucket's lower and upper bound (lower bound 0 for the first bucket, as PromQL
    assumes non-negative observations). A rank in the +Inf bucket returns the largest finite
    bound: the histogram cannot say more.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    if len(bounds) != len(counts) or not bounds or not math.isinf(bounds[-1]):
        raise ValueError("histogram needs matching bounds/counts with a final +Inf bucket")
    total = counts[-1]
    if total <= 0:
        return None
    if len(bounds) == 1:
        return None  # only +Inf: no finite bound to report
    rank = q * total
    index = next(i for i, c in enumerate(counts) if c >= rank)
    if math.isinf(bounds[index]):
        return bounds[-2]
    if index == 0 and bounds[0] <= 0:
        return bounds[0]
    lower = bounds[index - 1] if index > 0 else 0.0
    below = counts[index - 1] if index > 0 else 0.0
    in_bucket = counts[index] - below
    if in_bucket <= 0:
        return bounds[index]
    return lower + (bounds[index] - lower) * (rank - below) / in_bucket
