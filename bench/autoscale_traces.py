"""Request traces for the autoscaling simulator: a seeded generator with a length mix, and trace files.

Role: produce a `Trace` for bench/autoscale_fleet.py: per tick of `dt` seconds, the requests arriving
and their prompt-token and output-token totals, plus the demand static provisioning is sized from
(the generator's expected rate and mean lengths; for a file, the same smoothed over 60 s).

Generator: Poisson arrivals around a peak rate x a daily cycle (minimum 3am, maximum 3pm, `trough` =
night / day) x random bursts of 1.3-1.6x for 5-15 min that build over 2 min. Each request belongs to
a class of a `Mix` (mean prompt and output lengths, lognormal spread `sigma` per request); bursts may
bring a different class mix (`burst_share`: the share of the requests a burst adds). Per tick, the
class counts are binomial splits of the arrivals and each class's token totals are drawn from the
normal approximation of a sum of its lognormal lengths (tens to thousands of requests per tick).

Files: CSV or JSONL, one request per row, with one of these column sets (names matched without case):
  Azure LLM inference traces  TIMESTAMP (a datetime string), ContextTokens, GeneratedTokens
  BurstGPT                    Timestamp (seconds), Request tokens, Response tokens
  plain                       arrival_s, prompt_tokens, output_tokens
Times are taken relative to the first arrival and binned into ticks of `dt`.

Invariants:
- Every array of a `Trace` has one entry per tick; tick i covers [i*dt, (i+1)*dt).
- Counts and token totals are floats (a rate-scaled trace is fluid) and never negative; a tick's
  prompt-token total is >= its request count (every request has a prompt token).
- The generator is a pure function of its parameters and seed.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

SMOOTH_S = 60.0  # file traces: demand = arrivals and tokens averaged over this many seconds


@dataclass(frozen=True, slots=True)
class LengthClass:
    share: float  # share of the requests outside bursts
    prompt: float  # mean prompt tokens
    output: float  # mean output tokens
    sigma: float = 0.0  # lognormal log-space sd of each request's lengths (0: every request has the mean)
    burst_share: float | None = None  # share of the requests bursts add (None: same as `share`)


@dataclass(frozen=True, slots=True)
class Mix:
    name: str
    classes: tuple[LengthClass, ...]

    @staticmethod
    def from_json(name: str, spec: Mapping[str, Any] | list[Mapping[str, Any]]) -> Mix:
        """`{"classes": [{share, prompt, output, sigma?, burst_share?}, ...]}` or the bare list."""
        items = spec["classes"] if isinstance(spec, Mapping) else spec
        mix = Mix(name, tuple(LengthClass(**item) for item in items))
        for label, shares in (("share", mix.shares(False)), ("burst_share", mix.shares(True))):
            if abs(sum(shares) - 1) > 1e-6:
                raise ValueError(f"mix {name}: {label}s sum to {sum(shares):g}, not 1")
        return mix

    def shares(self, burst: bool) -> list[float]:
        return [c.burst_share if burst and c.burst_share is not None else c.share for c in self.classes]


def fixed_mix(prompt: float, output: float, sigma: float = 0.0) -> Mix:
    return Mix(f"p{prompt:g}-o{output:g}-s{sigma:g}", (LengthClass(1.0, prompt, output, sigma),))


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    dt: float
    arrivals: np.ndarray  # requests per tick
    prompt_tokens: np.ndarray  # prompt tokens of the tick's arrivals
    output_tokens: np.ndarray  # output tokens of the tick's arrivals
    rate: np.ndarray  # demand: expected (generator) or smoothed (file) requests/s
    prompt_mean: np.ndarray  # demand: expected or smoothed prompt tokens per request
    output_mean: np.ndarray  # demand: expected or smoothed output tokens per request

    @property
    def ticks(self) -> int:
        return len(self.arrivals)

    @property
    def hours(self) -> float:
        return self.ticks * self.dt / 3600

    def scaled(self, factor: float) -> Trace:
        """The same trace at `factor` x the arrival rate (every tick's requests and tokens x factor)."""
        return replace(
            self,
            arrivals=self.arrivals * factor,
            prompt_tokens=self.prompt_tokens * factor,
            output_tokens=self.output_tokens * factor,
            rate=self.rate * factor,
        )


def _burst_factor(t: np.ndarray, hours: float, bursts_per_hour: float, rng: np.random.Generator) -> np.ndarray:
    burst = np.ones_like(t)
    ramp_s = 120.0
    for start in rng.uniform(0, hours * 3600, rng.poisson(bursts_per_hour * hours)):
        length = rng.uniform(300, 900)
        ramp = np.clip((t - start) / ramp_s, 0.0, 1.0) * (t < start + length)  # bursts build over ramp_s
        burst *= 1 + ramp * (rng.uniform(1.3, 1.6) - 1)
    return burst


def generate(
    hours: float,
    dt: float,
    trough: float,
    bursts_per_hour: float,
    seed: int,
    mix: Mix,
    peak_rate: Callable[[Trace], float],
    name: str = "generated",
) -> Trace:
    """A generated trace; `peak_rate(unit)` gets the demand at a peak of 1 req/s and returns the peak to draw at."""
    rng = np.random.default_rng(seed)
    t = np.arange(0.0, hours * 3600, dt, dtype=float)
    daily = trough + (1 - trough) * (0.5 - 0.5 * np.cos(2 * np.pi * (t - 3 * 3600) / 86400))
    burst = _burst_factor(t, hours, bursts_per_hour, rng)
    added = (burst - 1) / burst  # share of each tick's requests that the bursts add
    base, extra = np.asarray(mix.shares(False)), np.asarray(mix.shares(True))
    shares = np.outer(1 - added, base) + np.outer(added, extra)  # (ticks, classes)
    prompt_mean = shares @ np.asarray([c.prompt for c in mix.classes])
    output_mean = shares @ np.asarray([c.output for c in mix.classes])
    shape = daily * burst
    unit = Trace(
        name, dt, shape * dt, shape * dt * prompt_mean, shape * dt * output_mean, shape, prompt_mean, output_mean
    )
    rate = shape * peak_rate(unit)
    arrivals = rng.poisson(rate * dt).astype(float)
    prompt = np.zeros_like(t)
    output = np.zeros_like(t)
    left = arrivals.copy()
    rest = np.ones_like(t)  # share of the probability not yet assigned to earlier classes
    for k, cls in enumerate(mix.classes):
        if k == len(mix.classes) - 1:
            count = left
        else:
            p = np.clip(np.divide(shares[:, k], rest, out=np.zeros_like(t), where=rest > 1e-12), 0.0, 1.0)
            count = rng.binomial(left.astype(np.int64), p).astype(float)
        left = left - count
        rest = rest - shares[:, k]
        prompt += _token_totals(count, cls.prompt, cls.sigma, rng)
        output += _token_totals(count, cls.output, cls.sigma, rng)
    return Trace(name, dt, arrivals, prompt, output, rate, prompt_mean, output_mean)


def _token_totals(count: np.ndarray, mean: float, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """Sum of `count` lognormal lengths with this mean and log-sd (normal approximation), >= 1 token each."""
    sd = mean * math.sqrt(math.expm1(sigma * sigma))
    total = count * mean + np.sqrt(count) * sd * rng.standard_normal(len(count))
    return np.maximum(total, count)


# --- trace files ---------------------------------------------------------------------------------

SCHEMAS = {
    "azure": ("timestamp", "contexttokens", "generatedtokens"),
    "burstgpt": ("timestamp", "request tokens", "response tokens"),
    "plain": ("arrival_s", "prompt_tokens", "output_tokens"),
}


def _schema(keys: list[str], path: Path) -> tuple[str, tuple[str, str, str]]:
    lowered = {k.strip().lower(): k for k in keys}
    for name, cols in SCHEMAS.items():
        if all(c in lowered for c in cols):
            return name, (lowered[cols[0]], lowered[cols[1]], lowered[cols[2]])
    wanted = "; ".join(", ".join(cols) for cols in SCHEMAS.values())
    raise ValueError(f"{path}: columns {sorted(lowered)} match no trace schema (want one of: {wanted})")


def _seconds(value: Any, schema: str) -> float:
    if schema != "azure" or isinstance(value, int | float):
        return float(value)
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    stamp = datetime.fromisoformat(text)
    if stamp.tzinfo is None:  # the Azure traces carry no zone; read as UTC so no DST shift enters
        stamp = stamp.replace(tzinfo=UTC)
    return stamp.timestamp()


def _rows(path: Path) -> Iterator[Mapping[str, Any]]:
    with path.open(newline="") as f:
        if path.suffix.lower() in (".jsonl", ".ndjson"):
            for line in f:
                if line.strip():
                    yield json.loads(line)
        else:
            yield from csv.DictReader(f)


def read_requests(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(arrival seconds from the first request, prompt tokens, output tokens), sorted by arrival."""
    times: list[float] = []
    prompts: list[float] = []
    outputs: list[float] = []
    cols: tuple[str, str, str] | None = None
    schema = ""
    for row in _rows(path):
        if cols is None:
            schema, cols = _schema(list(row), path)
        times.append(_seconds(row[cols[0]], schema))
        prompts.append(float(row[cols[1]]))
        outputs.append(float(row[cols[2]]))
    if not times:
        raise ValueError(f"{path}: no requests")
    order = np.argsort(np.asarray(times), kind="stable")
    t = np.asarray(times)[order]
    return t - t[0], np.maximum(np.asarray(prompts)[order], 1.0), np.maximum(np.asarray(outputs)[order], 0.0)


def bin_requests(
    arrival_s: np.ndarray, prompts: np.ndarray, outputs: np.ndarray, dt: float, name: str = "file"
) -> Trace:
    ticks = int(arrival_s[-1] // dt) + 1
    idx = (arrival_s // dt).astype(np.int64)
    arrivals = np.bincount(idx, minlength=ticks).astype(float)
    prompt = np.bincount(idx, weights=prompts, minlength=ticks)
    output = np.bincount(idx, weights=outputs, minlength=ticks)
    width = max(round(SMOOTH_S / dt), 1)
    kernel = np.ones(width) / width
    smooth_n = np.convolve(arrivals, kernel, mode="same")
    smooth_p = np.convolve(prompt, kernel, mode="same")
    smooth_o = np.convolve(output, kernel, mode="same")
    mean_p = float(prompt.sum() / arrivals.sum())
    mean_o = float(output.sum() / arrivals.sum())
    has = smooth_n > 1e-12
    prompt_mean = np.where(has, np.divide(smooth_p, smooth_n, out=np.zeros(ticks), where=has), mean_p)
    output_mean = np.where(has, np.divide(smooth_o, smooth_n, out=np.zeros(ticks), where=has), mean_o)
    return Trace(name, dt, arrivals, prompt, output, smooth_n / dt, prompt_mean, output_mean)


def load_trace_file(path: Path, dt: float) -> Trace:
    arrival_s, prompts, outputs = read_requests(path)
    return bin_requests(arrival_s, prompts, outputs, dt, name=path.stem)
