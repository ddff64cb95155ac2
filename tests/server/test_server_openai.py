"""The server through the official `openai` client: sync and async, streaming and not, chat and completions."""

from __future__ import annotations

import asyncio

import openai
import pytest
from serve_proc import Server

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def aclient(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)


def test_models(client: openai.OpenAI, server: Server) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]


def test_completion(client: openai.OpenAI, server: Server) -> None:
    resp = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    assert resp.object == "text_completion" and len(resp.choices) == 1
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert resp.usage is not None and resp.usage.completion_tokens == 8 and resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8


def test_completion_stream_equals_non_stream(client: openai.OpenAI, server: Server) -> None:
    args = dict(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat(client: openai.OpenAI, server: Server) -> None:
    resp = client.chat.completions.create(model=server.model, messages=MESSAGES, max_completion_tokens=6,
                                          temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 6


def test_chat_stream_equals_non_stream(client: openai.OpenAI, server: Server) -> None:
    args = dict(model=server.model, messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**args)
    stream = client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


@pytest.mark.parametrize("path", ["completions", "chat"])
def test_continuous_usage_stats_count_each_choice(client: openai.OpenAI, server: Server, path: str) -> None:
    """vLLM's `stream_options.continuous_usage_stats`: every chunk carries its choice's usage so far."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    common = dict(model=server.model, max_tokens=10, temperature=1.0, seed=3, n=2, stream=True,
                  stream_options=options, extra_body={"ignore_eos": True})  # fmt: skip
    if path == "chat":
        chunks = list(client.chat.completions.create(messages=MESSAGES, **common))
    else:
        chunks = list(client.completions.create(prompt=PROMPT, **common))
    assert all(c.usage is not None for c in chunks)
    counts: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        counts[choice.index].append(chunk.usage.completion_tokens)
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
    for seen in counts.values():
        assert seen == sorted(seen) and seen[-1] == 10  # grows with the choice's tokens, ends at max_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20  # the final one: both choices


def test_n2_seeded(client: openai.OpenAI, server: Server) -> None:
    args = dict(model=server.model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=2,
                extra_body={"ignore_eos": True})  # fmt: skip
    first = client.completions.create(**args)
    second = client.completions.create(**args)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]  # seeded: reproducible
    assert first.choices[0].text != first.choices[1].text  # seed, seed+1: different samples
    assert first.usage.completion_tokens == 16


def test_n2_chat_stream(client: openai.OpenAI, server: Server) -> None:
    chunks = list(client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=5, n=2, seed=1,
                                                 stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}


def test_stop_string(client: openai.OpenAI, server: Server) -> None:
    args = dict(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**args).choices[0].text
    stop = text[8:11]
    assert len(stop) == 3 and stop.strip(), f"need a usable stop string in {text!r}"
    expected = text[: text.index(stop)]
    cut = client.completions.create(**args, stop=[stop])
    assert cut.choices[0].text == expected
    assert cut.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(**args, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client: openai.OpenAI, server: Server) -> None:
    resp = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == resp.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and len(top) <= 3
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the chosen token is the most likely
        assert token in top
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_chat_logprobs_stream(client: openai.OpenAI, server: Server) -> None:
    args = dict(model=server.model, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                extra_body={"ignore_eos": True})  # fmt: skip
    full = client.chat.completions.create(**args)
    content = full.choices[0].logprobs.content
    assert len(content) == 6 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) for entry in content)
    streamed = [e for c in client.chat.completions.create(**args, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]  # fmt: skip
    assert [e.token for e in streamed] == [e.token for e in content]


def test_echo(client: openai.OpenAI, server: Server) -> None:
    resp = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert resp.choices[0].text.startswith(PROMPT)


def test_token_id_prompts_batch(client: openai.OpenAI, server: Server) -> None:
    resp = client.completions.create(model=server.model, prompt=[[5, 6, 7], [8, 9]], max_tokens=4, n=2,
                                     temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    assert resp.usage.prompt_tokens == 5 and resp.usage.completion_tokens == 16


def test_async_client_concurrent(aclient: openai.AsyncOpenAI, server: Server) -> None:
    async def one(i: int) -> tuple[str, str]:
        kwargs = dict(model=server.model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        full = await aclient.chat.completions.create(messages=[{"role": "user", "content": f"hi {i}"}], **kwargs)
        text = ""
        async for chunk in await aclient.chat.completions.create(
            messages=[{"role": "user", "content": f"hi {i}"}], stream=True, **kwargs
        ):
            text += chunk.choices[0].delta.content or ""
        return full.choices[0].message.content, text

    async def main() -> list[tuple[str, str]]:
        return await asyncio.gather(*(one(i) for i in range(6)))

    for full, streamed in asyncio.run(main()):
        assert full == streamed
    server.wait_pool_free()


# ---- OpenAI/vLLM parity (issue #14, item 7) ---------------------------------------------------------
def test_completion_logprobs_have_k_distinct_entries(client: openai.OpenAI, server: Server) -> None:
    # The tiny model's byte-level vocabulary has many partial-UTF-8 tokens that all decode to U+FFFD:
    # keyed by text they would overwrite each other; keyed collision-free there are always k entries.
    for seed in (1, 2, 3):
        resp = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=40, temperature=1.0, seed=seed,
                                         logprobs=5, extra_body={"ignore_eos": True})  # fmt: skip
        lp = resp.choices[0].logprobs
        assert lp is not None and len(lp.top_logprobs) == 40
        assert all(len(top) == 5 for top in lp.top_logprobs), [len(top) for top in lp.top_logprobs]
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert token not in top or top[token] == pytest.approx(logprob)
    as_ids = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                       extra_body={"return_tokens_as_token_ids": True})  # fmt: skip
    lp = as_ids.choices[0].logprobs
    assert all(t.startswith("token_id:") for t in lp.tokens)
    assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top)


def test_chat_logprob_bytes_rebuild_the_content(client: openai.OpenAI, server: Server) -> None:
    for seed in (1, 2, 3):
        resp = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=40, temperature=1.0,
                                              seed=seed, logprobs=True, top_logprobs=3,
                                              extra_body={"ignore_eos": True})  # fmt: skip
        content = resp.choices[0].logprobs.content
        raw = b"".join(bytes(entry.bytes) for entry in content)
        assert raw.decode("utf-8", "replace") == resp.choices[0].message.content
        assert all(top.bytes is not None for entry in content for top in entry.top_logprobs)


def test_logit_bias_steers_sampling(client: openai.OpenAI, server: Server) -> None:
    args = dict(model=server.model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})  # fmt: skip
    forced = client.completions.create(**args, logit_bias={"5": 100})  # token 5 is "!" in the tiny vocabulary
    assert forced.choices[0].logprobs.tokens == ["token_id:5"] * 6
    first = client.completions.create(**args).choices[0].logprobs.tokens[0]
    banned = client.completions.create(**args, logit_bias={first.removeprefix("token_id:"): -100})
    assert banned.choices[0].logprobs.tokens[0] != first  # the greedy first token is pushed out


@pytest.mark.parametrize("temperature", [1e-39, 5e-324, 1e-6])
def test_tiny_temperature_is_greedy(client: openai.OpenAI, server: Server, temperature: float) -> None:
    args = dict(model=server.model, prompt=PROMPT, max_tokens=12, extra_body={"ignore_eos": True})
    greedy = client.completions.create(**args, temperature=0).choices[0].text
    assert client.completions.create(**args, temperature=temperature).choices[0].text == greedy
