"""How a chat becomes prompt text: the chat template's own variables and vLLM's rendering extensions.

Role: `render_options(req)` checks a request's rendering fields (`ChatTemplateFields`) into a
`RenderOptions`; `render(tokenizer, messages, tools, options)` applies the model's chat template with
them. `chat_template_kwargs` become template variables (e.g. Qwen3's `enable_thinking`);
`continue_final_message` renders without a generation prompt and cuts the text right after the last
message's content, so the model continues that assistant message instead of starting a new one
(transformers' and vLLM's meaning).

Invariants: a field this server cannot honour is a 400 naming it, never ignored: a per-request
`chat_template`, non-empty `mm_processor_kwargs`, template kwargs that would replace what the server
passes (`messages`, `tools`, ...), `continue_final_message` with `add_generation_prompt` or after a
message that is not the assistant's, and a final message the template does not reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..tokenizer import Tokenizer
from .protocol import APIError, ChatTemplateFields

# What the server itself gives every template; a request's kwargs may not replace them.
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "documents", "chat_template", "tokenize"})


@dataclass(frozen=True, slots=True)
class RenderOptions:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def render_options(req: ChatTemplateFields, messages: list[dict[str, Any]]) -> RenderOptions:
    if req.chat_template is not None:
        raise APIError("chat_template (a template per request) is not supported: this server renders the model's "
                       "own template; leave it out", param="chat_template", code="unsupported")  # fmt: skip
    if req.mm_processor_kwargs:
        raise APIError("mm_processor_kwargs is for multimodal models; this server serves text models only",
                       param="mm_processor_kwargs", code="unsupported")  # fmt: skip
    kwargs = dict(req.chat_template_kwargs or {})
    clashes = sorted(RESERVED & set(kwargs))
    if clashes:
        raise APIError(f"chat_template_kwargs may not set {', '.join(clashes)}: the server passes them itself",
                       param=f"chat_template_kwargs.{clashes[0]}")  # fmt: skip
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise APIError("continue_final_message continues the last message, add_generation_prompt starts a new "
                           "one: set add_generation_prompt to false", param="continue_final_message")  # fmt: skip
        if not messages or messages[-1].get("role") != "assistant":
            raise APIError("continue_final_message needs the last message to be the assistant's (the text to "
                           "continue)", param="continue_final_message")  # fmt: skip
    return RenderOptions(req.add_generation_prompt, req.continue_final_message, kwargs)


def render(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, options: RenderOptions
) -> str:
    """The chat template applied (in the caller's thread: the prompt encoder runs it in its own)."""
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=options.add_generation_prompt, tools=tools, **options.template_kwargs
    )
    if not options.continue_final_message:
        return text
    final = messages[-1].get("content") or ""
    if isinstance(final, list):  # text parts
        final = "".join(part.get("text", "") for part in final if isinstance(part, dict))
    for piece in (final, final.strip()):
        if piece and piece in text:
            return text[: text.rindex(piece) + len(piece)]
    raise ValueError("continue_final_message: the chat template does not reproduce the last message's text")
