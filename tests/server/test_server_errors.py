"""Malformed and out-of-range requests: the right status, OpenAI's error shape, the parameter named; server stays up."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from serve_proc import Server

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_CHAT: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OK_COMPLETION: dict[str, Any] = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def _raw(base: dict[str, Any], **fields: Any) -> bytes:
    """A body as Python's JSON writes it: NaN/Infinity literals, lone surrogates as \\uXXXX escapes."""
    return json.dumps({**base, **fields}).encode()


def _schema(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}


# (name, path, body (a dict merged into a valid request, or raw bytes), status, param named in the error)
CASES: list[tuple[str, str, dict[str, Any] | bytes, int, str | None]] = [
    ("invalid-json", COMPLETIONS, b'{"prompt": "hi",', 400, None),
    ("missing-prompt", COMPLETIONS, {"prompt": None}, 400, "prompt"),
    ("temperature-type", COMPLETIONS, {"temperature": "hot"}, 400, "temperature"),
    ("temperature-range", COMPLETIONS, {"temperature": 2.5}, 400, "temperature"),
    ("top_p-zero", COMPLETIONS, {"top_p": 0}, 400, "top_p"),
    ("top_p-range", CHAT, {"top_p": 1.5}, 400, "top_p"),
    ("top_k-range", COMPLETIONS, {"top_k": -2}, 400, "top_k"),
    ("min_p-range", COMPLETIONS, {"min_p": 2}, 400, "min_p"),
    ("max_tokens-zero", COMPLETIONS, {"max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens-type", COMPLETIONS, {"max_tokens": "ten"}, 400, "max_tokens"),
    ("max_completion_tokens-zero", CHAT, {"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("n-zero", COMPLETIONS, {"n": 0}, 400, "n"),
    ("logprobs-range", COMPLETIONS, {"logprobs": 21}, 400, "logprobs"),
    ("top_logprobs-range", CHAT, {"logprobs": True, "top_logprobs": 25}, 400, "top_logprobs"),
    ("top_logprobs-without-logprobs", CHAT, {"top_logprobs": 2}, 400, "top_logprobs"),
    ("presence_penalty-range", COMPLETIONS, {"presence_penalty": 3}, 400, "presence_penalty"),
    ("frequency_penalty-range", CHAT, {"frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ("seed-type", COMPLETIONS, {"seed": "abc"}, 400, "seed"),
    ("stop-type", COMPLETIONS, {"stop": [1, 2]}, 400, "stop"),
    ("stop-empty-string", COMPLETIONS, {"stop": [""]}, 400, "stop"),
    ("stream-type", COMPLETIONS, {"stream": "yes"}, 400, "stream"),
    ("stream_options-without-stream", COMPLETIONS, {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("min_tokens-over-max", COMPLETIONS, {"min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ("min_tokens-over-room", CHAT, {"min_tokens": 2000, "max_tokens": None}, 400, "min_tokens"),
    # Prompt logprobs (issue #36): echo with logprobs and max_tokens 0 are scoring; not in streams.
    ("echo-logprobs-stream", COMPLETIONS, {"echo": True, "logprobs": 1, "stream": True}, 400, "echo"),
    ("max_tokens0-stream", COMPLETIONS, {"echo": True, "max_tokens": 0, "logprobs": 0, "stream": True}, 400, "echo"),
    ("prompt_logprobs-stream", CHAT, {"prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("prompt_logprobs-range", COMPLETIONS, {"prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("prompt_logprobs-negative", CHAT, {"prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("max_tokens-negative-echo", COMPLETIONS, {"echo": True, "max_tokens": -1}, 400, "max_tokens"),
    ("prompt-empty-list", COMPLETIONS, {"prompt": []}, 400, "prompt"),
    ("prompt-token-out-of-vocab", COMPLETIONS, {"prompt": [5, 999999]}, 400, "prompt"),
    ("prompt-float-token", COMPLETIONS, {"prompt": [1.5]}, 400, "prompt"),
    ("prompt-bool-token", COMPLETIONS, {"prompt": [True]}, 400, "prompt"),
    ("prompt-mixed-list", COMPLETIONS, {"prompt": [5, "a"]}, 400, "prompt"),
    ("prompt-mixed-batch", COMPLETIONS, {"prompt": [[5], 6]}, 400, "prompt"),
    ("prompt-empty-in-batch", COMPLETIONS, {"prompt": [[5], []]}, 400, "prompt"),
    ("prompt-token-2^70", COMPLETIONS, {"prompt": [5, 2**70]}, 400, "prompt"),
    ("context-too-long", COMPLETIONS, {"max_tokens": 5000}, 400, "prompt"),
    ("messages-missing", CHAT, {"messages": None}, 400, "messages"),
    ("messages-empty", CHAT, {"messages": []}, 400, "messages"),
    ("messages-bad-role", CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ("unknown-model", CHAT, {"model": "gpt-17"}, 404, "model"),
    # Values the engine cannot take are bounded at the edge (issue #14, item 1): never a dead engine.
    ("seed-2^64", COMPLETIONS, {"seed": 2**64}, 400, "seed"),
    ("seed-2^64-1", COMPLETIONS, {"seed": 2**64 - 1, "n": 2}, 400, "seed"),
    ("seed-below-int64", COMPLETIONS, {"seed": -(2**63) - 1}, 400, "seed"),
    ("seed-2^64-chat-stream", CHAT, {"seed": 2**64, "stream": True}, 400, "seed"),
    ("top_k-2^63", COMPLETIONS, {"top_k": 2**63}, 400, "top_k"),
    ("max_tokens-2^70", COMPLETIONS, {"max_tokens": 2**70}, 400, "max_tokens"),
    ("min_tokens-2^64", COMPLETIONS, {"min_tokens": 2**64}, 400, "min_tokens"),
    ("stop_token_ids-2^64", COMPLETIONS, {"stop_token_ids": [2**64]}, 400, "stop_token_ids"),
    ("repetition_penalty-tiny", COMPLETIONS, {"repetition_penalty": 5e-324}, 400, "repetition_penalty"),
    ("repetition_penalty-huge", COMPLETIONS, {"repetition_penalty": 1e308}, 400, "repetition_penalty"),
    ("temperature-nan", COMPLETIONS, _raw(OK_COMPLETION, temperature=math.nan), 400, "temperature"),
    ("top_p-infinity", COMPLETIONS, _raw(OK_COMPLETION, top_p=math.inf), 400, "top_p"),
    ("stop-too-many", COMPLETIONS, {"stop": ["x"] * 65}, 400, "stop"),
    ("stop-too-long", COMPLETIONS, {"stop": "x" * 1025}, 400, "stop"),
    # Strings must be proper Unicode (item 2): an unpaired surrogate is a 400 naming where it is.
    ("surrogate-prompt", COMPLETIONS, _raw(OK_COMPLETION, prompt="\ud800"), 400, "prompt"),
    ("surrogate-prompt-list", COMPLETIONS, _raw(OK_COMPLETION, prompt=["ok", "a\udc00"]), 400, "prompt[1]"),
    ("surrogate-stream", COMPLETIONS, _raw(OK_COMPLETION, prompt="\ud800", stream=True), 400, "prompt"),
    (
        "surrogate-chat",
        CHAT,
        _raw(OK_CHAT, messages=[{"role": "user", "content": "\ud800"}]),
        400,
        "messages[0].content",
    ),
    (
        "surrogate-content-part",
        CHAT,
        _raw(OK_CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": "x\udfff"}]}]),
        400,
        "messages[0].content[0].text",
    ),
    ("surrogate-stop", COMPLETIONS, _raw(OK_COMPLETION, stop=["\ud800"]), 400, "stop"),
    (
        "surrogate-name",
        CHAT,
        _raw(OK_CHAT, messages=[{"role": "user", "content": "hi", "name": "\ud83d"}]),
        400,
        "messages[0].name",
    ),
    ("surrogate-model", COMPLETIONS, _raw(OK_COMPLETION, model="\ud800"), 400, "model"),
    (
        "surrogate-kv-params",
        COMPLETIONS,
        _raw(OK_COMPLETION, kv_transfer_params={"transfer_id": "\ud800"}),
        400,
        "kv_transfer_params.transfer_id",
    ),
    # OpenAI/vLLM parameters are honoured or refused, never silently ignored (item 7).
    ("response_format-bogus", CHAT, {"response_format": {"type": "bogus"}}, 400, "response_format.type"),
    # Structured outputs: each bad constraint is a 400 naming the field, before anything is queued.
    ("json_schema-missing", CHAT, {"response_format": {"type": "json_schema"}}, 400, "response_format.json_schema"),
    (
        "json_schema-name",
        CHAT,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
        400,
        "response_format.json_schema.name",
    ),
    ("json_schema-bad-type", CHAT, _schema({"type": "strnig"}), 400, "response_format.json_schema.schema"),
    (
        "json_schema-ref-cycle",
        CHAT,
        _schema({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
        400,
        "response_format.json_schema.schema",
    ),
    ("json_schema-missing-ref", CHAT, _schema({"$ref": "#/$defs/nowhere"}), 400, "response_format.json_schema.schema"),
    (
        "json_schema-bad-pattern",
        CHAT,
        _schema({"type": "string", "pattern": "(("}),
        400,
        "response_format.json_schema.schema",
    ),
    ("json_schema-not-object", CHAT, _schema([1, 2]), 400, "response_format.json_schema.schema"),
    ("json_schema-false", CHAT, _schema(False), 400, "response_format.json_schema.schema"),
    ("structured-regex", COMPLETIONS, {"structured_outputs": {"regex": "[a-"}}, 400, "structured_outputs.regex"),
    (
        "structured-grammar",
        COMPLETIONS,
        {"structured_outputs": {"grammar": "start: nowhere"}},
        400,
        "structured_outputs.grammar",
    ),
    (
        "structured-unknown-key",
        COMPLETIONS,
        {"structured_outputs": {"whitespace_pattern": " "}},
        400,
        "structured_outputs.whitespace_pattern",
    ),
    (
        "structured-two-kinds",
        COMPLETIONS,
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        400,
        "structured_outputs",
    ),
    ("structured-empty-choice", COMPLETIONS, {"structured_outputs": {"choice": []}}, 400, "structured_outputs.choice"),
    (
        "structured-and-response_format",
        CHAT,
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        400,
        "structured_outputs",
    ),
    # tool_choice "auto" (the default with tools) needs --enable-auto-tool-choice (test_server_tools.py: the rest)
    ("tools", CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ("tool_choice", CHAT, {"tool_choice": "required"}, 400, "tool_choice"),
    ("functions", CHAT, {"functions": [{"name": "f"}]}, 400, "functions"),
    ("logit_bias-range", COMPLETIONS, {"logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit_bias-out-of-vocab", COMPLETIONS, {"logit_bias": {"512": 1}}, 400, "logit_bias"),
    ("logit_bias-not-an-id", COMPLETIONS, {"logit_bias": {"hello": 1}}, 400, "logit_bias"),
    ("suffix", COMPLETIONS, {"suffix": "end"}, 400, "suffix"),
]


def _post(server: Server, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    base = OK_CHAT if path == CHAT else OK_COMPLETION
    merged = {k: v for k, v in {**base, **body}.items() if v is not None}
    return httpx.post(server.url + path, json=merged, timeout=30)


def _check_shape(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error


@pytest.mark.parametrize(("name", "path", "body", "status", "param"), CASES, ids=[c[0] for c in CASES])
def test_bad_request(server: Server, name: str, path: str, body: Any, status: int, param: str | None) -> None:
    resp = _post(server, path, body)
    assert resp.status_code == status, resp.text
    error = _check_shape(resp)
    if param is None:
        assert error["param"] is None
    else:
        assert error["param"] == param or str(error["param"]).startswith((param + "[", param + ".")), error


def test_context_length_message(server: Server) -> None:
    resp = _post(server, COMPLETIONS, {"prompt": [5] * 1000, "max_tokens": 100})
    error = _check_shape(resp)
    assert resp.status_code == 400 and error["code"] == "context_length_exceeded"
    assert "1024" in error["message"] and "1100" in error["message"] and "1000" in error["message"]


def test_min_tokens_over_the_context_names_only_what_the_client_sent(server: Server) -> None:
    """Without max_tokens, a min_tokens past the room left is the client's number, not a derived max_tokens."""
    resp = _post(server, COMPLETIONS, _raw(OK_COMPLETION, prompt=[5] * 24, min_tokens=1500, max_tokens=None))
    error = _check_shape(resp)
    assert resp.status_code == 400 and error["param"] == "min_tokens", error
    assert "1500" in error["message"] and "1000" in error["message"] and "max_tokens" not in error["message"], error
    # Completions default max_tokens to 16 when it is not sent at all: the message says it is that default.
    default = _post(server, COMPLETIONS, {"min_tokens": 20, "max_tokens": None})
    error = _check_shape(default)
    assert default.status_code == 400 and error["param"] == "min_tokens", error
    assert "16, the completions default" in error["message"], error
    # A max_tokens the client did send is named by the field it came in.
    for field in ("max_tokens", "max_completion_tokens"):
        sent = _post(server, CHAT, {"min_tokens": 5, field: 2})
        error = _check_shape(sent)
        assert sent.status_code == 400 and error["param"] == "min_tokens", error
        assert f"exceeds {field} (2)" in error["message"] and "default" not in error["message"], error


# Bodies json.loads refuses for reasons other than syntax (FastAPI alone says "There was an error parsing the body").
UNPARSABLE: list[tuple[str, bytes, str]] = [
    ("invalid-utf8", b'{"model": "tiny", "prompt": "caf\xe9", "max_tokens": 2}', "byte 32"),
    ("deep-nesting", b'{"model": "tiny", "prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "too deeply"),
    ("5000-digit-number", b'{"model": "tiny", "prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "digits"),
]


@pytest.mark.parametrize(("name", "body", "says"), UNPARSABLE, ids=[c[0] for c in UNPARSABLE])
def test_unparsable_body_says_why(server: Server, name: str, body: bytes, says: str) -> None:
    resp = _post(server, COMPLETIONS, body)
    assert resp.status_code == 400, resp.text
    error = _check_shape(resp)
    assert says in error["message"] and "error parsing the body" not in error["message"], error


def test_compressed_body_is_refused_by_name(server: Server) -> None:
    import gzip

    body = gzip.compress(json.dumps(OK_COMPLETION).encode())
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    resp = httpx.post(server.url + COMPLETIONS, content=body, headers=headers, timeout=30)
    assert resp.status_code == 415 and resp.headers["accept-encoding"] == "identity", resp.text
    error = _check_shape(resp)
    assert "'gzip'" in error["message"] and error["code"] == "unsupported_content_encoding", error
    identity = httpx.post(server.url + COMPLETIONS, json=OK_COMPLETION, headers={"content-encoding": "identity"},
                          timeout=30)  # fmt: skip
    assert identity.status_code == 200, identity.text


def test_unknown_route_is_openai_shaped(server: Server) -> None:
    resp = httpx.get(server.url + "/v1/nothing-here", timeout=10)
    assert resp.status_code == 404
    _check_shape(resp)


def test_still_healthy_after_errors(server: Server) -> None:
    for _, path, body, _, _ in CASES:
        _post(server, path, body)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/ready", timeout=10).status_code == 200
    ok = _post(server, COMPLETIONS, {})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    server.wait_pool_free()


def test_serve_cli_rejects_missing_model(tmp_path: Any) -> None:
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("tidepool")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "tidepool.cli"]
    proc = subprocess.run([*cmd, "serve", "--model", str(tmp_path / "absent")], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_health_answers_while_a_10mb_prompt_is_processed(server: Server) -> None:
    """Issue #14 item 3: a huge prompt never stalls the event loop (before: /health blocked for 16 s)."""
    import threading
    import time

    text = "lorem ipsum " * (10_000_000 // 12)
    bodies = {
        COMPLETIONS: {"model": "tiny", "prompt": text, "max_tokens": 1},
        CHAT: {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 1},
    }
    results: dict[str, httpx.Response] = {}

    def send() -> None:
        for path, body in bodies.items():
            results[path] = httpx.post(server.url + path, json=body, timeout=300)

    sender = threading.Thread(target=send)
    sender.start()
    latencies = []
    with httpx.Client(timeout=30) as http:
        while sender.is_alive() or len(latencies) < 3:
            start = time.monotonic()
            assert http.get(server.url + "/health").status_code == 200
            latencies.append(time.monotonic() - start)
    sender.join()
    # The stall this guards against was 16 s; 5 s keeps that signal and leaves a busy 2-core machine room for
    # one scheduling hiccup (its own client is encoding and sending 10 MB meanwhile).
    assert max(latencies) < 5.0, latencies
    for path in bodies:
        error = _check_shape(results[path])
        assert results[path].status_code == 400 and error["code"] == "context_length_exceeded", error
