"""Malformed and out-of-range requests: the right status, OpenAI's error shape, the parameter named; server stays up."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from serve_proc import Server

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_CHAT: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OK_COMPLETION: dict[str, Any] = {"model": "tiny", "prompt": "hi", "max_tokens": 2}

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
    ("echo-with-logprobs", COMPLETIONS, {"echo": True, "logprobs": 1}, 400, "echo"),
    ("prompt-empty-list", COMPLETIONS, {"prompt": []}, 400, "prompt"),
    ("prompt-token-out-of-vocab", COMPLETIONS, {"prompt": [5, 999999]}, 400, "prompt"),
    ("context-too-long", COMPLETIONS, {"max_tokens": 5000}, 400, "prompt"),
    ("messages-missing", CHAT, {"messages": None}, 400, "messages"),
    ("messages-empty", CHAT, {"messages": []}, 400, "messages"),
    ("messages-bad-role", CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ("unknown-model", CHAT, {"model": "gpt-17"}, 404, "model"),
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
