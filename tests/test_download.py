"""`tidepool download` against a stub Hub on 127.0.0.1: success, resume, verification, the shared-cache
marker and lock, and the one-line reason (termination message + exit 1) for each failure an admin meets."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
from download_stub import REPO, SHA, StubHub

from tidepool.cli import main as tidepool_main
from tidepool.engine.download import files
from tidepool.engine.download.hub import Hub

FILES = {
    "config.json": b'{"model_type": "llama"}',
    "model.safetensors": bytes(range(256)) * 4096,  # 1 MiB, an LFS file
    "pytorch_model.bin": b"old format, skipped when safetensors exist",
    "sub/tokenizer.json": b'{"version": "1.0"}',
}
LFS = ("model.safetensors", "pytorch_model.bin")


def run(stub: StubHub, tmp_path: Path, *extra: str) -> int:
    log = tmp_path / "termination-log"
    args = ["download", f"hf://{REPO}", "--dest", str(tmp_path / "cache"), "--endpoint", stub.endpoint]
    return tidepool_main([*args, "--termination-log", str(log), "--retries", "0", "--timeout", "5", *extra])


def reason(tmp_path: Path) -> str:
    return (tmp_path / "termination-log").read_text()


@pytest.fixture
def stub():
    with StubHub(dict(FILES), lfs=LFS) as hub:
        yield hub


def test_downloads_verifies_and_marks_complete(stub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_distinctive_token_value")
    assert run(stub, tmp_path) == 0
    dest = tmp_path / "cache"
    assert (dest / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    assert (dest / "sub" / "tokenizer.json").read_bytes() == FILES["sub/tokenizer.json"]
    assert not (dest / "pytorch_model.bin").exists()  # another format's weights are skipped
    assert not list(dest.rglob(f"*{files.PARTIAL}"))
    marker = json.loads((dest / files.MARKER).read_text())
    assert marker["sha"] == SHA and marker["revision"] == "main" and "model.safetensors" in marker["files"]
    assert all(auth == "Bearer hf_distinctive_token_value" for _, _, auth in stub.requests)
    assert all(f"/resolve/{SHA}/" in p for p, _ in stub.file_requests())  # pinned to the resolved commit
    assert not (tmp_path / "termination-log").exists()

    # A second pod on the same cache: the marker says done, the Hub is not asked at all.
    stub.requests.clear()
    stub.status = 500
    assert run(stub, tmp_path) == 0
    assert stub.requests == []


def test_resumes_a_truncated_file_with_a_range_request(stub, tmp_path):
    stub.truncate_once.add("model.safetensors")
    assert run(stub, tmp_path) == 1  # the connection dropped mid-file; no in-process retry here
    part = tmp_path / "cache" / f"model.safetensors{files.PARTIAL}"
    half = part.stat().st_size
    assert 0 < half < len(FILES["model.safetensors"])
    assert "broke during model.safetensors" in reason(tmp_path) and "resumes" in reason(tmp_path)
    stub.requests.clear()
    assert run(stub, tmp_path) == 0
    assert (f"/{REPO}/resolve/{SHA}/model.safetensors", f"bytes={half}-") in stub.file_requests()
    assert (tmp_path / "cache" / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    assert not part.exists()


def test_sha256_mismatch_is_caught_and_the_partial_file_removed(stub, tmp_path):
    stub.wrong_sha.add("model.safetensors")
    assert run(stub, tmp_path) == 1
    assert "model.safetensors: sha256 mismatch" in reason(tmp_path)
    assert not (tmp_path / "cache" / "model.safetensors").exists()
    assert not (tmp_path / "cache" / f"model.safetensors{files.PARTIAL}").exists()
    assert not (tmp_path / "cache" / files.MARKER).exists()


@pytest.mark.parametrize(
    ("status", "secret", "expected"),
    [
        (401, "hf-token", "401 Unauthorized for org/tiny@main at {endpoint}: the token in Secret hf-token key HF_TOKEN "
         "is missing or invalid"),
        (401, None, "set spec.model.credentials.secretName to a Secret with key HF_TOKEN"),
        (403, "hf-token", "403 Forbidden for org/tiny@main: the model is gated or the token may not read it; accept "
         "its licence at {endpoint}/org/tiny with the account of the token in Secret hf-token key HF_TOKEN"),
        (404, None, "404 Not Found for org/tiny@main at {endpoint}: the repository or revision does not exist; "
         "check spec.model.uri and spec.model.revision"),
        (429, None, "429 Too Many Requests"),
    ],
)  # fmt: skip
def test_http_failures_say_what_to_fix(stub, tmp_path, monkeypatch, capsys, status, secret, expected):
    if secret:
        monkeypatch.setenv("TIDEPOOL_CREDENTIALS_SECRET", secret)
        monkeypatch.setenv("HF_TOKEN", "hf_secret_value_never_printed")
    stub.status = status
    assert run(stub, tmp_path) == 1
    message = reason(tmp_path)
    assert expected.format(endpoint=stub.endpoint) in message
    assert "\n" not in message
    err = capsys.readouterr().err
    assert message in err and "hf_secret_value_never_printed" not in err + message


def test_timeout_names_the_endpoint(stub, tmp_path):
    stub.hang()
    try:
        assert run(stub, tmp_path, "--timeout", "0.2") == 1
    finally:
        stub.release()
    assert reason(tmp_path).startswith(f"cannot reach {stub.endpoint}: timed out")


def test_unreachable_endpoint(tmp_path):
    with StubHub({}) as closed:
        endpoint = closed.endpoint
    log = tmp_path / "termination-log"
    code = tidepool_main(
        ["download", f"hf://{REPO}", "--dest", str(tmp_path / "c"), "--endpoint", endpoint, "--retries", "0",
         "--termination-log", str(log)]
    )  # fmt: skip
    assert code == 1 and log.read_text().startswith(f"cannot reach {endpoint}: ConnectError")


def test_a_second_pod_waits_for_the_lock_then_skips(stub, tmp_path, caplog):
    """Two pods on one RWX cache: the second blocks on the lock and, once the first marked it complete, skips."""
    dest = tmp_path / "cache"
    result: list[bool] = []
    caplog.set_level("INFO", logger="tidepool.download")
    with files.cache_lock(dest):  # "the first pod" holds the lock
        worker = threading.Thread(target=lambda: result.append(files.download(Hub(stub.endpoint), REPO, "main", dest)))
        worker.start()
        waited = threading.Event()
        for _ in range(600):
            if any("another pod is downloading" in r.getMessage() for r in caplog.records):
                waited.set()
                break
            worker.join(0.05)
        assert waited.is_set(), "the second download never waited for the lock"
        (dest / files.MARKER).write_text(json.dumps({"repo": REPO, "revision": "main", "sha": SHA}))
    worker.join(30)
    assert result == [False] and stub.requests == []


def test_select_files_keeps_safetensors_only_when_present():
    names = [f.name for f in files.select_files([files.RepoFile(n, 1, None) for n in FILES])]
    assert names == ["config.json", "model.safetensors", "sub/tokenizer.json"]
    only_bin = [files.RepoFile("pytorch_model.bin", 1, None), files.RepoFile("config.json", 1, None)]
    assert files.select_files(only_bin) == only_bin


def test_unsafe_file_names_are_refused(stub, tmp_path):
    stub.files["../escape"] = b"x"
    assert run(stub, tmp_path) == 1
    assert "unsafe file name '../escape'" in reason(tmp_path)
    assert not (tmp_path / "escape").exists()


def test_hash_of_fixture_is_what_the_stub_lists(stub):
    sib = next(s for s in stub.info()["siblings"] if s["rfilename"] == "model.safetensors")
    assert sib["lfs"]["sha256"] == hashlib.sha256(FILES["model.safetensors"]).hexdigest()
