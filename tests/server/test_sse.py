"""The streamed chunks built by sse.StreamChunks are byte-for-byte what pydantic's models give.

The models (protocol.py) stay the reference: each generated chunk is compared with
`model_dump_json()` of the same `CompletionResponse` / `ChatCompletionChunk`, on text that
covers every Unicode plane, control characters, quotes and backslashes, with and without
logprobs, finish and stop reasons and usage.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from tidepool.engine.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from tidepool.engine.server.sse import StreamChunks

# Any code point but lone surrogates (they cannot be sent as UTF-8 at all).
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
FINISH = st.sampled_from([None, "stop", "length", "abort"])
STOP = st.one_of(st.none(), TEXT, st.integers(0, 200_000))
COUNT = st.integers(0, 9999)
USAGE = st.one_of(st.none(), st.builds(Usage, prompt_tokens=COUNT, completion_tokens=COUNT, total_tokens=COUNT))
LOGPROB = st.floats(-50, 0, allow_nan=False)
COMPLETION_LOGPROBS = st.one_of(
    st.none(),
    st.builds(CompletionLogprobs, tokens=st.lists(TEXT, max_size=3), token_logprobs=st.lists(LOGPROB, max_size=3),
              top_logprobs=st.lists(st.dictionaries(TEXT, LOGPROB, max_size=2), max_size=3),
              text_offset=st.lists(st.integers(0, 99), max_size=3)),
)  # fmt: skip
TOP = st.builds(TopLogprob, token=TEXT, logprob=LOGPROB, bytes=st.one_of(st.none(), st.lists(st.integers(0, 255))))
CHAT_LOGPROBS = st.one_of(
    st.none(),
    st.builds(ChatLogprobs, content=st.lists(st.builds(TokenLogprob, token=TEXT, logprob=LOGPROB,
                                                        top_logprobs=st.lists(TOP, max_size=2)), max_size=2)),
)  # fmt: skip


def event(body: BaseModel) -> str:
    """The reference: the `data:` line pydantic's own JSON of the whole chunk makes."""
    return f"data: {body.model_dump_json()}\n\n"


IDS = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=20)


@settings(max_examples=300, deadline=None)
@given(rid=IDS, created=st.integers(0, 2**40), model=IDS, index=st.integers(0, 99), text=TEXT, finish=FINISH,
       stop=STOP, logprobs=COMPLETION_LOGPROBS, usage=USAGE)  # fmt: skip
def test_completion_chunks_equal_pydantic(rid, created, model, index, text, finish, stop, logprobs, usage) -> None:
    chunks = StreamChunks(rid, created, model, chat=False)
    choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish, stop_reason=stop)
    expected = event(CompletionResponse(id=rid, created=created, model=model, choices=[choice], usage=usage))
    built = chunks.event([chunks.completion_choice(index, text, logprobs, finish, stop)], usage)
    assert built == expected
    assert json.loads(built.removeprefix("data: "))["choices"][0]["text"] == text
    empty = event(CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage))
    assert chunks.event([], usage) == empty


@settings(max_examples=300, deadline=None)
@given(rid=IDS, created=st.integers(0, 2**40), model=IDS, index=st.integers(0, 99),
       content=st.one_of(st.none(), TEXT), role=st.sampled_from([None, "assistant"]), finish=FINISH, stop=STOP,
       logprobs=CHAT_LOGPROBS, usage=USAGE)  # fmt: skip
def test_chat_chunks_equal_pydantic(rid, created, model, index, content, role, finish, stop, logprobs, usage) -> None:
    chunks = StreamChunks(rid, created, model, chat=True)
    choice = ChatChunkChoice(index=index, delta=DeltaMessage(role=role, content=content), logprobs=logprobs,
                             finish_reason=finish, stop_reason=stop)  # fmt: skip
    expected = event(ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice], usage=usage))
    built = chunks.event([chunks.chat_choice(index, content, role, logprobs, finish, stop)], usage)
    assert built == expected
    empty = event(ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=usage))
    assert chunks.event([], usage) == empty


def test_several_choices_in_one_chunk() -> None:
    chunks = StreamChunks("cmpl-1", 7, "m", chat=False)
    choices = [CompletionChoice(index=i, text=t) for i, t in enumerate(["a", 'b"\n'])]
    expected = event(CompletionResponse(id="cmpl-1", created=7, model="m", choices=choices))
    assert chunks.event([chunks.completion_choice(i, t) for i, t in enumerate(["a", 'b"\n'])]) == expected
