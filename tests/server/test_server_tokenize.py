"""vLLM's `/tokenize` and `/detokenize` on a real server, against transformers' tokenizer of the same model folder.

A prompt's tokens must be transformers' encoding of it; a chat's must be what the chat completion
of the same messages feeds the engine (its `usage.prompt_tokens`, and transformers' rendering of
the chat template encoded without special tokens); `/detokenize` must round-trip. Bad input gets a
400 naming the field (404 for an unknown model, as the completion endpoints). The gate answers
these routes 503 while loading or draining and counts them in flight, as it does `/v1/` calls:
checked in-process, no model needed.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_proc import Server

from tidepool.engine.engine_config import EngineConfig
from tidepool.engine.server.app import build_app
from tidepool.engine.server.gate import RequestGate
from tidepool.engine.server.prompts import longest_token_chars
from tidepool.engine.server.state import ServerConfig, ServerState
from tidepool.engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\r\n",
    "unicode: café, 東京, emoji 🎉 and a ZWJ family 👨‍👩‍👧",
    "<|im_start|>user\nhi<|im_end|> and <s> </s> inside text",
]
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Tell me a story."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello. 東京?"},
        {"role": "user", "content": "Yes, tell me about it."},
    ],
]


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


def post(server: Server, path: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()


def rendered(hf: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def test_a_prompt_is_tokenized_as_transformers_does(server: Server, hf: Any) -> None:
    max_model_len = httpx.get(server.api + "/models", timeout=10).json()["data"][0]["max_model_len"]
    for text in TEXTS:
        default = ok(post(server, "/tokenize", {"model": server.model, "prompt": text}))
        assert default == {"count": len(default["tokens"]), "max_model_len": max_model_len,
                           "tokens": hf(text)["input_ids"], "token_strs": None}  # fmt: skip
        for add_special_tokens in (True, False):
            got = ok(post(server, "/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens}))
            assert got["tokens"] == hf(text, add_special_tokens=add_special_tokens)["input_ids"], text
            assert got["count"] == len(got["tokens"])
    # The tiny tokenizer's post-processor adds BOS: the flag is honoured, not ignored.
    assert ok(post(server, "/tokenize", {"prompt": "hi"}))["tokens"][0] == hf.bos_token_id


def test_return_token_strs_gives_the_tokens_vocabulary_strings(server: Server, hf: Any) -> None:
    for text in TEXTS:
        got = ok(post(server, "/tokenize", {"prompt": text, "return_token_strs": True}))
        assert got["token_strs"] == hf.convert_ids_to_tokens(got["tokens"]), text
    chat = ok(post(server, "/tokenize", {"messages": CHATS[0], "return_token_strs": True}))
    assert chat["token_strs"] == hf.convert_ids_to_tokens(chat["tokens"])


def test_a_chat_is_tokenized_as_the_chat_completion_feeds_the_engine(server: Server, hf: Any) -> None:
    for messages in CHATS:
        got = ok(post(server, "/tokenize", {"model": server.model, "messages": messages}))
        text = rendered(hf, messages, add_generation_prompt=True)
        assert got["tokens"] == hf(text, add_special_tokens=False)["input_ids"]
        completion = ok(post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}))
        assert got["count"] == len(got["tokens"]) == completion["usage"]["prompt_tokens"]
        without = ok(post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}))
        assert without["tokens"] == hf(rendered(hf, messages, False), add_special_tokens=False)["input_ids"]
        completion = ok(post(server, "/v1/chat/completions",
                             {"messages": messages, "max_tokens": 1, "add_generation_prompt": False}))  # fmt: skip
        assert without["count"] == completion["usage"]["prompt_tokens"] < got["count"]
        special = ok(post(server, "/tokenize", {"messages": messages, "add_special_tokens": True}))
        assert special["tokens"] == hf(text)["input_ids"] == [hf.bos_token_id, *got["tokens"]]
    # Text parts are joined as the chat path joins them.
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    got = ok(post(server, "/tokenize", {"messages": parts}))
    joined = rendered(hf, [{"role": "user", "content": "one\ntwo"}], add_generation_prompt=True)
    assert got["tokens"] == hf(joined, add_special_tokens=False)["input_ids"]
    completion = ok(post(server, "/v1/chat/completions", {"messages": parts, "max_tokens": 1}))
    assert got["count"] == completion["usage"]["prompt_tokens"]


def test_detokenize_round_trips_and_spells_out_special_tokens(server: Server, hf: Any) -> None:
    for text in TEXTS:
        tokens = ok(post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}))["tokens"]
        assert ok(post(server, "/detokenize", {"model": server.model, "tokens": tokens})) == {"prompt": text}
    for messages in CHATS:
        tokens = ok(post(server, "/tokenize", {"messages": messages}))["tokens"]
        assert ok(post(server, "/detokenize", {"tokens": tokens}))["prompt"] == rendered(hf, messages, True)
    with_bos = ok(post(server, "/tokenize", {"prompt": "hi"}))["tokens"]
    assert ok(post(server, "/detokenize", {"tokens": with_bos}))["prompt"] == hf.decode(with_bos)
    assert ok(post(server, "/detokenize", {"tokens": []})) == {"prompt": ""}
    assert ok(post(server, "/detokenize", {"tokens": [len(hf) - 1]}))["prompt"] == hf.decode([len(hf) - 1])


def test_continue_final_message_and_template_kwargs_render_as_transformers_does(server: Server, hf: Any) -> None:
    """vLLM's rendering extensions: the prompt ends inside the assistant's message (transformers'
    `continue_final_message`), and `chat_template_kwargs` reach the template as variables."""
    messages = [*USER, {"role": "assistant", "content": "The answer is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    got = ok(post(server, "/tokenize", body))
    text = hf.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("The answer is") and got["tokens"] == hf(text, add_special_tokens=False)["input_ids"]
    completion = ok(post(server, "/v1/chat/completions", {**body, "max_tokens": 2}))
    assert completion["usage"]["prompt_tokens"] == got["count"]
    kwargs = {"messages": USER, "chat_template_kwargs": {"enable_thinking": False, "custom": [1, 2]}}
    with_kwargs = ok(post(server, "/tokenize", kwargs))
    text = hf.apply_chat_template(
        USER, tokenize=False, add_generation_prompt=True, enable_thinking=False, custom=[1, 2]
    )
    assert with_kwargs["tokens"] == hf(text, add_special_tokens=False)["input_ids"]
    assert ok(post(server, "/v1/chat/completions", {**kwargs, "max_tokens": 1}))["usage"]["prompt_tokens"] == len(
        with_kwargs["tokens"]
    )


def test_unknown_fields_are_ignored_and_nulls_are_no_value(server: Server, hf: Any) -> None:
    want = hf("hi")["input_ids"]
    assert ok(post(server, "/tokenize", {"prompt": "hi", "messages": None, "extra_field": 1}))["tokens"] == want
    chat = ok(post(server, "/tokenize", {"messages": CHATS[0], "prompt": None, "continue_final_message": False}))
    assert chat == ok(post(server, "/tokenize", {"messages": CHATS[0]}))


USER = [{"role": "user", "content": "hi"}]
CONTENT, CONTINUE, TEMPLATE_KWARGS = "messages[0].content", "continue_final_message", "chat_template_kwargs"
# (name, path, body: JSON or raw bytes, status, the parameter the error names)
CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("neither-prompt-nor-messages", "/tokenize", {"model": "tiny"}, 400, "prompt"),
    ("both-prompt-and-messages", "/tokenize", {"prompt": "hi", "messages": USER}, 400, "messages"),
    ("prompt-not-a-string", "/tokenize", {"prompt": ["hi"]}, 400, "prompt"),
    ("prompt-token-ids", "/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
    ("messages-empty", "/tokenize", {"messages": []}, 400, "messages"),
    ("messages-bad-role", "/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ("add_special_tokens-int", "/tokenize", {"prompt": "hi", "add_special_tokens": 1}, 400, "add_special_tokens"),
    ("return_token_strs-str", "/tokenize", {"prompt": "hi", "return_token_strs": "yes"}, 400, "return_token_strs"),
    ("surrogate-prompt", "/tokenize", b'{"prompt": "a\\ud800"}', 400, "prompt"),
    ("surrogate-chat", "/tokenize", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, CONTENT),
    # What vLLM takes but this server cannot honour is refused, never ignored (chat_render.py).
    (
        "continue_final_message-and-generation-prompt",
        "/tokenize",
        {"messages": USER, "continue_final_message": True},
        400,
        CONTINUE,
    ),
    (
        "continue_final_message-after-user",
        "/tokenize",
        {"messages": USER, "continue_final_message": True, "add_generation_prompt": False},
        400,
        CONTINUE,
    ),
    ("chat_template", "/tokenize", {"messages": USER, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    (
        "chat_template_kwargs-reserved",
        "/tokenize",
        {"messages": USER, "chat_template_kwargs": {"messages": []}},
        400,
        f"{TEMPLATE_KWARGS}.messages",
    ),
    (
        "mm_processor_kwargs",
        "/tokenize",
        {"messages": USER, "mm_processor_kwargs": {"fps": 1}},
        400,
        "mm_processor_kwargs",
    ),
    ("tools-no-function", "/tokenize", {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    ("tool-without-id", "/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
    ("unknown-model-prompt", "/tokenize", {"model": "gpt-17", "prompt": "hi"}, 404, "model"),
    ("unknown-model-chat", "/tokenize", {"model": "gpt-17", "messages": USER}, 404, "model"),
    ("body-not-an-object", "/tokenize", [1, 2], 400, None),
    ("invalid-json", "/tokenize", b'{"prompt": "hi",', 400, None),
    ("tokens-missing", "/detokenize", {"model": "tiny"}, 400, "tokens"),
    ("tokens-not-a-list", "/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("tokens-negative", "/detokenize", {"tokens": [5, -1]}, 400, "tokens"),
    ("tokens-huge", "/detokenize", {"tokens": [2**70]}, 400, "tokens"),
    ("tokens-int64-max", "/detokenize", {"tokens": [2**63 - 1]}, 400, "tokens"),
    ("tokens-string", "/detokenize", {"tokens": [5, "6"]}, 400, "tokens"),
    ("tokens-float", "/detokenize", {"tokens": [5.0]}, 400, "tokens"),
    ("tokens-bool", "/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("tokens-null", "/detokenize", {"tokens": [None]}, 400, "tokens"),
    ("tokens-nested", "/detokenize", {"tokens": [[5]]}, 400, "tokens"),
    ("unknown-model-detokenize", "/detokenize", {"model": "gpt-17", "tokens": [5]}, 404, "model"),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "param"), CASES, ids=[c[0] for c in CASES])
def test_bad_request(server: Server, name: str, path: str, body: Any, status: int, param: str | None) -> None:
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    if status == 404:  # the completion endpoints' rule and answer
        assert error["code"] == "model_not_found"
    assert error["message"]


def test_out_of_vocabulary_ids_are_refused_not_dropped(server: Server, hf: Any) -> None:
    response = post(server, "/detokenize", {"tokens": [5, len(hf)]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tokens"
    assert f"[0, {len(hf)})" in response.json()["error"]["message"] and "item 1" in response.json()["error"]["message"]


def test_a_text_over_the_character_cap_is_refused_without_tokenizing(server: Server, tiny_model_dir: Path) -> None:
    max_model_len = httpx.get(server.api + "/models", timeout=10).json()["data"][0]["max_model_len"]
    cap = 4 * max_model_len * longest_token_chars(Tokenizer.from_pretrained(tiny_model_dir))  # prompts.py's bound
    for body, param in (({"prompt": "x" * (cap + 1)}, "prompt"),
                        ({"messages": [{"role": "user", "content": "x" * (cap + 1)}]}, "messages")):  # fmt: skip
        response = post(server, "/tokenize", body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, "context_length_exceeded"), error
    # Within the cap a text is tokenized even past the context, as vLLM: the count says how far past.
    got = ok(post(server, "/tokenize", {"prompt": "x " * (max_model_len + 1)}))
    assert got["count"] > got["max_model_len"] == max_model_len


# ---- the gate, in-process: no model is loaded (the app's lifespan never runs) ------------------------------


def test_tokenizer_routes_answer_503_while_loading_or_draining() -> None:
    from fastapi.testclient import TestClient

    app = build_app(ServerConfig(EngineConfig(model="never-loaded"), "tiny"))
    client = TestClient(app)  # not entered: the lifespan (which loads the model) never runs
    for reason in ("loading", "draining"):
        app.state.tidepool.is_draining = reason == "draining"
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
            response = client.post(path, json=body)
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == reason


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/completions"])
def test_the_gate_counts_tokenizer_calls_in_flight(path: str) -> None:
    state = ServerState(ServerConfig(EngineConfig(model="never-loaded"), "tiny"))
    state.serving = object()  # type: ignore[assignment]  # ready: the gate only asks whether it is set
    seen: list[tuple[int, bytes]] = []
    sent: list[dict[str, Any]] = []

    async def api(scope: Any, receive: Any, send: Any) -> None:
        seen.append((state.num_inflight, (await receive())["body"]))

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b'{"prompt": "hi"}', "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    asyncio.run(RequestGate(api, state)(scope, receive, send))  # type: ignore[arg-type]
    assert seen == [(1, b'{"prompt": "hi"}')] and not sent
    assert (state.num_inflight, state.num_receiving) == (0, 0)
    state.is_draining = True  # a new call is refused, never reaching the route
    asyncio.run(RequestGate(api, state)(scope, receive, send))  # type: ignore[arg-type]
    assert len(seen) == 1 and sent[0]["status"] == 503
