"""A chat with tools -> the message dicts (and `tools`) its chat template is rendered with.

Role: `chat_inputs` is the one place a request's messages become template input (serving.py's
`chat_prompt` calls it for chat completions and /tokenize alike). A template that knows about tools
(its source mentions `tools`, as Qwen2.5's, Llama 3.1's and Hermes' do) gets them as transformers
and vLLM pass them: `tools=[{"type": "function", "function": {...}}, ...]`, assistant messages with
`tool_calls` (each call's `arguments` parsed into a dict, as templates expect), `role: "tool"`
messages with `tool_call_id`.

A template with no tools section (SmolLM2's, the test model's) gets the documented default
rendering, which is Qwen2.5's own text, so the `hermes` parser reads what the model answers:
- the tools are listed in a system-prompt section, appended to the first system message (after a
  blank line) or, when there is none, as a system message of their own at the front:

      # Tools

      You may call one or more functions to assist with the user query.

      You are provided with function signatures within <tools></tools> XML tags:
      <tools>
      {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}
      </tools>

      For each function call, return a json object with function name and arguments within
      <tool_call></tool_call> XML tags:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

  (the two lines above are one line in the prompt; with `parallel_tool_calls: false` a last line
  says to call at most one function);
- an assistant message's `tool_calls` become `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`
  blocks after its content (one per line), ARGS being the call's `arguments` text as sent, so a
  call the server produced is rendered back exactly as the model wrote it (prefix caching holds);
- consecutive `role: "tool"` messages become one user turn of `<tool_response>\\n...\\n</tool_response>`
  blocks, one per line.

Invariants: messages without tool fields render exactly as before tool calling existed; nothing
here touches the template itself.
"""

from __future__ import annotations

import json
from typing import Any

from ...tokenizer import Tokenizer
from ..checks import message_dict
from ..protocol import APIError, ChatMessage
from .plan import ToolPlan

_SECTION = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
_ONE_CALL = "\nCall at most one function."


def template_knows_tools(source: str) -> bool:
    """Whether a chat template renders tools itself (it reads the `tools` variable)."""
    return "tools" in source


def tools_section(tools: list[dict[str, Any]], parallel_tool_calls: bool = True) -> str:
    """The default rendering's system-prompt section listing `tools` (OpenAI tool dicts)."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return _SECTION.format(tools=listed) + ("" if parallel_tool_calls else _ONE_CALL)


def chat_inputs(
    messages: list[ChatMessage], plan: ToolPlan, tokenizer: Tokenizer
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(message dicts, the `tools` to pass to the template) for `messages` under the model's chat template."""
    try:
        template = tokenizer.get_chat_template(None, plan.tools)  # the one apply_chat_template will pick
    except ValueError as err:
        raise APIError(f"the chat template rejected the messages: {err}", param="messages") from err
    return template_inputs(messages, plan.tools, template, plan.parallel_tool_calls)


def template_inputs(
    messages: list[ChatMessage], tools: list[dict[str, Any]] | None, template: str, parallel_tool_calls: bool = True
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(message dicts, the `tools` to pass to the template) for `messages` under `template` (its source)."""
    if template_knows_tools(template):
        return [_native(m) for m in messages], tools
    dicts: list[dict[str, Any]] = []
    previous_was_tool = False
    for message in messages:
        if message.role == "tool":
            block = f"<tool_response>\n{message_dict(message)['content']}\n</tool_response>"
            if previous_was_tool:  # consecutive results share one user turn, as Qwen2.5's template renders them
                dicts[-1]["content"] += "\n" + block
            else:
                dicts.append({"role": "user", "content": block})
            previous_was_tool = True
            continue
        previous_was_tool = False
        result = message_dict(message)
        if message.tool_calls:
            blocks = [f'<tool_call>\n{{"name": {json.dumps(c.function.name)}, "arguments": {c.function.arguments}}}'
                      "\n</tool_call>" for c in message.tool_calls]  # fmt: skip
            result["content"] = "\n".join([result["content"], *blocks] if result["content"] else blocks)
        dicts.append(result)
    if tools:
        section = tools_section(tools, parallel_tool_calls)
        if dicts and dicts[0]["role"] == "system":
            dicts[0]["content"] = f"{dicts[0]['content']}\n\n{section}" if dicts[0]["content"] else section
        else:
            dicts.insert(0, {"role": "system", "content": section})
    return dicts, None


def _native(message: ChatMessage) -> dict[str, Any]:
    result = message_dict(message)
    if message.tool_calls:
        result["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                          "arguments": _arguments(c.function.arguments)}}
            for c in message.tool_calls
        ]  # fmt: skip
    if message.tool_call_id is not None:
        result["tool_call_id"] = message.tool_call_id
    return result


def _arguments(text: str) -> Any:
    """A call's arguments as templates expect them (a dict, as transformers and vLLM pass them); the text when
    it is not JSON (the template then shows it as it is)."""
    try:
        return json.loads(text)
    except ValueError:
        return text
