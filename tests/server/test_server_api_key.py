"""`tidepool serve --api-key / --api-key-file` on a real server, driven by the official `openai` client.

One server holds a key from the flag and one from a key file, with $TIDEPOOL_API_KEY set to a third key
that must not count (the environment is read only when neither flag is given) and runtime LoRA
updating on (its admin endpoints need the key too). A wrong or missing key gets OpenAI's 401; the
probes, /metrics and /version stay open; a rotated key file is followed without a restart.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from serve_proc import MODEL_NAME, Server

from tidepool.common.api_key import ENV_VAR

FLAG_KEY, FILE_KEY, ENV_KEY = "sk-from-flag", "sk-from-file", "sk-from-env"


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-key"
    path.write_text(f"# mounted from a Secret\n{FILE_KEY}\n")
    return path


@pytest.fixture(scope="module")
def keyed(serve: Callable[..., Server], key_file: Path) -> Iterator[Server]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV_VAR, ENV_KEY)  # given to the server process only
        server = serve("--api-key", FLAG_KEY, "--api-key-file", str(key_file), "--enable-lora",
                       "--allow-runtime-lora-updating")  # fmt: skip
    yield server


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key=key, max_retries=0, timeout=60)


def test_wrong_or_missing_key_gets_openais_401(keyed: Server) -> None:
    for key in ("sk-wrong", ENV_KEY):
        wrong = client(keyed, key)
        with pytest.raises(openai.AuthenticationError) as err:
            wrong.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=2)
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
        assert err.value.body == {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                                  "param": None, "code": "invalid_api_key"}  # fmt: skip
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    missing = httpx.post(f"{keyed.api}/completions", json={"model": MODEL_NAME, "prompt": "hi"}, timeout=10)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"]["code"] == "invalid_api_key"
    # A large body is read and dropped before the answer, so the client gets its 401 rather than a reset.
    big = httpx.post(f"{keyed.api}/completions", content=b"x" * (3 << 20), timeout=30,
                     headers={"Authorization": "Bearer sk-wrong", "Content-Type": "application/json"})  # fmt: skip
    assert big.status_code == 401


def test_a_right_key_is_served(keyed: Server) -> None:
    answer = client(keyed, FLAG_KEY).completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3)
    assert answer.usage is not None and answer.usage.completion_tokens == 3
    stream = client(keyed, FILE_KEY).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    )
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
    by_header = httpx.post(f"{keyed.api}/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
                           headers={"x-api-key": FILE_KEY}, timeout=30)  # fmt: skip
    assert by_header.status_code == 200 and by_header.json()["usage"]["completion_tokens"] == 2
    assert [m.id for m in client(keyed, FLAG_KEY).models.list()] == [MODEL_NAME]


def test_probes_and_metrics_are_open_and_everything_else_is_not(keyed: Server) -> None:
    for path in ("/health", "/ready", "/metrics", "/version"):
        assert httpx.get(f"{keyed.url}{path}", timeout=10).status_code == 200, path
    guarded = [("GET", "/debug/kv", None), ("POST", "/tokenize", {"prompt": "a"}),
               ("POST", "/detokenize", {"tokens": [1]}), ("GET", "/openapi.json", None),
               ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}),
               ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"})]  # fmt: skip
    for method, path, body in guarded:
        refused = httpx.request(method, f"{keyed.url}{path}", json=body, timeout=10)
        assert refused.status_code == 401, path
        allowed = httpx.request(method, f"{keyed.url}{path}", json=body, timeout=30,
                                headers={"Authorization": f"Bearer {FLAG_KEY}"})  # fmt: skip
        assert allowed.status_code != 401, (path, allowed.text)
    unload = httpx.post(f"{keyed.api}/unload_lora_adapter", json={"lora_name": "x"}, timeout=10,
                        headers={"Authorization": f"Bearer {FILE_KEY}"})  # fmt: skip
    assert unload.status_code == 404  # past the key check: the adapter is unknown


def test_a_rotated_key_file_is_followed(keyed: Server, key_file: Path) -> None:
    rotate(key_file, "sk-rotated\n")
    deadline_s = 30.0

    def accepts(key: str) -> bool:
        return httpx.get(f"{keyed.api}/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).is_success

    wait_until(lambda: accepts("sk-rotated"), deadline_s)
    assert not accepts(FILE_KEY)
    assert accepts(FLAG_KEY)  # the flag's keys stay
    rotate(key_file, f"{FILE_KEY}\n")  # as the other tests' server had it
    wait_until(lambda: accepts(FILE_KEY), deadline_s)


def rotate(path: Path, text: str) -> None:
    """Replace the file by a new one moved into place, as the kubelet rotates a mounted Secret."""
    fresh = path.with_name(path.name + ".new")
    fresh.write_text(text)
    os.replace(fresh, path)


def wait_until(predicate: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not true after {timeout_s} s"
        time.sleep(0.1)
