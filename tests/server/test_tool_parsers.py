"""Tool calling without a server: the Hermes parser (whole and streamed), the default rendering, the checks
(each a 400 naming the field), the constraint for required/named choices, and the stream's chunk bytes.

The central property: for any output and any way of cutting it into pieces, the streamed deltas
reassemble to exactly the non-streamed content and calls (hypothesis, over outputs built from the
pieces models actually write: text, blocks in every form, stray tags, whitespace).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidepool.engine.server.protocol import (
    APIError,
    ChatChunkChoice,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatMessage,
    DeltaMessage,
)
from tidepool.engine.server.sse import StreamChunks
from tidepool.engine.server.tools.deltas import ContentDelta, ToolCallDelta, assemble, extract
from tidepool.engine.server.tools.hermes import HermesParser
from tidepool.engine.server.tools.parsers import check_tool_flags, get_parser
from tidepool.engine.server.tools.plan import NO_TOOLS, ToolPlan, ToolSettings, check_tools, tool_structured_outputs
from tidepool.engine.server.tools.render import template_inputs, tools_section
from tidepool.engine.server.tools.replies import ToolStream, tool_call_choice, tool_message
from tidepool.engine.server.tools.schema import DeltaFunctionCall, DeltaToolCall
from tidepool.engine.tokenizer import Tokenizer

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "City weather", "parameters": CITY}}
AUTO = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")
PLAIN_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                  "{% endfor %}")  # fmt: skip


def parse(text: str, max_calls: int | None = None) -> tuple[str | None, list[tuple[str, str]]]:
    got = extract(HermesParser(max_calls), text)
    return got.content, [(c.function.name, c.function.arguments) for c in got.tool_calls]


# ---- the Hermes parser ----------------------------------------------------------------------------------
CASES: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    ("plain text, no call", "plain text, no call", []),
    ("  spaced out \n", "  spaced out \n", []),  # without calls the text is unchanged
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', None, [("f", '{"a": 1}')]),
    # the arguments' raw text, braces inside strings and nested values included
    ('<tool_call>{"name":"f","arguments":{"s":"}{\\"","n":[1,{"b":[]}]}}</tool_call>', None,
     [("f", '{"s":"}{\\"","n":[1,{"b":[]}]}')]),
    ('Let me check.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n'
     '{"name": "g", "arguments": {"x": "y"}}\n</tool_call>\nDone.', "Let me check.Done.",
     [("f", "{}"), ("g", '{"x": "y"}')]),
    ('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', None, [("f", '{"a": 1}')]),  # Llama's key
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", '{"a": 1}')]),  # a JSON string
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', None, [("f", '{"a": 1}')]),  # keys reversed
    ('<tool_call>[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]</tool_call>', None,
     [("f", '{"a": 1}'), ("g", "{}")]),  # SmolLM2 / xLAM: a list of calls in one block
    ('<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")]),  # no arguments: the empty object
    ("<tool_call>not json</tool_call> x", "<tool_call>not json</tool_call> x", []),  # not a call: content
    ('a <tool_call>{"name": 3}</tool_call>', 'a <tool_call>{"name": 3}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": {"a": [1, 2', None, [("f", '{"a": [1, 2')]),  # cut by max_tokens
    ('<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),  # cut before the name was read
    ("ends with a partial tag <tool_ca", "ends with a partial tag <tool_ca", []),
    ('x</tool_call>y', "x</tool_call>y", []),
    ('<tool_call>{"name": "f", "arguments": 7}</tool_call>', None, [("f", "7")]),
    ('<tool_call>{"name": "f", "arguments": {}} trailing junk</tool_call>ok', "ok", [("f", "{}")]),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_hermes_extract(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    assert parse(text) == (content, calls)


def test_at_most_max_calls_are_reported_and_later_blocks_skipped() -> None:
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}'
    text += "</tool_call>"
    assert parse(text, max_calls=1) == (None, [("f", "{}")])
    listed = '<tool_call>[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]</tool_call>'
    assert parse(listed, max_calls=1) == (None, [("f", "{}")])


def test_calls_have_openai_ids_and_stream_in_openai_order() -> None:
    parser = HermesParser()
    deltas = [d for piece in ('<tool_call>{"name": "f", "arg', 'uments": {"a"', ": 1}}</tool_call>") for d in
              parser.feed(piece)] + parser.finish()  # fmt: skip
    start, *fragments = deltas
    assert isinstance(start, ToolCallDelta) and start.name == "f" and start.arguments == ""
    assert start.id is not None and start.id.startswith("call_") and len(start.id) == 29
    assert all(isinstance(d, ToolCallDelta) and d.id is None and d.index == 0 for d in fragments)
    assert "".join(d.arguments for d in fragments) == '{"a": 1}'
    # the name is sent as soon as it is known, before the arguments end
    early = HermesParser().feed('<tool_call>{"name": "f", "arguments": {"a"')
    assert [type(d) for d in early] == [ToolCallDelta, ToolCallDelta] and early[1].arguments == '{"a"'


PIECES = st.sampled_from([
    "Sure", " ", "\n", "text ", "<tool_call>", "</tool_call>", "<tool", "_call>", "</tool", '{"name": "f", ',
    '"arguments": ', '{"city": "Paris"}', '{"q": "a}b\\"c", "n": [1, {"x": null}]}', "}", "\n</tool_call>\n",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>', '"parameters": ', "[",
    '{"name": "g", "arguments": {}}', "]", ", ", '"{\\"a\\": 1}"', "42", "not json", "😀", "\\", '"',
])  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(PIECES, max_size=14), cuts=st.lists(st.integers(0, 400), max_size=12),
       max_calls=st.sampled_from([None, 1]))  # fmt: skip
def test_streamed_deltas_reassemble_to_the_non_streamed_result(
    pieces: list[str], cuts: list[int], max_calls: int | None
) -> None:
    text = "".join(pieces)
    whole = extract(HermesParser(max_calls), text)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    parser = HermesParser(max_calls)
    deltas = [d for a, b in itertools.pairwise(bounds) for d in parser.feed(text[a:b])] + parser.finish()
    streamed = assemble(deltas)
    assert streamed.content == whole.content
    assert [(c.function.name, c.function.arguments) for c in streamed.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls
    ]
    if not whole.tool_calls:  # without calls, every character is content, in order
        assert "".join(d.text for d in deltas if isinstance(d, ContentDelta)) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list('<>/tool_cal{}[]"\\:, \nnamergsf')), max_size=80),
       cut=st.integers(0, 80))  # fmt: skip
def test_any_text_in_two_pieces_equals_the_whole(text: str, cut: int) -> None:
    parser = HermesParser()
    streamed = assemble([*parser.feed(text[:cut]), *parser.feed(text[cut:]), *parser.finish()])
    whole = extract(HermesParser(), text)
    assert (streamed.content, [c.function for c in streamed.tool_calls]) == (
        whole.content, [c.function for c in whole.tool_calls])  # fmt: skip


def test_parser_registry_and_start_up_flags() -> None:
    assert get_parser("hermes") is HermesParser
    check_tool_flags(False, None)
    check_tool_flags(True, "hermes")
    with pytest.raises(ValueError, match="--tool-call-parser: unknown tool-call parser 'nope'; known: hermes"):
        check_tool_flags(False, "nope")
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        check_tool_flags(True, None)


# ---- rendering --------------------------------------------------------------------------------------
def msg(**fields: Any) -> ChatMessage:
    return ChatMessage.model_validate(fields)


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [msg(role="user", content="Weather in Paris and Rome?"),
           msg(role="assistant", content=None, tool_calls=[CALL, {**CALL, "id": "call_2"}]),
           msg(role="tool", tool_call_id="call_1", content="sunny"),
           msg(role="tool", tool_call_id="call_2", content=[{"type": "text", "text": "rainy"}]),
           msg(role="user", content="Thanks")]  # fmt: skip


def test_default_rendering_puts_tools_in_a_system_prompt_and_history_in_hermes_blocks() -> None:
    dicts, tools = template_inputs(HISTORY, [WEATHER], PLAIN_TEMPLATE)
    assert tools is None  # the template cannot render them: they are in the messages
    assert [d["role"] for d in dicts] == ["system", "user", "assistant", "user", "user"]
    system = dicts[0]["content"]
    assert system == tools_section([WEATHER]) and system.startswith("# Tools\n")
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in system
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert dicts[2]["content"] == f"{block}\n{block}"  # exactly what the model wrote: prefix caching holds
    assert parse(dicts[2]["content"])[1] == [("get_weather", '{"city": "Paris"}')] * 2  # and what the parser reads
    assert dicts[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n</tool_response>"


def test_default_rendering_joins_an_existing_system_message_and_says_one_call() -> None:
    dicts, _ = template_inputs([msg(role="system", content="Be brief."), msg(role="user", content="hi")], [WEATHER],
                               PLAIN_TEMPLATE, parallel_tool_calls=False)  # fmt: skip
    assert dicts[0]["content"] == "Be brief.\n\n" + tools_section([WEATHER], False)
    assert dicts[0]["content"].endswith("\nCall at most one function.")


def test_messages_without_tools_render_as_before() -> None:
    messages = [msg(role="system", content="S"), msg(role="user", content="hi", name="bob")]
    for template in (PLAIN_TEMPLATE, "{{ tools }}"):
        dicts, tools = template_inputs(messages, None, template)
        assert dicts == [{"role": "system", "content": "S"}, {"role": "user", "content": "hi", "name": "bob"}]
        assert tools is None


def test_a_template_with_a_tools_section_gets_tools_and_structured_calls(tiny_model_dir: Path) -> None:
    template = ("{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}{% for m in messages %}{{ m.role }}: "
                "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.name }}({{ c.function.arguments.city }})"
                "{% endfor %}{% else %}{{ m.content }}{% endif %}{% if m.tool_call_id %} [{{ m.tool_call_id }}]"
                "{% endif %}{{ '\\n' }}{% endfor %}")  # fmt: skip
    dicts, tools = template_inputs(HISTORY[:3], [WEATHER], template)
    assert tools == [WEATHER] and dicts[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    text = Tokenizer.from_pretrained(tiny_model_dir).apply_chat_template(dicts, tools=tools, chat_template=template)
    assert text == ("TOOL get_weather\nuser: Weather in Paris and Rome?\n"
                    "assistant: get_weather(Paris)get_weather(Paris)\ntool: sunny [call_1]\n")  # fmt: skip


# ---- checks: each a 400 naming the field ---------------------------------------------------------------
BASE: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
TOOLS = {"tools": [WEATHER]}
BAD: list[tuple[str, dict[str, Any], ToolSettings, str, str]] = [
    ("choice-without-tools", {"tool_choice": "required"}, AUTO, "tool_choice", "needs tools"),
    ("auto-without-tools", {"tool_choice": "auto"}, AUTO, "tool_choice", "needs tools"),
    ("named-unknown", {**TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, AUTO,
     "tool_choice.function.name", "'nope' is not one of"),
    ("auto-without-flag", TOOLS, ToolSettings(), "tool_choice", "--enable-auto-tool-choice"),
    ("duplicate-names", {"tools": [WEATHER, WEATHER]}, AUTO, "tools[1].function.name", "defined twice"),
    ("parameters-not-object", {"tools": [{"type": "function", "function": {"name": "f", "parameters":
     {"type": "array"}}}]}, AUTO, "tools[0].function.parameters", "JSON schema of an object"),
    ("tool-without-id", {"messages": [{"role": "tool", "content": "x"}]}, AUTO, "messages[0].tool_call_id",
     "tool_call_id"),
    ("tool-calls-on-user", {"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, AUTO,
     "messages[0].tool_calls", "only assistant"),
    ("required-and-json", {**TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, AUTO,
     "response_format", "cannot be combined"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "settings_", "param", "says"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_inconsistent_tool_fields_are_a_400_naming_the_field(
    body: dict[str, Any], settings_: ToolSettings, param: str, says: str
) -> None:
    req = ChatCompletionRequest.model_validate({**BASE, **body})
    with pytest.raises(APIError) as err:
        check_tools(req, settings_)
    assert err.value.status_code == 400 and err.value.param == param and says in err.value.message


def test_plans_follow_openai_defaults() -> None:
    def plan(body: dict[str, Any], settings_: ToolSettings = AUTO) -> ToolPlan:
        return check_tools(ChatCompletionRequest.model_validate({**BASE, **body}), settings_)

    assert plan({}) == NO_TOOLS
    assert plan({**TOOLS, "tool_choice": "none"}, ToolSettings()) == ToolPlan([WEATHER], None)  # rendered, not parsed
    assert plan(TOOLS).parser is HermesParser  # "auto" by default
    assert plan({**TOOLS, "tool_choice": "required"}, ToolSettings()).parser is HermesParser  # no flag needed
    assert plan({**TOOLS, "parallel_tool_calls": False}).new_parser()._max_calls == 1


# ---- the constraint of required and named choices -------------------------------------------------------
@pytest.fixture(scope="module")
def ll_tokenizer(tiny_model_dir: Path) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer((tiny_model_dir / "tokenizer.json").read_text(), n_vocab=512, eos_token=[2])


def accepts(grammar: str, tokenizer: Tokenizer, lltok: llguidance.LLTokenizer, text: str) -> bool:
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


@pytest.mark.parametrize(
    ("choice", "parallel", "good", "bad"),
    [
        ("required", True, ['{"name": "get_weather", "arguments": {"city": "Rome"}}',
                            '{"name": "get_time", "arguments": {"zone": "UTC"}}'],
         ['{"name": "get_weather", "arguments": {}}']),
        ("required", False, ['{"name": "get_time", "arguments": {}}'], ['{"name": "nope", "arguments": {}}']),
        ({"type": "function", "function": {"name": "get_time"}}, True, ['{"name": "get_time", "arguments": {}}'],
         ['{"name": "get_weather", "arguments": {"city": "Rome"}}']),
    ],
)  # fmt: skip
def test_required_and_named_choices_compile_to_hermes_blocks(
    tiny_model_dir: Path, ll_tokenizer: llguidance.LLTokenizer, choice: Any, parallel: bool, good: list[str],
    bad: list[str],
) -> None:  # fmt: skip
    time = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}}, "strict": True}}  # fmt: skip
    req = ChatCompletionRequest.model_validate({**BASE, "tools": [WEATHER, time], "tool_choice": choice,
                                                "parallel_tool_calls": parallel})  # fmt: skip
    spec = tool_structured_outputs(req)
    assert spec is not None and spec.kind == "grammar" and spec.grammar is not None
    grammar = llguidance.LLMatcher.grammar_from_lark(spec.grammar)
    assert llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer) == ""
    tokenizer = Tokenizer.from_pretrained(tiny_model_dir)
    blocks = [f"<tool_call>\n{call}\n</tool_call>" for call in good]
    assert accepts(spec.grammar, tokenizer, ll_tokenizer, "\n".join(blocks))
    assert parse("\n".join(blocks)) == (None, [(json.loads(c)["name"], json.dumps(json.loads(c)["arguments"]))
                                               for c in good])  # fmt: skip
    for call in bad:
        assert not accepts(spec.grammar, tokenizer, ll_tokenizer, f"<tool_call>\n{call}\n</tool_call>")
    if not parallel or isinstance(choice, dict):  # one call exactly
        assert not accepts(spec.grammar, tokenizer, ll_tokenizer, f"{blocks[0]}\n{blocks[0]}")
    strict = '{"name": "get_time", "arguments": {"zone": "UTC", "extra": 1}}'  # get_time is strict
    assert not accepts(spec.grammar, tokenizer, ll_tokenizer, f"<tool_call>\n{strict}\n</tool_call>")


def test_other_choices_impose_no_constraint() -> None:
    for body in ({}, TOOLS, {**TOOLS, "tool_choice": "none"}, {**TOOLS, "tool_choice": "auto"}):
        assert tool_structured_outputs(ChatCompletionRequest.model_validate({**BASE, **body})) is None


# ---- replies ----------------------------------------------------------------------------------------
def test_tool_chunks_are_what_pydantic_writes() -> None:
    chunks = StreamChunks("id", 1, "m", chat=True)
    logprobs = ChatLogprobs(content=[])
    for delta, wire in [(ToolCallDelta(0, "", "call_x", "f"), DeltaToolCall(index=0, id="call_x", type="function",
                         function=DeltaFunctionCall(name="f", arguments=""))),
                        (ToolCallDelta(1, '{"a": "é"}'), DeltaToolCall(index=1, function=DeltaFunctionCall(
                         arguments='{"a": "é"}')))]:  # fmt: skip
        for args in [(None, None, None), (logprobs, "tool_calls", None), (None, "stop", 7)]:
            expected = ChatChunkChoice(index=2, delta=DeltaMessage(tool_calls=[wire]), logprobs=args[0],
                                       finish_reason=args[1], stop_reason=args[2])  # fmt: skip
            assert tool_call_choice(chunks, 2, delta, *args) == expected.model_dump_json()


def test_without_a_parser_replies_are_as_before() -> None:
    chunks = StreamChunks("id", 1, "m", chat=True)
    events = ToolStream(NO_TOOLS, chunks).events(0, '<tool_call>{"name": "f"}', None, "stop", None)
    assert events == [chunks.event([chunks.chat_choice(0, '<tool_call>{"name": "f"}', None, None, "stop", None)])]
    message, finish = tool_message(ToolPlan([WEATHER], None), "<tool_call>", "stop")
    assert (message.content, message.tool_calls, finish) == ("<tool_call>", None, "stop")
    assert "tool_calls" not in message.model_dump()  # left out, as OpenAI does


def test_stream_events_end_with_tool_calls_and_keep_every_logprob() -> None:
    plan = ToolPlan([WEATHER], HermesParser)
    stream = ToolStream(plan, StreamChunks("id", 1, "m", chat=True))
    logprobs = ChatLogprobs(content=[])
    held = stream.events(0, "<tool_", logprobs)  # all held back: one empty delta carries the logprobs
    assert len(held) == 1 and '"delta":{}' in held[0] and '"logprobs":{"content":[]}' in held[0]
    events = stream.events(0, 'call>{"name": "f", "arguments": {"a": 1}}</tool_call>', None, "stop")
    payloads = [json.loads(e.removeprefix("data: "))["choices"][0] for e in events]
    assert [p["finish_reason"] for p in payloads] == [None, "tool_calls"]
    assert payloads[0]["delta"]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert payloads[1]["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}
    message, finish = tool_message(plan, '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', "length")
    assert message.content is None and message.tool_calls and finish == "length"  # cut short: stays "length"
