"""Tool calling through a real `tidepool serve --enable-auto-tool-choice --tool-call-parser hermes` and the `openai`
client: forced calls (`tool_choice` "required" and named) parse and validate against the tool's schema, streaming
and not, the stream reassembling to the non-streamed call; "auto" parses what the model writes (forced here with
a regex constraint, since the random test model writes no calls on its own); "none" never parses; a conversation
with tool results renders as /tokenize shows; every bad input is a 400 naming the field; bad flags exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from serve_proc import Server

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS, "strict": True}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# What a model answering in the Hermes format writes (forced by a regex: the random test model writes no calls).
FORCED = r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}\n</tool_call>'  # noqa: E501


@pytest.fixture(scope="module")
def tool_server(serve: Callable[..., Server]) -> Server:
    return serve("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def tool_client(tool_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.api, api_key="unused", max_retries=0, timeout=120)


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def streamed(client: openai.OpenAI, **args: Any) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """(content, calls, last finish_reason) reassembled from a stream's deltas, checking OpenAI's delta shape."""
    content: list[str] = []
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in client.chat.completions.create(**args, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for call in delta.tool_calls or []:
            if call.index not in names:  # the first delta of a call: id, type, name, arguments ""
                assert call.id and call.id.startswith("call_") and call.type == "function", call
                assert call.function.name and call.function.arguments == "", call
                names[call.index], arguments[call.index] = call.function.name, ""
            else:  # later ones: arguments only
                assert call.id is None and call.function.name is None, call
                arguments[call.index] += call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert sorted(names) == list(range(len(names)))  # calls numbered 0, 1, ... in order
    return "".join(content) or None, [(names[i], arguments[i]) for i in sorted(names)], finish


def assert_valid(calls: list[tuple[str, str]]) -> None:
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# ---- forced calls: required and named ----------------------------------------------------------------
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}], ids=["greedy", "seeded"])
@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_forced_calls_validate_and_stream_the_same(
    tool_client: openai.OpenAI, tool_server: Server, choice: Any, sampling: dict[str, Any]
) -> None:
    args = dict(model=tool_server.model, messages=MESSAGES, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                max_tokens=200, **sampling)  # fmt: skip
    full = tool_client.chat.completions.create(**args)
    choice_ = full.choices[0]
    assert choice_.finish_reason == "tool_calls", choice_
    assert choice_.message.content is None and len(choice_.message.tool_calls or []) == 1
    call = choice_.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert_valid(calls_of(choice_.message))
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    content, calls, finish = streamed(tool_client, **args)
    assert (content, calls, finish) == (None, calls_of(choice_.message), "tool_calls")
    tool_server.wait_pool_free()


def test_required_with_parallel_calls(tool_client: openai.OpenAI, tool_server: Server) -> None:
    full = tool_client.chat.completions.create(model=tool_server.model, messages=MESSAGES, tools=TOOLS,
                                               tool_choice="required", temperature=1.0, seed=3)  # fmt: skip
    message = full.choices[0].message
    assert message.tool_calls and message.content is None
    if full.choices[0].finish_reason == "tool_calls":  # the random model may instead run to max_tokens
        assert_valid(calls_of(message))
    else:
        assert full.choices[0].finish_reason == "length"
        assert_valid(calls_of(message)[:-1])


def test_raw_stream_chunks_have_openai_shape(tool_server: Server) -> None:
    body = {"model": tool_server.model, "messages": MESSAGES, "tools": TOOLS, "parallel_tool_calls": False,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "max_tokens": 200, "stream": True,
            "temperature": 0}  # fmt: skip
    deltas = []
    with httpx.stream("POST", tool_server.api + "/chat/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                deltas.append(json.loads(line.removeprefix("data: "))["choices"][0])
    calls = [d["delta"]["tool_calls"][0] for d in deltas if "tool_calls" in d["delta"]]
    first, *rest = calls
    assert set(first) == {"index", "id", "type", "function"} and first["function"]["arguments"] == ""
    assert first["function"]["name"] == "get_time" and first["type"] == "function"
    assert rest and all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in rest)
    assert json.loads("".join(c["function"]["arguments"] for c in rest))["zone"] in ("UTC", "CET")
    assert deltas[-1]["finish_reason"] == "tool_calls"


# ---- auto and none ------------------------------------------------------------------------------------
def test_auto_parses_the_models_calls_streaming_and_not(tool_client: openai.OpenAI, tool_server: Server) -> None:
    args = dict(model=tool_server.model, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=1.0, seed=5,
                extra_body={"structured_outputs": {"regex": FORCED}})  # fmt: skip
    full = tool_client.chat.completions.create(**args)  # tool_choice "auto": the default with tools
    message = full.choices[0].message
    assert message.content == "Checking." and full.choices[0].finish_reason == "tool_calls"
    [(name, arguments)] = calls_of(message)
    assert name == "get_weather" and json.loads(arguments)["city"] in ("Paris", "Rome")
    assert arguments.startswith('{"city": ')  # the model's own text, not a re-serialisation
    assert streamed(tool_client, **args) == ("Checking.", calls_of(message), "tool_calls")


def test_none_renders_tools_but_never_parses(tool_client: openai.OpenAI, tool_server: Server) -> None:
    args = dict(model=tool_server.model, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=200,
                temperature=0, extra_body={"structured_outputs": {"regex": FORCED}})  # fmt: skip
    full = tool_client.chat.completions.create(**args)
    message = full.choices[0].message
    assert message.tool_calls is None and full.choices[0].finish_reason == "stop"
    assert message.content is not None and message.content.startswith("Checking.\n<tool_call>\n")
    assert streamed(tool_client, **args) == (message.content, [], "stop")
    plain = tool_client.chat.completions.create(model=tool_server.model, messages=MESSAGES, max_tokens=1)
    assert full.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools are in the prompt


def test_a_conversation_with_tool_results(tool_client: openai.OpenAI, tool_server: Server) -> None:
    first = tool_client.chat.completions.create(model=tool_server.model, messages=MESSAGES, tools=TOOLS,
                                                tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                                                temperature=0)  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    history = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]  # fmt: skip
    second = tool_client.chat.completions.create(model=tool_server.model, messages=history, tools=TOOLS,
                                                 tool_choice="none", max_tokens=4, temperature=0)  # fmt: skip
    assert second.choices[0].message.content is not None
    tokens = httpx.post(tool_server.url + "/tokenize", json={"messages": history, "tools": TOOLS}, timeout=30).json()
    assert tokens["count"] == second.usage.prompt_tokens  # /tokenize renders exactly what the chat feeds the engine
    text = httpx.post(tool_server.url + "/detokenize", json={"tokens": tokens["tokens"]}, timeout=30).json()["prompt"]
    assert "# Tools" in text and f'<tool_call>\n{{"name": "{call.function.name}", "arguments": ' in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in text


# ---- bad input ------------------------------------------------------------------------------------------
def tool(name: str = "f", **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **function}}


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("choice-unknown-mode", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("choice-named-unknown", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ("choice-named-malformed", {"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ("choice-without-tools", {"tool_choice": "required"}, "tool_choice"),
    ("auto-without-tools", {"tool_choice": "auto"}, "tool_choice"),
    ("tool-type", {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ("tool-without-function", {"tools": [{"type": "function"}]}, "tools[0].function"),
    ("function-name", {"tools": [tool("no spaces allowed")]}, "tools[0].function.name"),
    ("duplicate-names", {"tools": [tool("f"), tool("g"), tool("f")]}, "tools[2].function.name"),
    ("parameters-not-object-schema", {"tools": [tool(parameters={"type": "string"})]}, "tools[0].function.parameters"),
    ("parameters-not-json-object", {"tools": [tool(parameters=[1])]}, "tools[0].function.parameters"),
    ("parallel-not-bool", {"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("tool-message-without-id", {"messages": [*MESSAGES, {"role": "tool", "content": "x"}]},
     "messages[1].tool_call_id"),
    ("tool-calls-malformed", {"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
     "messages[0].tool_calls[0].function"),
    ("tool-calls-not-assistant", {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
    ("required-with-json", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ("functions-deprecated", {"functions": [{"name": "f"}]}, "functions"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_tool_input_is_a_400_naming_the_field(tool_server: Server, body: dict[str, Any], param: str) -> None:
    request = {"model": tool_server.model, "messages": MESSAGES, "max_tokens": 2, **body}
    resp = httpx.post(tool_server.api + "/chat/completions", json=request, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_auto_needs_the_flag(server: Server) -> None:
    """The shared server runs without --enable-auto-tool-choice: tools with the default "auto" are refused (vLLM's
    rule), while forced choices need no flag."""
    request = {"model": server.model, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 2}
    resp = httpx.post(server.api + "/chat/completions", json=request, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in resp.json()["error"]["message"]
    forced = {**request, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 200, "temperature": 0}
    resp = httpx.post(server.api + "/chat/completions", json=forced, timeout=120)
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "tool_calls", resp.text


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--tool-call-parser", "nope"], "--tool-call-parser: unknown tool-call parser 'nope'; known: hermes"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    ],
)
def test_bad_tool_flags_exit_2_before_loading(
    tiny_model_dir: Path, tmp_path: Path, flags: list[str], says: str
) -> None:
    script = Path(sys.executable).with_name("tidepool")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "tidepool.cli"]
    proc = subprocess.run([*cmd, "serve", "--model", str(tiny_model_dir), *flags], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
