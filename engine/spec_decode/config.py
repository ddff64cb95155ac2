"""Speculative decoding configuration (`LLM(speculative_config={...})`, `tidepool serve --speculative-config`).

Torch-free and pydantic, validated at the edge: a bad key or value raises `ValueError` naming
the field and the fix. The engine-wide `num_speculative_tokens` is a ceiling; the per-request
number is derived each step (`num_spec_tokens_for`), and `speculation_pays` is the documented
off-switch. Both rules are pure functions so the scheduler-side code and tests share them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

# Above this many running requests, verifying K+1 tokens per request costs more target compute than
# the skipped decode steps save (measured on the 2-core dev CPU: a verify step of 8 x 5 tokens is no
# longer ~as cheap as 8 x 1). On a GPU the crossover is higher; `disable_by_batch_size` overrides.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


class SpeculativeConfig(BaseModel):
    """How proposals are made; vLLM's key names (`model` is accepted for `draft_model`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    method: Literal["suffix", "ngram", "draft"] = Field(
        description="'suffix' (suffix decoding over the request and recent outputs: the model-free default), "
        "'ngram' (prompt lookup) or 'draft' (a small model)"
    )
    draft_model: str | None = Field(
        None,
        validation_alias=AliasChoices("draft_model", "model"),
        description="Local Hugging Face folder of the draft model (method 'draft'); same tokenizer as the target",
    )
    num_speculative_tokens: int = Field(ge=1, le=16, description="Tokens proposed per step (K)")
    prompt_lookup_max: int = Field(4, ge=1, le=32, description="Longest suffix n-gram tried (method 'ngram')")
    prompt_lookup_min: int = Field(1, ge=1, le=32, description="Shortest suffix n-gram tried (method 'ngram')")
    disable_by_batch_size: int = Field(
        DEFAULT_DISABLE_BY_BATCH_SIZE,
        ge=1,
        description="Speculate only while fewer requests than this are running",
    )

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model: the path of a local draft model folder")
        if self.method != "draft" and self.draft_model:
            raise ValueError(
                f"speculative method {self.method!r} takes no draft_model; use method 'draft' or drop draft_model"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        return self


def speculation_pays(num_running: int, num_spec_tokens: int, max_num_batched_tokens: int, disable_by: int) -> bool:
    """The off-switch: speculate only while the batch is small enough that it still pays.

    Two conditions, both needed: fewer than `disable_by` running requests (beyond that the step is
    compute-bound and rejected tokens are pure waste), and a token budget that covers every running
    request's K proposals plus its pending token, so speculation never crowds out prefills.
    """
    return num_running < disable_by and num_running * (num_spec_tokens + 1) <= max_num_batched_tokens


def num_spec_tokens_for(
    num_spec_tokens: int,
    num_tokens: int,
    num_output_tokens: int,
    max_tokens: int | None,
    max_model_len: int,
    wants_logprobs: bool,
) -> int:
    """The per-request K for this step, derived (not a SamplingParams field).

    - 0 for a request that asks for logprobs (only sampled tokens' logprobs are computed, one per step);
    - at most the tokens left before `max_tokens` minus the bonus token (a proposal past the
      end could never be emitted);
    - at most what fits before `max_model_len` (the proposals' KV positions must exist).
    """
    if wants_logprobs:
        return 0
    k = min(num_spec_tokens, max_model_len - num_tokens)
    if max_tokens is not None:
        k = min(k, max_tokens - num_output_tokens - 1)
    return max(k, 0)
