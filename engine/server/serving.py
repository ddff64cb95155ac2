"""OpenAI completions and chat completions on top of `AsyncEngine`: validate, fan out, stream back.

Role: turn a parsed request into engine requests (one per prompt and per `n`; seeded ones
get seed, seed+1, … like `LLM.generate`), then the engine's outputs into OpenAI responses or
SSE chunks ending with `data: [DONE]`.

Invariants:
- Every check that can fail happens before anything is queued, and raises `APIError` naming
  the parameter; the engine never sees an invalid request.
- A request that ends early (client disconnect, cancellation, error) aborts its unfinished
  engine requests in a `finally`, so their KV blocks are freed.
- Streamed text is the engine's stream-safe text (held back while a stop string could still
  cut it), so the concatenated deltas equal the non-streamed text.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import SamplingParams
from ..tokenizer import Tokenizer
from .async_engine import AsyncEngine, Child, EngineDeadError, QueueFullError, RequestStream
from .disagg import attach_kv_transfer, wait_sent
from .logprobs import LogprobFormatter
from .protocol import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    SamplingRequest,
    Usage,
)

_DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks whether its client is still there
_PARAM_IN_MESSAGE = re.compile(r"invalid sampling parameter (\w+)=")


@dataclass(slots=True)
class _Job:
    """One HTTP request's engine requests and what is needed to answer it."""

    response_id: str
    created: int
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    n: int
    children: list[Child] = field(default_factory=list)
    index_of: dict[str, int] = field(default_factory=dict)  # engine request id -> choice index
    finals: dict[str, RequestOutput] = field(default_factory=dict)  # engine request id -> final output

    def usage(self) -> Usage:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(out.outputs[0].token_ids) for out in self.finals.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


@dataclass(slots=True)
class _Delta:
    """New text of one choice, and the tokens [token_start, token_stop) it came from."""

    index: int
    completion: CompletionOutput
    text: str
    text_offset: int
    token_start: int
    token_stop: int


