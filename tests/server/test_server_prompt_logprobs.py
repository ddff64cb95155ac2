"""Prompt logprobs through the real HTTP server (issue #36): lm-eval's `echo` + `logprobs` + `max_tokens: 0`.

The response's shape is OpenAI's legacy completions logprobs over the prompt (first token null)
then the generated tokens; the values equal the engine's own prompt logprobs for the same weights.
vLLM's `prompt_logprobs` extension is checked on completions and chat. Refusals are in
test_server_errors.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from serve_proc import Server

from tidepool.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time there was a little fox"


@pytest.fixture(scope="module")
def reference_llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), show_progress=False)


def _engine_logprobs(reference_llm: LLM, prompt: str | list[int]) -> tuple[list[int], list[float]]:
    [out] = reference_llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)
    ids = out.prompt_token_ids
    assert out.prompt_logprobs is not None
    return ids, [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]  # type: ignore[index]


def test_echo_logprobs_max_tokens_zero(client: openai.OpenAI, server: Server, reference_llm: LLM) -> None:
    resp = client.completions.create(model=server.model, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    [choice] = resp.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 0
    ids, expected = _engine_logprobs(reference_llm, PROMPT)
    lp = choice.logprobs
    assert lp is not None and len(lp.tokens) == len(ids) == resp.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert sum(lp.token_logprobs[1:]) == pytest.approx(sum(expected), abs=1e-3)
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert len(top) == 1 and max(top.values()) >= value  # the top 1, as for generated tokens
        if token in top:
            assert top[token] == pytest.approx(value)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_echo_logprobs_token_ids_with_generation(client: openai.OpenAI, server: Server, reference_llm: LLM) -> None:
    """lm-eval sends token ids; with n=2 every choice echoes the prompt, then its own generated tokens."""
    prompt = [5, 17, 99, 230, 41, 8]
    resp = client.completions.create(model=server.model, prompt=prompt, echo=True, logprobs=2, max_tokens=3, n=2,
                                     temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    _, expected = _engine_logprobs(reference_llm, prompt)
    assert len(resp.choices) == 2
    for choice in resp.choices:
        lp = choice.logprobs
        assert lp is not None and len(lp.tokens) == len(prompt) + 3
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1 : len(prompt)] == pytest.approx(expected, abs=1e-4)
        assert all(isinstance(v, float) and math.isfinite(v) for v in lp.token_logprobs[1:])
        assert all(len(top) == 2 for top in lp.top_logprobs[1:])
        generated_text = choice.text[lp.text_offset[len(prompt)] :]
        assert choice.text.endswith(generated_text) and lp.text_offset[len(prompt)] <= len(choice.text)


def _post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(server.url + path, json={"model": server.model, **body}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_vllm_prompt_logprobs_completions(server: Server, reference_llm: LLM) -> None:
    body = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 3})
    [choice] = body["choices"]
    ids, expected = _engine_logprobs(reference_llm, PROMPT)
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        token = str(ids[position])
        assert entry[token]["logprob"] == pytest.approx(expected[position - 1], abs=1e-4)
        assert next(iter(entry)) == token  # the prompt token first, as vLLM
        others = {v["rank"] for t, v in entry.items() if t != token}
        assert others | {entry[token]["rank"]} >= {1, 2, 3} and others <= {1, 2, 3}  # the top 3, and the prompt token
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())
    assert choice["logprobs"] is None  # the legacy field only with logprobs


def test_vllm_prompt_logprobs_chat_and_absent(server: Server) -> None:
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    body = _post(server, "/v1/chat/completions", {**chat, "prompt_logprobs": 0})
    entries = body["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == body["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 and next(iter(entry.values()))["rank"] >= 1 for entry in entries[1:])
    assert "prompt_logprobs" not in _post(server, "/v1/chat/completions", chat)["choices"][0]


def test_echo_max_tokens_zero_streams_the_prompt(client: openai.OpenAI, server: Server) -> None:
    """Echo without logprobs streams as before; max_tokens 0 ends the choice right after the prompt."""
    chunks = list(client.completions.create(model=server.model, prompt=PROMPT, echo=True, max_tokens=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
