"""Per-request sampling parameters, validated once at the edge.

`SamplingParams` mirrors vLLM's offline API names so users can move code over unchanged.
Invariant: an instance that exists is valid; every bad value raises `ValueError` naming the
field and the accepted range, so nothing invalid ever reaches the scheduler or the sampler.
The ranges are the engine's documented limits (the HTTP server checks the same constants):
- `seed` is a signed 64-bit integer (what a torch generator takes); the i-th of n completions
  uses seed + i, wrapped around inside that range.
- `max_tokens=0` computes the prompt and nothing else: the request finishes with "length" once
  prefilled, without a generated token (scoring, e.g. `prompt_logprobs`).
- integer counts and token ids (`top_k`, `max_tokens`, `min_tokens`, `stop_token_ids`,
  `logit_bias` keys) are at most `MAX_INT32`: every tensor the sampler builds from them fits.
- a temperature below `GREEDY_TEMPERATURE` samples greedily, as vLLM does: dividing logits by
  a smaller number overflows float32 and would draw garbage instead of the likeliest token.
- `repetition_penalty` lies in [0.01, 100] and `logit_bias` values in [-100, 100], so
  penalised or biased float32 logits stay finite.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from .structured_outputs.params import StructuredOutputsParams

SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
MAX_INT32 = 2**31 - 1
GREEDY_TEMPERATURE = 1e-5
REPETITION_PENALTY_RANGE = (0.01, 100.0)
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range: a bias in [-100, 100] per token


@dataclass(slots=True)
class SamplingParams:
    """How one request's tokens are chosen and when generation stops."""

    n: int = 1  # completions per prompt (each is its own request in the engine)
    temperature: float = 1.0  # below GREEDY_TEMPERATURE (e.g. 0) means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 disables; otherwise keep the k most likely tokens
    min_p: float = 0.0  # drop tokens below min_p * p(max), in [0, 1]
    seed: int | None = None  # per-request seed: same tokens whatever else is in the batch
    presence_penalty: float = 0.0  # OpenAI semantics, over generated tokens, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI semantics, over generated tokens, in [-2, 2]
    repetition_penalty: float = 1.0  # HF/CTRL semantics, over prompt and generated tokens, in [0.01, 100]
    max_tokens: int | None = 16  # None: up to max_model_len; 0: prefill only (scoring), finishes with "length"
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens exist
    stop: list[str] = field(default_factory=list)  # stop strings, not included in the text
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens (kept in the ids)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs returned per generated token
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    # Logprobs of the prompt's own tokens (positions >= 1) under the raw model distribution, with this many
    # top alternatives (0: the prompt token's only); None: not computed (prompt_logprobs.py).
    prompt_logprobs: int | None = None
    # Constrain the output to a JSON schema, regex, choice or grammar (structured_outputs/); None: free text.
    # The grammar decides when the output may end, so min_tokens does not hold EOS back for such a request.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        temperature = self.temperature
        _check(_is_number(temperature) and temperature >= 0, "temperature", temperature, "a finite number >= 0")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(_is_int(self.top_k) and 0 <= self.top_k <= MAX_INT32, "top_k", self.top_k,
               f"0 (disabled) or in [1, {MAX_INT32}]")  # fmt: skip
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX), "seed", self.seed,
               f"an integer in [{SEED_MIN}, {SEED_MAX}] or None")  # fmt: skip
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, value, "in [-2, 2]")
        low, high = REPETITION_PENALTY_RANGE
        _check(_is_number(self.repetition_penalty) and low <= self.repetition_penalty <= high, "repetition_penalty",
               self.repetition_penalty, f"in [{low}, {high:g}]")  # fmt: skip
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and 0 <= self.max_tokens <= MAX_INT32),
            "max_tokens",
            self.max_tokens,
            f"an integer in [0, {MAX_INT32}] or None",
        )
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= MAX_INT32, "min_tokens", self.min_tokens,
               f"in [0, {MAX_INT32}]")  # fmt: skip
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings")
        _check(
            all(_is_int(t) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            f"integers in [0, {MAX_INT32}]",
        )
        _check(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
            "logprobs",
            self.logprobs,
            "an integer in [0, 20] or None",
        )
        _check(
            self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
            "prompt_logprobs",
            self.prompt_logprobs,
            "an integer in [0, 20] or None",
        )
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias)
        _check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            self.structured_outputs,
            "a StructuredOutputsParams or None",
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def for_completion(self, index: int) -> SamplingParams:
        """Parameters of the index-th of n completions, each one engine sequence: n=1, and a set seed
        shifted by index (wrapped inside the int64 range), so the n completions differ yet stay reproducible."""
        return replace(self, n=1, seed=None if self.seed is None else wrap_seed(self.seed + index))


def wrap_seed(seed: int) -> int:
    """`seed` brought into [SEED_MIN, SEED_MAX] modulo 2**64 (the identity inside that range)."""
    return (seed - SEED_MIN) % 2**64 + SEED_MIN


def _checked_logit_bias(bias: object) -> dict[int, float]:
    if not isinstance(bias, Mapping):
        raise ValueError(f"invalid sampling parameter logit_bias={bias!r}: must be a mapping of token id to bias")
    result: dict[int, float] = {}
    for token_id, value in bias.items():
        _check(_is_int(token_id) and 0 <= token_id <= MAX_INT32, "logit_bias", token_id,
               f"keyed by token ids in [0, {MAX_INT32}]")  # fmt: skip
        _check(_is_number(value) and abs(value) <= LOGIT_BIAS_LIMIT, "logit_bias", value,
               f"biases in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")  # fmt: skip
        result[token_id] = float(value)
    return result


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    # Finite only: NaN compares false everywhere, and an infinite temperature or repetition
    # penalty turns the sampler's -inf masks (or zero logits) into NaN.
    # Ints too large for a float would overflow when the sampler turns them into a tensor.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        shown = repr(value)
        shown = shown if len(shown) <= 200 else shown[:200] + "..."  # a huge value must not make a huge message
        raise ValueError(f"invalid sampling parameter {name}={shown}: must be {expected}")
