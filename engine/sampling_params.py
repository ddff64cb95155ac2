"""Per-request sampling parameters, validated once at the edge.

`SamplingParams` mirrors vLLM's offline API names so users can move code over unchanged.
Invariant: an instance that exists is valid; every bad value raises `ValueError` naming the
field and the accepted range, so nothing invalid ever reaches the scheduler or the sampler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


@dataclass(slots=True)
class SamplingParams:
    """How one request's tokens are chosen and when generation stops."""

    n: int = 1  # completions per prompt (each is its own request in the engine)
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 disables; otherwise keep the k most likely tokens
    min_p: float = 0.0  # drop tokens below min_p * p(max), in [0, 1]
    seed: int | None = None  # per-request seed: same tokens whatever else is in the batch
    presence_penalty: float = 0.0  # OpenAI semantics, over generated tokens, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI semantics, over generated tokens, in [-2, 2]
    repetition_penalty: float = 1.0  # HF/CTRL semantics, over prompt and generated tokens, > 0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens exist
    stop: list[str] = field(default_factory=list)  # stop strings, not included in the text
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens (kept in the ids)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs returned per generated token
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        temperature = self.temperature
        _check(_is_number(temperature) and temperature >= 0, "temperature", temperature, "a finite number >= 0")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k, "0 (disabled) or >= 1")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed, "an integer or None")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, value, "in [-2, 2]")
        _check(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            self.repetition_penalty,
            "a finite number > 0",
        )
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            self.max_tokens,
            "an integer >= 1 or None",
        )
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings")
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "non-negative integers",
        )
        _check(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
            "logprobs",
            self.logprobs,
            "an integer in [0, 20] or None",
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def for_completion(self, index: int) -> SamplingParams:
        """Parameters of the index-th of n completions, each one engine sequence: n=1, and a set seed
        shifted by index, so the n completions differ yet stay reproducible."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    # Finite only: NaN compares false everywhere, and an infinite temperature or repetition
    # penalty turns the sampler's -inf masks (or zero logits) into NaN.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return isinstance(value, int) or math.isfinite(value)


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"invalid sampling parameter {name}={value!r}: must be {expected}")
