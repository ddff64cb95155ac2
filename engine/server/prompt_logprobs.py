"""Prompt logprobs on the wire: completions' `echo` with `logprobs`, and vLLM's `prompt_logprobs` extension.

Role: what the engine's `RequestOutput.prompt_logprobs` (one entry per prompt token, the first
None) becomes in a response, and which `SamplingParams.prompt_logprobs` a request needs:
- completions with `echo: true` and `logprobs: N` (EleutherAI lm-eval's `local-completions`): the
  legacy `logprobs` object covers the prompt tokens, then the generated ones, in the shape
  `LogprobFormatter.completion` gives generated tokens; the first prompt token has a null logprob
  and null `top_logprobs` (as OpenAI and vLLM). `text_offset` of the prompt tokens counts from the
  start of the echoed text; the generated tokens' count on from the echoed prompt's length, so
  every offset indexes the choice's `text`.
- `prompt_logprobs: k` (completions and chat): `choices[i].prompt_logprobs`, vLLM's list with a
  null first entry and then, per prompt token, `{token id as a string: {logprob, rank,
  decoded_token}}` holding the prompt token and the k likeliest tokens. `decoded_token` is the
  token decoded on its own.
Both are refused in streams (checks.py) and on disaggregated requests (disagg.py). The engine
computes one set with max(k, N) alternatives; each shape cuts it to its own count.
"""

from __future__ import annotations

from typing import Any

from ..outputs import PromptLogprobs, RequestOutput
from .logprobs import LogprobFormatter
from .protocol import CompletionLogprobs, CompletionRequest, SamplingRequest


def engine_prompt_logprobs(req: SamplingRequest) -> int | None:
    """The engine's `prompt_logprobs` for a request: the extension field, or echo with logprobs (completions)."""
    wanted = [req.prompt_logprobs]
    if isinstance(req, CompletionRequest) and req.echo:
        wanted.append(req.logprobs)
    values = [v for v in wanted if v is not None]
    return max(values) if values else None


def completion_logprobs(
    formatter: LogprobFormatter, req: CompletionRequest, out: RequestOutput, echoed: str
) -> CompletionLogprobs | None:
    """A completion choice's legacy `logprobs`: the echoed prompt's tokens first when `echo` is on."""
    if req.logprobs is None:
        return None
    comp = out.outputs[0]
    args = (req.logprobs, req.return_tokens_as_token_ids, req.skip_special_tokens)
    generated = formatter.completion(comp, 0, len(comp.token_ids), len(echoed), *args)
    if not req.echo:
        return generated
    entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    prompt = formatter.prompt(out.prompt_token_ids, _flat(entries), *args)
    return CompletionLogprobs(
        tokens=prompt.tokens + generated.tokens,
        token_logprobs=prompt.token_logprobs + generated.token_logprobs,
        top_logprobs=prompt.top_logprobs + generated.top_logprobs,
        text_offset=prompt.text_offset + generated.text_offset,
    )


def vllm_prompt_logprobs(
    formatter: LogprobFormatter, out: RequestOutput, num_top: int
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` list for one choice: per position the prompt token and its `num_top` likeliest."""
    entries = out.prompt_logprobs
    if entries is None:
        return None
    result: list[dict[str, dict[str, Any]] | None] = []
    for position, entry in enumerate(entries):
        if entry is None:
            result.append(None)
            continue
        token = out.prompt_token_ids[position]
        kept = [(token, entry[token])]
        kept += sorted(((t, lp) for t, lp in entry.items() if lp.rank <= num_top and t != token),
                       key=lambda item: item[1].rank)  # fmt: skip
        result.append({str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": formatter.token_str(t)}
                       for t, lp in kept})  # fmt: skip
    return result


def attach(body: dict[str, Any], per_index: dict[int, list[dict[str, dict[str, Any]] | None] | None]) -> dict[str, Any]:
    """A dumped response with each choice's `prompt_logprobs` set (vLLM sends the key, null when not asked for)."""
    for choice in body["choices"]:
        choice["prompt_logprobs"] = per_index.get(choice["index"])
    return body


def _flat(entries: PromptLogprobs) -> list[dict[int, float] | None]:
    return [None if entry is None else {t: lp.logprob for t, lp in entry.items()} for entry in entries]
