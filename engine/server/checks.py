"""Request checks that need more than the schema: the served model, the engine's limits, unsupported features.

Role: everything `serving.py` verifies before it queues anything, each failure an `APIError`
naming the parameter: the model name (the served model or a loaded LoRA adapter),
`stream_options` without `stream`, `logit_bias` keys (token ids in the vocabulary), the fan-out of
`n` x prompts against the queue bound, features
that are not implemented (`suffix`, the deprecated `functions`/`function_call`, prompt logprobs
in a stream: `prompt_logprobs`, or echo with logprobs), `max_tokens=0` without echo, and the
translation of a request into `SamplingParams` (whose own checks are the engine's limits).

Invariant: an unsupported feature is refused with a 400 that says so, never silently ignored.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

from ..sampling_params import SamplingParams
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingRequest

_PARAM_IN_MESSAGE = re.compile(r"invalid sampling parameter (\w+)=")
_TOKEN_ID = re.compile(r"[0-9]{1,10}")
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def check_common(
    req: SamplingRequest, model_name: str, adapters: Collection[str], vocab_size: int
) -> tuple[str | None, dict[int, float] | None]:
    """Checks shared by completions and chat; returns the LoRA adapter `model` selects (None: the base model)
    and `logit_bias` keyed by token id."""
    lora_name = check_model(req.model, model_name, adapters)
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")
    if req.response_format is not None:
        kind = req.response_format.type
        if kind not in _RESPONSE_FORMATS:
            raise APIError(f"response_format.type must be one of {', '.join(map(repr, _RESPONSE_FORMATS))}; "
                           f"got {_short(kind)!r}", param="response_format.type")  # fmt: skip
    return lora_name, _logit_bias(req.logit_bias, vocab_size)


def check_model(model: str | None, model_name: str, adapters: Collection[str] = ()) -> str | None:
    """A request's `model`, when given, names the served model or one of its loaded LoRA `adapters` (every API
    route: OpenAI's 404 otherwise). Returns the adapter's name; None for the base model."""
    if model is None or model == model_name:
        return None
    if model not in adapters:
        raise APIError(f"The model `{_short(model)}` does not exist.", status_code=404, param="model",
                       code="model_not_found")  # fmt: skip
    return model


def check_completion(req: CompletionRequest) -> None:
    if req.max_tokens == 0 and not req.echo:
        raise APIError("max_tokens must be at least 1 unless echo is true (max_tokens=0 with echo scores the "
                       "prompt)", param="max_tokens")  # fmt: skip
    if req.stream and req.echo and req.logprobs is not None:
        raise APIError("echo together with logprobs is not supported when streaming; send stream=false",
                       param="echo")  # fmt: skip
    check_prompt_logprobs(req)
    if req.suffix:
        raise APIError("suffix is not supported by this server (no fill-in-the-middle)", param="suffix",
                       code="unsupported")  # fmt: skip


def check_prompt_logprobs(req: SamplingRequest) -> None:
    """vLLM's rule: prompt logprobs come with the whole response, never in a stream."""
    if req.stream and req.prompt_logprobs is not None:
        raise APIError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")


def check_chat(req: ChatCompletionRequest) -> None:
    check_prompt_logprobs(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
    # OpenAI's deprecated function-calling fields: refused, never ignored (tools/tool_choice: tools/plan.py).
    refused = {"functions": bool(req.functions), "function_call": req.function_call not in (None, "none")}
    for param, is_used in refused.items():
        if is_used:
            raise APIError(f"{param} (OpenAI's deprecated function calling) is not supported; send the functions "
                           "as tools and function_call as tool_choice", param=param, code="unsupported")  # fmt: skip


def check_fan_out(num_prompts: int, n: int, max_queue_len: int) -> None:
    """A request that expands to more engine requests than the queue holds can never be admitted: 400, not 429."""
    total = num_prompts * n
    if total > max_queue_len:
        raise APIError(
            f"this request expands to {total} engine requests ({num_prompts} prompt(s) x n={n}), more than this "
            f"server ever queues at once (--max-queue-len {max_queue_len}); split it into smaller requests",
            param="n" if n > 1 else "prompt",
            code="too_many_completions",
        )


def check_min_tokens(
    min_tokens: int, max_tokens: int | None, max_tokens_from: str | None, prompt_len: int, prompt_param: str, limit: int
) -> None:
    """min_tokens fits the completion's budget. The message names where that budget came from: the field the
    client sent (`max_tokens_from`), the completions default (a max_tokens nobody sent), or, with no max_tokens,
    the room the prompt leaves in the context, so it never quotes a number the client did not send as theirs."""
    if max_tokens is None:
        room = limit - prompt_len
        if min_tokens > room:
            raise APIError(
                f"min_tokens ({min_tokens}) exceeds the room left in the context: {room} tokens after the "
                f"{prompt_len}-token {prompt_param} (max_model_len {limit}); lower min_tokens",
                param="min_tokens",
            )
        return
    if min_tokens <= max_tokens:
        return
    if max_tokens_from is None:
        raise APIError(
            f"min_tokens ({min_tokens}) exceeds max_tokens ({max_tokens}, the completions default when max_tokens "
            f"is not sent); send a max_tokens of at least {min_tokens}, or null for the room left",
            param="min_tokens",
        )
    raise APIError(
        f"min_tokens ({min_tokens}) exceeds {max_tokens_from} ({max_tokens}); raise {max_tokens_from} or lower "
        "min_tokens",
        param="min_tokens",
    )


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not raw:
        return None
    bias: dict[int, float] = {}
    for key, value in raw.items():
        if _TOKEN_ID.fullmatch(key) is None or int(key) >= vocab_size:
            raise APIError(f"logit_bias keys must be token ids in [0, {vocab_size}) written as strings; got "
                           f"{_short(key)!r}", param="logit_bias")  # fmt: skip
        bias[int(key)] = value
    return bias


def sampling_params(
    req: SamplingRequest,
    max_tokens: int,
    logprobs: int | None,
    logit_bias: dict[int, float] | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(0, req.top_k or 0),
            min_p=req.min_p or 0.0,
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            logit_bias=logit_bias,
            prompt_logprobs=prompt_logprobs,
        )
    except ValueError as err:
        match = _PARAM_IN_MESSAGE.search(str(err))
        raise APIError(str(err), param=match.group(1) if match else "min_tokens") from err


def _short(text: str, limit: int = 40) -> str:
    """Client text quoted in an error message, cut so that a huge value does not make a huge message."""
    return text if len(text) <= limit else text[:limit] + "..."


def message_dict(message: Any) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    result: dict[str, Any] = {"role": message.role, "content": content if content is not None else ""}
    if message.name is not None:
        result["name"] = message.name
    return result
