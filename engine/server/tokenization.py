"""vLLM's `/tokenize` and `/detokenize`: the served model's tokenizer over HTTP, in vLLM's request and response shapes.

Role: benchmark clients and gateways ask a vLLM server how many tokens a text or a chat is, and
what text token ids stand for. `POST /tokenize` takes a completion form (`prompt`, with
`add_special_tokens` true by default) or a chat form (`messages`, `add_special_tokens` false by default, `tools`, and
the chat rendering fields of chat_render.py: `add_generation_prompt`, `continue_final_message`,
`chat_template_kwargs`) and answers `{"count", "max_model_len", "tokens",
"token_strs"}` (`token_strs`, the tokens' vocabulary strings, only with `return_token_strs`);
`POST /detokenize` takes `tokens` and answers `{"prompt"}`, special tokens spelled out (as vLLM).
(The module is not named `tokenize`: that would shadow the standard library's wherever this
folder lands on `sys.path`.)

Invariants:
- The chat form goes through `Serving.chat_prompt`, the one path of `/v1/chat/completions`, so
  its tokens are exactly the prompt a chat completion of the same messages (and tools) feeds the engine.
- The requests are checked like the completion endpoints' (protocol.py): strict types, unknown
  fields ignored, proper Unicode, `model` naming the served model or a 404; chat fields vLLM
  takes but the chat path cannot honour are refused with a 400 (chat_render.py), never ignored. A
  loaded LoRA adapter's name is a valid `model` too (it tokenizes as its base model). Every refusal
  is OpenAI's error body naming the parameter.
- A text is tokenized only within the prompt encoder's character cap (a 400 beyond it), but its
  token count is not capped at `max_model_len` (vLLM's behaviour: the response reports the
  context so clients compare); `/detokenize` ids must lie in the tokenizer's vocabulary (a 400
  naming `tokens` otherwise: the tokenizer would silently drop them). Tokenizer work runs in the
  prompt encoder's threads, off the event loop.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, PlainValidator, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from .checks import check_model
from .protocol import APIError, ChatMessage, ChatTemplateFields, StrictModel
from .replies import answering_shutdown
from .serving import Serving
from .surrogates import refuse_unpaired_surrogates
from .tools.plan import ToolPlan, check_messages, check_tool_definitions
from .tools.schema import ToolDefinition


def _token_ids(value: Any) -> list[int]:
    # One error for the whole list, not one per bad item (a huge list of strings would make millions).
    if type(value) is not list:
        raise PydanticCustomError("token_ids", "expected a list of integer token ids")
    if not set(map(type, value)) <= {int}:  # bool is not int here: JSON true is no token id
        index, item = next((i, item) for i, item in enumerate(value) if type(item) is not int)
        raise PydanticCustomError("token_ids", "expected a list of integer token ids; item {index} is {item}",
                                  {"index": index, "item": repr(item)[:40]})  # fmt: skip
    return value


class _TokenizerRequest(StrictModel):
    model: str | None = None  # None: the served model, as vLLM allows

    @model_validator(mode="after")
    def _proper_unicode(self) -> _TokenizerRequest:
        refuse_unpaired_surrogates(self)
        return self


class TokenizeCompletionRequest(_TokenizerRequest):
    prompt: str
    add_special_tokens: bool = True  # e.g. BOS, where the tokenizer's post-processor adds one
    return_token_strs: bool | None = False


class TokenizeChatRequest(_TokenizerRequest, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    add_special_tokens: bool = False  # on top of those the chat template writes (vLLM's default: none)
    return_token_strs: bool | None = False
    tools: list[ToolDefinition] | None = None  # rendered as a chat completion renders them (tools/render.py)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_TokenizerRequest):
    tokens: Annotated[list[int], PlainValidator(_token_ids)]


class DetokenizeResponse(BaseModel):
    prompt: str


def parse_tokenize(body: dict[str, Any]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The form a /tokenize body is (by `prompt` or `messages`; a null is no value), validated as the other
    request models are."""
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt and has_messages:
        raise APIError("give either prompt (a text) or messages (a chat) to tokenize, not both", param="messages")
    if not has_prompt and not has_messages:
        raise APIError("give prompt (a text) or messages (a chat) to tokenize", param="prompt")
    form = TokenizeChatRequest if has_messages else TokenizeCompletionRequest
    try:
        return form.model_validate(body)
    except ValidationError as err:  # rendered by the app's handler, as FastAPI's own validation errors are
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in err.errors()]) from err


async def tokenize(serving: Serving, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    check_model(req.model, serving.model_name, serving.adapter_names())  # an adapter shares the base's tokenizer
    if isinstance(req, TokenizeChatRequest):
        serving.check_chat_template()
        check_messages(req.messages)
        plan = ToolPlan(check_tool_definitions(req.tools), None)  # rendered (not parsed), as the chat completion
        _, token_ids = await answering_shutdown(serving.chat_prompt(req, req.messages, req.add_special_tokens, plan))
    else:
        encoded = serving.encoder.encode([req.prompt], "prompt", req.add_special_tokens)
        [token_ids] = await answering_shutdown(serving.engine.guard(encoded))
    token_strs = await serving.encoder.token_strings(token_ids) if req.return_token_strs else None
    body = TokenizeResponse(count=len(token_ids), max_model_len=serving.info.max_model_len, tokens=token_ids,
                            token_strs=token_strs)  # fmt: skip
    return body.model_dump()


async def detokenize(serving: Serving, req: DetokenizeRequest) -> dict[str, Any]:
    check_model(req.model, serving.model_name, serving.adapter_names())
    tokens = req.tokens
    vocab_size = serving.info.tokenizer.vocab_size
    if tokens and not (min(tokens) >= 0 and max(tokens) < vocab_size):
        index, bad = next((i, t) for i, t in enumerate(tokens) if not 0 <= t < vocab_size)
        shown = str(bad)
        shown = shown if len(shown) <= 40 else shown[:40] + "..."
        raise APIError(f"tokens must be token ids in this model's vocabulary, [0, {vocab_size}); item {index} is "
                       f"{shown}", param="tokens")  # fmt: skip
    text = await answering_shutdown(serving.engine.guard(serving.encoder.decode(tokens, skip_special_tokens=False)))
    return DetokenizeResponse(prompt=text).model_dump()
