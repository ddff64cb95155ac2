"""OpenAI completions and chat completions on top of `AsyncEngine`: validate, fan out, stream back.

Role: turn a parsed request into engine requests (jobs.py: one per prompt and per `n`), constrain
them (structured.py: response_format, structured_outputs, tool_choice), then the engine's outputs
into OpenAI responses or SSE chunks ending with `data: [DONE]` (tool calls parsed by tools/).
Tokenization runs in the prompt encoder's threads.

Invariants:
- Every check that can fail happens before anything is queued (checks.py and the engine's
  read-only `EngineInfo`), and raises `APIError` naming the parameter.
- A request that ends early (client disconnect, cancellation, error) aborts its unfinished
  engine requests in a `finally`, so their KV blocks are freed.
- A request that ends badly says so. JSON: the engine failed on it -> 500; a shutdown aborted it
  -> 503 (retry elsewhere). Streams (headers already sent): every choice still open (all n of
  them) gets a last chunk with `finish_reason: "abort"`, then one OpenAI-shaped error event, then
  `data: [DONE]`. Never a silent 200.
- Streamed text is the engine's stream-safe text (held back while a stop string could still
  cut it), so the concatenated deltas equal the non-streamed text.
- The request's `model` selects the base model (the served name, or none) or a loaded LoRA adapter
  (`adapter_names`, from the registry's snapshot; anything else a 404), and the response's `model`
  is that name, as vLLM answers.
- A chat becomes a prompt in `chat_prompt` alone; /tokenize's chat form (tokenization.py) calls
  it too, so it counts exactly the tokens a chat completion feeds the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..outputs import CompletionOutput
from .async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestStream,
)
from .chat_render import render_options
from .checks import (
    check_chat,
    check_common,
    check_completion,
    check_fan_out,
)
from .disagg import attach_kv_transfer, wait_sent
from .jobs import Job, build_job
from .logprobs import LogprobFormatter
from .prompt_logprobs import attach, completion_logprobs, vllm_prompt_logprobs
from .prompts import PromptEncoder
from .protocol import (
    APIError,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatTemplateFields,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    SamplingRequest,
)
from .replies import answering_shutdown, engine_error, error_event, finish_error, refusal
from .sse import StreamChunks
from .structured import constrain
from .tools.plan import NO_TOOLS, ToolPlan, ToolSettings, check_tools
from .tools.render import chat_inputs
from .tools.replies import ToolStream, tool_message

_DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks whether its client is still there


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
    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        encoder: PromptEncoder,
        logprobs: LogprobFormatter,
        tools: ToolSettings | None = None,
    ) -> None:
        self.engine = engine
        self.info = engine.info
        self.model_name = model_name
        self.encoder = encoder
        self.logprobs = logprobs
        self.tools = tools or ToolSettings()  # --enable-auto-tool-choice, --tool-call-parser

    def adapter_names(self) -> list[str]:
        """The LoRA adapters a request's `model` may name now (none without --enable-lora)."""
        snapshot = self.info.lora_snapshot
        return snapshot().names() if snapshot is not None else []

    # ---- completions ----------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        lora_name, logit_bias = check_common(req, self.model_name, self.adapter_names(), self.info.vocab_size)
        check_completion(req)
        return await answering_shutdown(self._completions(req, raw, lora_name, logit_bias))

    async def _completions(
        self, req: CompletionRequest, raw: Request, lora_name: str | None, logit_bias: dict[int, float] | None
    ) -> Response:
        prompts, texts = await self._completion_prompts(req)
        sent = "max_tokens" if "max_tokens" in req.model_fields_set else None
        job = build_job(self.info, "cmpl", prompts, texts, req, (req.max_tokens, sent), "prompt", req.logprobs,
                        logit_bias, model=lora_name or self.model_name, lora_name=lora_name)  # fmt: skip
        await constrain(self.engine, job.children, req)
        producer = await self.engine.guard(attach_kv_transfer(self.info, req, job.children))
        stream = self._submit(job)
        if req.stream:
            return self._sse(self._stream_completion(job, stream, req), stream)
        if not await self._collect(job, stream, raw):
            return Response(status_code=499)  # the client is gone; nobody reads this
        kv_params = await self.engine.guard(wait_sent(self.info, producer)) if producer else None
        choices = []
        for rid, index in job.index_of.items():
            comp = job.finals[rid].outputs[0]
            prefix = await self._prompt_text(job, index // req.n) if req.echo else ""
            logprobs = completion_logprobs(self.logprobs, req, job.finals[rid], prefix)
            choices.append(
                CompletionChoice(index=index, text=prefix + comp.text, logprobs=logprobs,
                                 finish_reason=comp.finish_reason, stop_reason=comp.stop_reason)
            )  # fmt: skip
        choices.sort(key=lambda c: c.index)
        body = CompletionResponse(id=job.response_id, created=job.created, model=job.model, choices=choices,
                                  usage=job.usage(), kv_transfer_params=kv_params)  # fmt: skip
        return JSONResponse(self._with_prompt_logprobs(body.model_dump(), job, req))

    async def _completion_prompts(self, req: CompletionRequest) -> tuple[list[list[int]], list[str | None]]:
        prompt = req.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError("prompt must not be empty", param="prompt")
        # The same dispatch as the schema's (protocol._prompt_kind): by the first item.
        if isinstance(prompt[0], str):
            check_fan_out(len(prompt), req.n, self.engine.max_queue_len)
            texts: list[str] = prompt  # type: ignore[assignment]
            return await self.engine.guard(self.encoder.encode(texts, "prompt")), list(texts)
        if isinstance(prompt[0], list):
            check_fan_out(len(prompt), req.n, self.engine.max_queue_len)
            return [list(p) for p in prompt], [None] * len(prompt)  # type: ignore[union-attr]
        check_fan_out(1, req.n, self.engine.max_queue_len)
        return [list(prompt)], [None]  # type: ignore[arg-type]

    async def _stream_completion(self, job: Job, stream: RequestStream, req: CompletionRequest) -> AsyncIterator[str]:
        chunks = StreamChunks(job.response_id, job.created, job.model, chat=False)
        if req.echo:
            for index in job.index_of.values():
                text = await self._prompt_text(job, index // req.n)
                yield chunks.event([chunks.completion_choice(index, text)])
        async for item in self._deltas(job, stream):
            if isinstance(item, str):
                yield item
                continue
            comp, logprobs = item.completion, None
            if req.logprobs is not None:
                logprobs = self.logprobs.completion(comp, item.token_start, item.token_stop, item.text_offset,
                                                    req.logprobs, req.return_tokens_as_token_ids,
                                                    req.skip_special_tokens)  # fmt: skip
            choice = chunks.completion_choice(item.index, item.text, logprobs, comp.finish_reason, comp.stop_reason)
            yield chunks.event([choice], job.usage_so_far(req, item.index, item.token_stop))
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunks.event([], usage=job.usage())
        yield "data: [DONE]\n\n"

    # ---- chat -----------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        lora_name, logit_bias = check_common(req, self.model_name, self.adapter_names(), self.info.vocab_size)
        check_chat(req)
        self.check_chat_template()
        check_fan_out(1, req.n, self.engine.max_queue_len)
        return await answering_shutdown(self._chat(req, raw, lora_name, logit_bias))

    async def _chat(
        self, req: ChatCompletionRequest, raw: Request, lora_name: str | None, logit_bias: dict[int, float] | None
    ) -> Response:
        plan = check_tools(req, self.tools)  # before anything is queued, like every check
        text, prompt = await self.chat_prompt(req, req.messages, plan=plan)
        if req.max_completion_tokens is not None:
            budget = (req.max_completion_tokens, "max_completion_tokens")
        else:
            budget = (req.max_tokens, "max_tokens" if req.max_tokens is not None else None)
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        job = build_job(self.info, "chatcmpl", [prompt], [text], req, budget, "messages", num_top, logit_bias,
                        model=lora_name or self.model_name, lora_name=lora_name)  # fmt: skip
        await constrain(self.engine, job.children, req)
        producer = await self.engine.guard(attach_kv_transfer(self.info, req, job.children))
        stream = self._submit(job)
        if req.stream:
            return self._sse(self._stream_chat(job, stream, req, num_top, plan), stream)
        if not await self._collect(job, stream, raw):
            return Response(status_code=499)
        kv_params = await self.engine.guard(wait_sent(self.info, producer)) if producer else None
        choices = []
        for rid, index in job.index_of.items():
            comp = job.finals[rid].outputs[0]
            logprobs = None
            if num_top is not None:
                logprobs = self.logprobs.chat(comp, 0, len(comp.token_ids), num_top, req.return_tokens_as_token_ids)
            message, finish_reason = tool_message(plan, comp.text, comp.finish_reason)
            choices.append(
                ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish_reason,
                           stop_reason=comp.stop_reason)
            )  # fmt: skip
        choices.sort(key=lambda c: c.index)
        body = ChatCompletionResponse(id=job.response_id, created=job.created, model=job.model,
                                      choices=choices, usage=job.usage(), kv_transfer_params=kv_params)  # fmt: skip
        return JSONResponse(self._with_prompt_logprobs(body.model_dump(), job, req))

    def check_chat_template(self) -> None:
        if not self.info.tokenizer.has_chat_template:
            raise APIError("this model has no chat template; send a plain prompt (/v1/completions)", param="messages")

    async def chat_prompt(
        self,
        req: ChatTemplateFields,
        messages: list[ChatMessage],
        add_special_tokens: bool = False,
        plan: ToolPlan = NO_TOOLS,
    ) -> tuple[str, list[int]]:
        """The text and token ids a chat (rendered as `req` asks, chat_render.py; with `plan`'s tools,
        tools/render.py) becomes for the engine: the one path of /v1/chat/completions and of /tokenize's chat form.
        The template already carries any BOS token, so the text is encoded without adding special tokens again
        (unless /tokenize's `add_special_tokens` asks)."""
        dicts, tools = chat_inputs(messages, plan, self.info.tokenizer)
        options = render_options(req, dicts)
        text = await self.engine.guard(self.encoder.render_chat(dicts, tools, options))
        [prompt] = await self.engine.guard(self.encoder.encode([text], "messages", add_special_tokens))
        return text, prompt

    async def _stream_chat(
        self, job: Job, stream: RequestStream, req: ChatCompletionRequest, num_top: int | None, plan: ToolPlan
    ) -> AsyncIterator[str]:
        chunks = StreamChunks(job.response_id, job.created, job.model, chat=True)
        tool_stream = ToolStream(plan, chunks)  # without a parser: one chunk per piece, as ever
        for index in job.index_of.values():
            yield chunks.event([chunks.chat_choice(index, "", role="assistant")], job.usage_so_far(req, index))
        async for item in self._deltas(job, stream):
            if isinstance(item, str):
                yield item
                continue
            comp, logprobs = item.completion, None
            if num_top is not None:
                logprobs = self.logprobs.chat(comp, item.token_start, item.token_stop, num_top,
                                              req.return_tokens_as_token_ids)  # fmt: skip
            usage = job.usage_so_far(req, item.index, item.token_stop)
            for event in tool_stream.events(item.index, item.text, logprobs, comp.finish_reason, comp.stop_reason,
                                            usage):  # fmt: skip
                yield event
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunks.event([], usage=job.usage())
        yield "data: [DONE]\n\n"

    # ---- shared ---------------------------------------------------------------------------------
    async def _deltas(self, job: Job, stream: RequestStream) -> AsyncIterator[_Delta | str]:
        """Each choice's new text as it becomes safe to send; after a failure one SSE error event (a str), then stop."""
        sent_chars = dict.fromkeys(job.index_of, 0)
        sent_tokens = dict.fromkeys(job.index_of, 0)
        latest: dict[str, CompletionOutput] = {}

        def ended_by(error: APIError) -> Iterator[_Delta | str]:
            """Every choice still open ends with finish_reason "abort", then the one error event."""
            for rid, index in job.index_of.items():
                if rid not in job.finals:
                    seen = latest.get(rid) or CompletionOutput(index=index, text="", token_ids=[])
                    aborted = replace(seen, finish_reason="abort", stop_reason=None)
                    yield _Delta(index, aborted, "", sent_chars[rid], sent_tokens[rid], sent_tokens[rid])
            yield error_event(error)

        try:
            async for out in stream:
                rid, comp = out.request_id, out.outputs[0]
                latest[rid] = comp
                if out.finished:
                    job.finals[rid] = out
                elif len(comp.text) == sent_chars[rid]:
                    continue  # tokens whose text is held back: their logprobs go with the next chunk
                yield _Delta(job.index_of[rid], comp, comp.text[sent_chars[rid] :], sent_chars[rid], sent_tokens[rid],
                             len(comp.token_ids))  # fmt: skip
                sent_chars[rid], sent_tokens[rid] = len(comp.text), len(comp.token_ids)
                error = finish_error(out, stream) if out.finished else None
                if error is not None:
                    for item in ended_by(error):
                        yield item
                    return
        except Exception as err:  # the engine died, refused the request, or a shutdown ended it
            for item in ended_by(engine_error(err)):
                yield item
        finally:
            self._abort_unfinished(stream)

    def _submit(self, job: Job) -> RequestStream:
        try:
            return self.engine.add(job.children, time.monotonic())
        except (QueueFullError, EngineDeadError) as err:
            raise refusal(err) from err

    async def _collect(self, job: Job, stream: RequestStream, raw: Request) -> bool:
        """Wait for every final output (into `job.finals`); False if the client went away (requests aborted).
        A request the engine failed on, or a shutdown aborted, raises the APIError to answer with."""

        async def consume() -> None:
            async for out in stream:
                if out.finished:
                    job.finals[out.request_id] = out
                    error = finish_error(out, stream)
                    if error is not None:
                        raise error

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
            except APIError:
                raise
            except Exception as err:
                raise engine_error(err) from err
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

    def _with_prompt_logprobs(self, body: dict, job: Job, req: SamplingRequest) -> dict:
        """vLLM's `prompt_logprobs` per choice, when the request asked for them (prompt_logprobs.py)."""
        if req.prompt_logprobs is None:
            return body
        per_index = {i: vllm_prompt_logprobs(self.logprobs, job.finals[rid], req.prompt_logprobs)
                     for rid, i in job.index_of.items()}  # fmt: skip
        return attach(body, per_index)

    async def _prompt_text(self, job: Job, prompt_index: int) -> str:
        text = job.prompt_texts[prompt_index]
        return text if text is not None else await self.encoder.decode(job.prompts[prompt_index])