class Serving:
    def __init__(self, engine: AsyncEngine, model_name: str, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.logprobs = LogprobFormatter(tokenizer)

    # ---- completions ----------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self._check_common(req)
        if req.echo and req.logprobs is not None:
            raise APIError("echo together with logprobs is not supported (no prompt logprobs)", param="echo")
        prompts, texts = self._completion_prompts(req.prompt)
        job = self._job("cmpl", prompts, texts, req, req.max_tokens, "prompt", logprobs=req.logprobs)
        producer = await attach_kv_transfer(self.engine.engine, req, job.children)
        stream = self._submit(job)
        if req.stream:
            return self._sse(self._stream_completion(job, stream, req), stream)
        if not await self._collect(job, stream, raw):
            return Response(status_code=499)  # the client is gone; nobody reads this
        kv_params = await wait_sent(self.engine.engine, producer) if producer else None
        choices = []
        for rid, index in job.index_of.items():
            comp = job.finals[rid].outputs[0]
            prefix = self._prompt_text(job, index // req.n) if req.echo else ""
            logprobs = None
            if req.logprobs is not None:
                logprobs = self.logprobs.completion(comp, 0, len(comp.token_ids), 0, req.logprobs)
            choices.append(
                CompletionChoice(index=index, text=prefix + comp.text, logprobs=logprobs,
                                 finish_reason=comp.finish_reason, stop_reason=comp.stop_reason)
            )  # fmt: skip
        choices.sort(key=lambda c: c.index)
        body = CompletionResponse(id=job.response_id, created=job.created, model=self.model_name, choices=choices,
                                  usage=job.usage(), kv_transfer_params=kv_params)  # fmt: skip
        return JSONResponse(body.model_dump())

    def _completion_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> tuple[list, list]:
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt)], [prompt]
        if not prompt:
            raise APIError("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], str):
            return [self.tokenizer.encode(p) for p in prompt], list(prompt)
        if isinstance(prompt[0], int):
            return [list(prompt)], [None]
        return [list(p) for p in prompt], [None] * len(prompt)

    async def _stream_completion(self, job: _Job, stream: RequestStream, req: CompletionRequest) -> AsyncIterator[str]:
        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
            return _event(CompletionResponse(id=job.response_id, created=job.created, model=self.model_name,
                                             choices=choices, usage=usage))  # fmt: skip

        if req.echo:
            for index in job.index_of.values():
                yield chunk([CompletionChoice(index=index, text=self._prompt_text(job, index // req.n))])
        async for item in self._deltas(job, stream):
            if isinstance(item, str):
                yield item
                continue
            comp, logprobs = item.completion, None
            if req.logprobs is not None:
                logprobs = self.logprobs.completion(comp, item.token_start, item.token_stop, item.text_offset,
                                                    req.logprobs)  # fmt: skip
            yield chunk([CompletionChoice(index=item.index, text=item.text, logprobs=logprobs,
                                          finish_reason=comp.finish_reason, stop_reason=comp.stop_reason)])  # fmt: skip
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage=job.usage())
        yield "data: [DONE]\n\n"

    # ---- chat -----------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self._check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if not self.tokenizer.has_chat_template:
            raise APIError("this model has no chat template; use /v1/completions", param="messages")
        messages = [_message_dict(m) for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
        except Exception as err:  # templates raise their own errors (e.g. roles must alternate)
            raise APIError(f"the chat template rejected the messages: {err}", param="messages") from err
        # The template already carries any BOS token, so encode without adding special tokens again.
        prompt = self.tokenizer.encode(text, add_special_tokens=False)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        job = self._job("chatcmpl", [prompt], [text], req, max_tokens, "messages", logprobs=num_top)
        producer = await attach_kv_transfer(self.engine.engine, req, job.children)
        stream = self._submit(job)
        if req.stream:
            return self._sse(self._stream_chat(job, stream, req, num_top), stream)
        if not await self._collect(job, stream, raw):
            return Response(status_code=499)
        kv_params = await wait_sent(self.engine.engine, producer) if producer else None
        choices = []
        for rid, index in job.index_of.items():
            comp = job.finals[rid].outputs[0]
            logprobs = self.logprobs.chat(comp, 0, len(comp.token_ids), num_top) if num_top is not None else None
            choices.append(
                ChatChoice(index=index, message=AssistantMessage(content=comp.text), logprobs=logprobs,
                           finish_reason=comp.finish_reason, stop_reason=comp.stop_reason)
            )  # fmt: skip
        choices.sort(key=lambda c: c.index)
        body = ChatCompletionResponse(id=job.response_id, created=job.created, model=self.model_name,
                                      choices=choices, usage=job.usage(), kv_transfer_params=kv_params)  # fmt: skip
        return JSONResponse(body.model_dump())

    async def _stream_chat(
        self, job: _Job, stream: RequestStream, req: ChatCompletionRequest, num_top: int | None
    ) -> AsyncIterator[str]:
        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            return _event(ChatCompletionChunk(id=job.response_id, created=job.created, model=self.model_name,
                                              choices=choices, usage=usage))  # fmt: skip

        for index in job.index_of.values():
            yield chunk([ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        async for item in self._deltas(job, stream):
            if isinstance(item, str):
                yield item
                continue
            comp, logprobs = item.completion, None
            if num_top is not None:
                logprobs = self.logprobs.chat(comp, item.token_start, item.token_stop, num_top)
            yield chunk([ChatChunkChoice(index=item.index, delta=DeltaMessage(content=item.text), logprobs=logprobs,
                                         finish_reason=comp.finish_reason, stop_reason=comp.stop_reason)])  # fmt: skip
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage=job.usage())
        yield "data: [DONE]\n\n"

    # ---- shared ---------------------------------------------------------------------------------
    async def _deltas(self, job: _Job, stream: RequestStream) -> AsyncIterator[_Delta | str]:
        """Each choice's new text as it becomes safe to send; an SSE error event (a str) if the engine dies."""
        sent_chars = dict.fromkeys(job.index_of, 0)
        sent_tokens = dict.fromkeys(job.index_of, 0)
        try:
            async for out in stream:
                rid, comp = out.request_id, out.outputs[0]
                if out.finished:
                    job.finals[rid] = out
                elif len(comp.text) == sent_chars[rid]:
                    continue  # tokens whose text is held back: their logprobs go with the next chunk
                yield _Delta(job.index_of[rid], comp, comp.text[sent_chars[rid] :], sent_chars[rid], sent_tokens[rid],
                             len(comp.token_ids))  # fmt: skip
                sent_chars[rid], sent_tokens[rid] = len(comp.text), len(comp.token_ids)
        except EngineDeadError as err:
            body = {"error": {"message": str(err), "type": "internal_error", "param": None, "code": "engine_dead"}}
            yield f"data: {json.dumps(body)}\n\n"
        finally:
            self._abort_unfinished(stream)

    def _check_common(self, req: SamplingRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise APIError(f"The model `{req.model}` does not exist.", status_code=404, param="model",
                           code="model_not_found")  # fmt: skip
        if req.stream_options is not None and not req.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")

    def _job(
        self,
        kind: str,
        prompts: list[list[int]],
        texts: list[str | None],
        req: SamplingRequest,
        max_tokens: int | None,
        prompt_param: str,
        logprobs: int | None,
    ) -> _Job:
        job = _Job(f"{kind}-{uuid.uuid4().hex}", int(time.time()), prompts, texts, req.n)
        limit = self.max_model_len
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise APIError(f"{prompt_param} is empty: give at least one token", param=prompt_param)
            wanted = len(prompt) + (max_tokens or 1)
            if wanted > limit:
                raise APIError(
                    f"This model's maximum context length is {limit} tokens. However, you requested {wanted} tokens "
                    f"({len(prompt)} in the {prompt_param}, {max_tokens or 1} in the completion). "
                    f"Please reduce the length of the {prompt_param} or completion.",
                    param=prompt_param,
                    code="context_length_exceeded",
                )
            try:
                self.engine.engine.validate_prompt(prompt)  # token ids in range; reads only immutable engine state
            except ValueError as err:
                raise APIError(str(err), param=prompt_param) from err
            params = _sampling_params(req, max_tokens or limit - len(prompt), logprobs)
            for j in range(req.n):
                child = Child(f"{job.response_id}-{i}-{j}", prompt, params.for_completion(j))
                job.children.append(child)
                job.index_of[child.request_id] = i * req.n + j
        return job

    def _submit(self, job: _Job) -> RequestStream:
        try:
            return self.engine.add(job.children, time.monotonic())
        except QueueFullError as err:
            raise APIError(str(err), status_code=429, type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(err.retry_after_s)}) from err  # fmt: skip
        except EngineDeadError as err:
            raise APIError(str(err), status_code=503, type="service_unavailable", code="engine_dead") from err

    async def _collect(self, job: _Job, stream: RequestStream, raw: Request) -> bool:
        """Wait for every final output (into `job.finals`); False if the client went away (requests aborted)."""

        async def consume() -> None:
            async for out in stream:
                if out.finished:
                    job.finals[out.request_id] = out

        task = asyncio.create_task(consume())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    break
                if await raw.is_disconnected():
                    return False
            try:
                task.result()
            except EngineDeadError as err:
                raise APIError(str(err), status_code=500, type="internal_error", code="engine_dead") from err
            return True
        finally:
            task.cancel()
            self._abort_unfinished(stream)

    def _sse(self, body: AsyncIterator[str], stream: RequestStream) -> StreamingResponse:
        async def guarded() -> AsyncIterator[str]:
            # Starlette cancels or drops this outermost generator when the client disconnects; the inner
            # generators may then be suspended at a yield and only finalized later, so abort here too.
            try:
                async for chunk in body:
                    yield chunk
            finally:
                self._abort_unfinished(stream)

        return StreamingResponse(guarded(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def _abort_unfinished(self, stream: RequestStream) -> None:
        if not stream.finished:
            self.engine.abort(set(stream.unfinished_ids))

    def _prompt_text(self, job: _Job, prompt_index: int) -> str:
        text = job.prompt_texts[prompt_index]
        return text if text is not None else self.tokenizer.decode(job.prompts[prompt_index])


def _sampling_params(req: SamplingRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
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
        )
    except ValueError as err:
        match = _PARAM_IN_MESSAGE.search(str(err))
        raise APIError(str(err), param=match.group(1) if match else "min_tokens") from err


def _message_dict(message: Any) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    result: dict[str, Any] = {"role": message.role, "content": content if content is not None else ""}
    if message.name is not None:
        result["name"] = message.name
    return result


def _event(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"
