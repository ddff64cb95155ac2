"""`tidepool serve` takes every model form `LLM(...)` takes, through the real CLI and a real server.

A .gguf file, a folder holding exactly one .gguf, and a catalogue name (the real SmolLM2, pulled
into the machine's model cache through `tidepool pull`'s code); a name that is none of these exits
2 at once with the message `LLM(...)` gives, before any port is bound or model loaded.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from serve_proc import MODEL_NAME, start_server


def _complete(url: str, model: str = MODEL_NAME) -> dict:
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_serve_a_gguf_file(gguf_model: Callable[[str, str], Path], tmp_path: Path) -> None:
    path = gguf_model("llama-gqa", "F32")
    server = start_server(path, tmp_path)
    try:
        assert _complete(server.url)["usage"]["completion_tokens"] == 4
    finally:
        assert server.stop() == 0


def test_serve_a_folder_holding_one_gguf(gguf_model: Callable[[str, str], Path], tmp_path: Path) -> None:
    folder = tmp_path / "one-gguf"
    folder.mkdir()
    shutil.copy(gguf_model("llama-gqa", "F32"), folder / "model.gguf")
    server = start_server(folder, tmp_path)
    try:
        assert _complete(server.url)["usage"]["completion_tokens"] == 4
    finally:
        assert server.stop() == 0


@pytest.mark.slow
def test_serve_a_catalogue_name(real_gguf: Path, tmp_path: Path) -> None:
    # `real_gguf` put the file in the model cache; the name resolves to it as `LLM("smollm2-135m-instruct")` does.
    server = start_server(Path("smollm2-135m-instruct"), tmp_path)
    try:
        body = _complete(server.url)
        assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["text"]
        models = httpx.get(f"{server.url}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("model", ["no-such-model", "./absent-folder"])
def test_serve_refuses_what_is_no_model(model: str, tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("tidepool")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "tidepool.cli"]
    proc = subprocess.run([*cmd, "serve", "--model", model, "--port", "1"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert f"model {model} does not exist" in proc.stderr and "smollm2-135m-instruct" in proc.stderr
