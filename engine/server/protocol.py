"""OpenAI API shapes: request and response models, and errors in OpenAI's `{"error": {...}}` form.

Role: the edge of the server. Requests are parsed strictly (no "0.5" for a float, no 1 for a
bool), ranges follow OpenAI's documentation (vLLM's extensions where OpenAI has none), and
every rejection names the offending parameter in `error.param`. Unknown fields are ignored,
as vLLM does, so clients that send extra fields keep working.

Invariants: a request model that exists has in-range values, every number finite (no NaN
or infinity, which Python's JSON parser lets through) and bounded by what the engine takes
(`sampling_params`' documented limits: int64 seeds, int32 counts), and every string proper
Unicode (an unpaired UTF-16 surrogate anywhere is a 400 naming where it is). Cross-field checks
(e.g. `top_logprobs` needs `logprobs`) and checks against the model (context length, token ids
in the vocabulary) are made by `serving.py`, which raises `APIError` with the parameter's name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    SerializerFunctionWrapHandler,
    Tag,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..sampling_params import LOGIT_BIAS_LIMIT, MAX_INT32, REPETITION_PENALTY_RANGE, SEED_MAX, SEED_MIN
from .surrogates import refuse_unpaired_surrogates
from .tools.schema import DeltaToolCall, MessageToolCalls, ToolCall, ToolChoice, ToolDefinition

# ---- errors -----------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error the client caused (or must wait out); rendered as OpenAI's error body."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        ).model_dump()


# pydantic puts union-member and validator tags into an error's location; they are not parameter names.
_LOC_TAGS = {
    "str",
    "int",
    "float",
    "bool",
    "list",
    "dict",
    "none",
    "function-after",
    "function-before",
    "function-wrap",
    "tagged-union",
    "lax-or-strict",
    "json-or-python",
    "nullable",
    "union",
}


def param_from_loc(loc: tuple[int | str, ...]) -> str | None:
    """("body", "messages", 0, "content", "str") -> "messages[0].content"; None for the body itself."""
    parts = list(loc[1:]) if loc and loc[0] == "body" else list(loc)
    param = ""
    for part in parts:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.isidentifier() and part not in _LOC_TAGS and "[" not in part:
            param += f".{part}" if param else part
    return param or None


def _prompt_kind(value: Any) -> str:
    """Which form of `prompt` a value is, from its first item: one union member is validated, not four
    (a union would report an error per item of each member it is not: millions for a long id list)."""
    if isinstance(value, list) and value:
        first = value[0]
        return "str-list" if isinstance(first, str) else "id-lists" if isinstance(first, list) else "id-list"
    return "id-list" if isinstance(value, list) else "str"


def _id_list(value: Any) -> list[int]:
    # Only the shape here: serving.py checks every id (an int in the vocabulary) after the length check,
    # so a huge id list costs no per-item work before it is refused.
    if type(value) is not list:
        raise PydanticCustomError("token_ids", "a token-id prompt must be a list of integers")
    return value


def _id_lists(value: Any) -> list[list[int]]:
    if type(value) is not list or not all(type(item) is list for item in value):
        raise PydanticCustomError("token_ids", "a batch of token-id prompts must be a list of lists of integers")
    return value


# ---- requests ---------------------------------------------------------------------------------

MAX_STOP_STRINGS = 64  # stop strings are matched on the engine thread after every token: bounded work
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024

Count = Annotated[int, Field(ge=0, le=MAX_INT32)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: with include_usage, every chunk carries the usage so far


class ResponseFormat(StrictModel):
    type: str
    json_schema: dict[str, Any] | None = None


class SamplingRequest(StrictModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # None: the served model, as vLLM allows
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)  # below sampling_params.GREEDY_TEMPERATURE: greedy
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)  # vLLM: -1 or 0 disables
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)  # the n completions use seed, seed+1, ... (wrapped)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    # OpenAI: token id (as a string) -> bias in [-100, 100]; ids are checked against the vocabulary by serving.py.
    logit_bias: dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[Count], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM's extension: logprob tokens as "token_id:N"
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's extension: choices[i].prompt_logprobs
    response_format: ResponseFormat | None = None  # text, json_object or json_schema (server/structured.py)
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension: json, regex, choice, grammar, json_object
    user: str | None = None
    # P/D disaggregation hand-off set by Tidepool's router (see engine/server/disagg.py); clients leave it out.
    kv_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _proper_unicode(self) -> SamplingRequest:
        refuse_unpaired_surrogates(self)
        return self


# Tags are not identifiers, so `param_from_loc` leaves them out of the parameter it names.
Prompt = Annotated[
    Annotated[str, Tag("str")]
    | Annotated[list[str], Tag("str-list")]
    | Annotated[list[int], PlainValidator(_id_list), Tag("id-list")]
    | Annotated[list[list[int]], PlainValidator(_id_lists), Tag("id-lists")],
    Discriminator(_prompt_kind),
]


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0, le=MAX_INT32)  # 0 only with echo (checks.py): score the prompt
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None  # refused when set: no fill-in-the-middle yet


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: MessageToolCalls | None = None  # assistant: the calls it made (tools/render.py renders them)
    tool_call_id: str | None = None  # role "tool": the call this message answers


class ChatTemplateFields(StrictModel):
    """How a chat is rendered (vLLM's extensions), shared by chat completions and /tokenize's chat form
    (chat_render.py reads them)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # end the prompt inside the last (assistant) message: the model continues it
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. {"enable_thinking": false}
    chat_template: str | None = None  # a per-request template: refused (this server renders the model's own)
    mm_processor_kwargs: dict[str, Any] | None = None  # multimodal: refused when not empty (text models only)


class ChatCompletionRequest(SamplingRequest, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDefinition] | None = None  # tool calling: engine/server/tools/
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without (OpenAI's defaults)
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None  # OpenAI's deprecated forms of tools: refused (checks.py)
    function_call: Any = None


# ---- responses --------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's extension: the stop string or token that ended it


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None  # left out when there are none, as OpenAI does

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if key != "tool_calls" or value is not None}


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None  # streamed calls: written by tools/replies.py

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # OpenAI sends `role` only in a choice's first delta; null fields are left out, not sent as null.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "tidepool"
    root: str | None = None  # the model's folder, or a LoRA adapter's
    parent: str | None = None  # a LoRA adapter's base model id (vLLM's field); None for the base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
