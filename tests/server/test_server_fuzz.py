"""Hostile but honest clients: hypothesis over the request schema against a live server (issue #14).

Every case merges nasty values (integer extremes, NaN/infinity as Python's JSON writes them,
subnormal and huge floats, unpaired surrogates, a 10 MB string, wrong types, unknown fields)
into a small valid request, streamed or not, and posts it. No case may get a 5xx, every 4xx must
be OpenAI-shaped, every 200 stream must end with `[DONE]`; and after every case a normal greedy
request must still get 200 with exactly the tokens it got before the fuzzing: the engine was not
disturbed. Derandomized, so a run is reproducible; the examples pin the cases the issue names.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from serve_proc import MODEL_NAME, Server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

TEN_MB = "lorem ipsum " * (10_000_000 // 12)
INTS = [0, 1, 2, 4, -1, 2**31 - 1, 2**31, -(2**31), 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64,
        -(2**64), 2**70, -(2**70)]  # fmt: skip
FLOATS = [0.0, -0.0, 5e-324, -5e-324, 1e-39, 1e-6, 0.5, 1.0, 2.0, 1e308, -1e308, math.nan, math.inf, -math.inf]
STRINGS = ["", "a", "hello world", "\ud800", "a\udfffb", "\udbff", "😀", "\x00", "<|im_end|>", "</s>", TEN_MB]
FIELDS = ["model", "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "stop", "stop_token_ids", "stream", "stream_options", "ignore_eos",
          "min_tokens", "skip_special_tokens", "include_stop_str_in_output", "return_tokens_as_token_ids",
          "response_format", "user", "max_tokens", "kv_transfer_params", "echo", "logprobs", "suffix",
          "max_completion_tokens", "top_logprobs", "add_generation_prompt", "tools", "tool_choice", "best_of",
          "prompt_logprobs", "frobnicate"]  # fmt: skip

scalars = st.one_of(st.sampled_from(INTS), st.sampled_from(FLOATS), st.sampled_from(STRINGS), st.booleans(),
                    st.none())  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(STRINGS), inner, max_size=3)),
    max_leaves=8,
)
# Limits that keep a *valid* case short (chat without max_tokens would generate to the context length).
lengths = st.sampled_from([1, 2, 4, 0, -1, 2**31, 2**64, 2**70, 1.5, math.nan, "4"])
token_lists = st.lists(st.sampled_from([5, 6, 7, *INTS]), min_size=0, max_size=4)
prompts = st.one_of(
    scalars, st.lists(st.sampled_from(STRINGS), max_size=3), token_lists, st.lists(token_lists, max_size=3)
)
contents = st.one_of(scalars, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "\ud800"]),
                                                               "text": scalars}), max_size=2))  # fmt: skip
messages = st.one_of(
    values,
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot", "\ud800"]),
                                    "content": contents}, optional={"name": scalars}), max_size=3),
)  # fmt: skip
overrides = st.dictionaries(st.sampled_from(FIELDS), values, max_size=5)

BASELINE = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip


@pytest.fixture(scope="module")
def fuzz_server(serve: Callable[..., Server]) -> Server:
    return serve()


def _baseline(server: Server) -> list[str]:
    resp = httpx.post(server.api + "/completions", json=BASELINE, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["logprobs"]["tokens"]


@pytest.fixture(scope="module")
def expected_tokens(fuzz_server: Server) -> list[str]:
    return _baseline(fuzz_server)


def _check(server: Server, expected: list[str], path: str, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()  # Python's JSON writes NaN/Infinity and escapes lone surrogates
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=300) as http, http.stream("POST", server.url + path, content=payload,
                                                         headers=headers) as resp:  # fmt: skip
        raw = resp.read()
    assert resp.status_code < 500, (resp.status_code, raw[:500], {k: str(v)[:80] for k, v in body.items()})
    if resp.status_code >= 400:
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    elif resp.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", events[-3:]
        assert not any('"error"' in e and "engine_dead" in e for e in events), events
    assert _baseline(server) == expected  # the engine is alive and undisturbed


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])  # fmt: skip
@given(prompt=prompts, extra=overrides, limit=lengths)
@example(prompt="hi", extra={"seed": 2**64}, limit=2)
@example(prompt="hi", extra={"seed": 2**64 - 1, "n": 2}, limit=2)
@example(prompt="hi", extra={"seed": -(2**63) - 1, "stream": True}, limit=2)
@example(prompt="hi", extra={"top_k": 2**63}, limit=2)
@example(prompt="hi", extra={"temperature": 5e-324}, limit=4)
@example(prompt="\ud800", extra={}, limit=2)
@example(prompt=["ok", "\udc00"], extra={"stream": True}, limit=2)
@example(prompt=TEN_MB, extra={}, limit=2)
@example(prompt=[[5, 2**70]], extra={}, limit=2)
@example(prompt="hi", extra={"temperature": math.nan, "top_p": math.inf}, limit=2)
def test_completions_fuzz(
    fuzz_server: Server, expected_tokens: list[str], prompt: Any, extra: dict, limit: Any
) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt, **extra, "max_tokens": limit}  # a valid case stays short
    _check(fuzz_server, expected_tokens, "/v1/completions", body)


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])  # fmt: skip
@given(msgs=messages, extra=overrides, limit=lengths)
@example(msgs=[{"role": "user", "content": "\ud800"}], extra={"stream": True}, limit=2)
@example(msgs=[{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}], extra={}, limit=2)
@example(msgs=[{"role": "user", "content": TEN_MB}], extra={}, limit=2)
@example(msgs=[{"role": "user", "content": "hi"}], extra={"seed": 2**64, "stream": True}, limit=2)
@example(msgs=[{"role": "user", "content": "hi"}], extra={"response_format": {"type": "bogus"}}, limit=2)
def test_chat_fuzz(fuzz_server: Server, expected_tokens: list[str], msgs: Any, extra: dict, limit: Any) -> None:
    # max_completion_tokens wins over max_tokens: a valid case stays short whatever else was drawn.
    body = {"model": MODEL_NAME, "messages": msgs, **extra, "max_completion_tokens": limit}
    _check(fuzz_server, expected_tokens, "/v1/chat/completions", body)
