"""`tidepool serve` reaches /ready without importing what only optional features use (issue #43).

Role: the start path's import budget. A real `tidepool serve` process (the tiny model) is started
in a fresh interpreter; at the moment /ready first answers 200, the test reads which of the
deferred modules that process has imported (none may be), then uses each feature in the same
process and checks its module arrives then (so the deferral is to first use, not a removal).

Invariants checked:
- every deferred module exists in this environment (a name missing from the venv would make the
  "not imported" check vacuous);
- at /ready: no deferred module in `sys.modules`;
- after a chat completion: jinja2 (the chat template's renderer);
- after `tidepool.common.api_key.ApiKeyAuth` is looked up: httpx (the router's client auth);
- after `lora_admin.read_adapter` on a local folder: `lora_fetch` (adapter sources: hf://, s3://);
- the `gguf` package is only imported to open a GGUF file (the model here is a safetensors folder).
No timings are asserted: the machine may be loaded; only module sets are.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# What a server start must not import, with the feature that imports it on first use.
DEFERRED = {
    "jinja2": "the first chat-template render (engine/tokenizer.py)",
    "httpx": "ApiKeyAuth, the router's client auth (common/api_key_auth.py); adapter fetches (lora_fetch)",
    "tidepool.common.api_key_auth": "ApiKeyAuth (common/api_key.py's lazy attribute)",
    "tidepool.engine.server.lora_fetch": "the first adapter load (engine/server/lora_admin.py)",
    "tidepool.engine.download.hub": "the first adapter load from hf:// (lora_fetch)",
    "gguf": "opening a GGUF file (engine/loading/formats.py); the model served here is a folder",
}

# The child: `tidepool serve MODEL --port PORT`, and a thread that waits for /ready, records the deferred modules
# present, uses each feature in turn, records again, writes the record to OUT and ends the process.
_CHILD = r"""
import json, os, sys, threading, urllib.request
port, model, out, deferred = int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
base = f"http://127.0.0.1:{port}"

def present():
    return sorted(name for name in deferred if name in sys.modules)

def watch():
    record = {}
    try:
        while True:
            try:
                if urllib.request.urlopen(base + "/ready", timeout=5).status == 200:
                    break
            except Exception:
                threading.Event().wait(0.05)
        record["ready"] = present()
        body = json.dumps({"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
        request = urllib.request.Request(base + "/v1/chat/completions", body.encode(),
                                         {"Content-Type": "application/json"})
        record["chat_status"] = urllib.request.urlopen(request, timeout=120).status
        record["after_chat"] = present()
        from tidepool.common.api_key import ApiKeyAuth
        record["auth_is_httpx_auth"] = issubclass(ApiKeyAuth, sys.modules["httpx"].Auth)
        record["after_auth"] = present()
        from tidepool.engine.server import lora_admin
        record["adapter"] = lora_admin.read_adapter(lambda name, folder: folder, "a", model)
        record["after_adapter"] = present()
    except BaseException as err:
        record["error"] = repr(err)
    with open(out, "w") as f:
        json.dump(record, f)
    os._exit(0)

threading.Thread(target=watch, daemon=True).start()
from tidepool.cli import main
sys.exit(main(["serve", model, "--port", str(port), "--served-model-name", model]))
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("name", sorted(DEFERRED))
def test_deferred_module_exists_in_this_environment(name: str) -> None:
    assert importlib.util.find_spec(name) is not None, f"{name} is not importable here: the test would be vacuous"


def test_serve_start_imports_no_optional_module_until_used(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "record.json"
    model = str(tiny_model_dir)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(_free_port()), model, str(out), json.dumps(sorted(DEFERRED))],
        cwd="/tmp",  # the repository's operator/ folder must not shadow the stdlib
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.exists(), f"the server never reached /ready (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    record = json.loads(out.read_text())
    assert "error" not in record, f"{record['error']}\n{proc.stderr[-4000:]}"
    leaked = {name: DEFERRED[name] for name in record["ready"]}
    assert not leaked, f"imported before /ready, though only needed at first use: {leaked}"
    assert record["chat_status"] == 200
    assert "jinja2" in record["after_chat"], "a chat completion rendered no template?"
    assert "httpx" not in record["after_chat"]
    assert record["auth_is_httpx_auth"], "ApiKeyAuth must still be an httpx.Auth"
    assert {"httpx", "tidepool.common.api_key_auth"} <= set(record["after_auth"])
    assert "tidepool.engine.server.lora_fetch" in record["after_adapter"]
    assert record["adapter"] == model, "a folder path is read where it is (lora_fetch returns it unchanged)"
