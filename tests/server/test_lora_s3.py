"""s3:// LoRA adapters: the engine's SigV4 signer against `httpx_auth.AWS4Auth`, then fetches from a stub S3.

The signer (engine/download/s3.py) must produce, for the same request at the same instant, exactly the
headers an independent SigV4 implementation users run with httpx produces (httpx_auth's clock is frozen by
replacing the `datetime` its module reads). The stub S3 server below recomputes the expected signature with
httpx_auth for every request it receives, from the request's own host, path and x-amz-date, and answers 403
on any difference, so every fetch in this file is checked as a real S3 would check it. Then a real
`tidepool serve --enable-lora --allow-runtime-lora-updating` loads `s3://bucket/adapters/x` through the
endpoint and its greedy tokens equal peft's; a missing object and bad credentials are 400s naming the object.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import httpx
import httpx_auth
import httpx_auth._aws
import openai
import pytest
from lora.lora_helpers import AdapterSpec, greedy, make_adapter, prompts
from serve_proc import Server, start_server

from tidepool.contract.lora import LORA_DIR_ENV
from tidepool.engine.download.files import MARKER
from tidepool.engine.download.s3 import S3Credentials, S3Store, sign
from tidepool.engine.lora.types import LoRAError
from tidepool.engine.server.lora_fetch import ADAPTER_FILES, local_adapter_folder

AWS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION")
WHEN = dt.datetime(2026, 3, 7, 23, 59, 58, tzinfo=dt.UTC)
_FREEZE = threading.Lock()  # httpx_auth reads the module-global clock: one reference signature at a time


def reference_headers(method: str, url: str, creds: S3Credentials, region: str, when: dt.datetime) -> httpx.Headers:
    """The headers httpx_auth.AWS4Auth adds to `method url` at `when`."""

    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz: dt.tzinfo | None = None) -> dt.datetime:  # type: ignore[override]
            return when

    request = httpx.Request(method, url)
    auth = httpx_auth.AWS4Auth(creds.access_key, creds.secret_key, region, "s3", security_token=creds.session_token)
    with _FREEZE, mock.patch.object(httpx_auth._aws, "datetime", SimpleNamespace(datetime=Frozen, timezone=dt.UTC)):
        return next(auth.auth_flow(request)).headers


SIGNED = ("authorization", "x-amz-date", "x-amz-content-sha256", "x-amz-security-token")
CASES = [
    (S3Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"), "us-east-1",
     "https://examplebucket.s3.us-east-1.amazonaws.com/adapters/x/adapter_config.json"),
    (S3Credentials("AKIA0", "s3cr3t", "FwoGZXIvYXdzE//token+with/slash=="), "eu-west-3",
     "http://127.0.0.1:9000/bucket/adapters/x/adapter_model.safetensors"),
    (S3Credentials("minio", "minio123"), "us-west-2",
     "http://minio.local:9000/bkt/my%20adapters/r%2B8%20%28v2%29/%C3%A9t%C3%A9~x/adapter_config.json"),
    (S3Credentials("K", "S", "tok"), "ap-southeast-1",
     "https://b.s3.ap-southeast-1.amazonaws.com/a/b%3Dc%26d/%21%27%2A/file?versionId=3%2F4&partNumber=1"),
]  # fmt: skip


@pytest.mark.parametrize(("creds", "region", "url"), CASES)
def test_the_signer_matches_httpx_auth(creds: S3Credentials, region: str, url: str) -> None:
    ours = httpx.Request("GET", url)
    sign(ours, creds, region, WHEN)
    theirs = reference_headers("GET", url, creds, region, WHEN)
    for name in SIGNED:
        assert ours.headers.get(name) == theirs.get(name), name
    assert ours.headers["authorization"].startswith(f"AWS4-HMAC-SHA256 Credential={creds.access_key}/20260307/")
    assert ("x-amz-security-token" in ours.headers) == bool(creds.session_token)


def test_urls_are_path_style_with_an_endpoint_and_virtual_hosted_on_aws() -> None:
    aws = S3Store(ADAPTER_FILES, {"AWS_REGION": "eu-west-3"})
    assert aws.url("bucket/a b/x", "adapter_config.json") == (
        "https://bucket.s3.eu-west-3.amazonaws.com/a%20b/x/adapter_config.json"
    )
    minio = S3Store(ADAPTER_FILES, {"AWS_ENDPOINT_URL": "http://minio:9000/"})
    assert minio.url("bucket/x", "adapter_model.safetensors") == "http://minio:9000/bucket/x/adapter_model.safetensors"
    assert minio.auth is None  # no keys: unsigned requests
    aws.close()
    minio.close()
    assert "secret" not in repr(S3Credentials("id", "secret", "token"))


class StubS3:
    """Path-style S3 on 127.0.0.1 holding `objects` ({"bucket/key": bytes}); checks each request's signature."""

    def __init__(self, objects: dict[str, bytes], creds: S3Credentials | None, region: str) -> None:
        self.objects, self.creds, self.region = objects, creds, region
        self.status: int | None = None  # answer every request with it (and a Location), when set
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status)
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(head=True)

            def do_GET(self) -> None:
                self._answer(head=False)

            def _answer(self, head: bool) -> None:
                status, body = stub.check(self.command, self.headers, self.path)
                if stub.status is not None:
                    status, body = stub.status, b"<Error><Code>TemporaryRedirect</Code></Error>"
                if status == 200:
                    rng = self.headers.get("Range")
                    if rng:
                        status, body = 206, body[int(rng.removeprefix("bytes=").rstrip("-")) :]
                stub.requests.append((self.command, self.path, status))
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("ETag", '"stub-etag"')
                if stub.status is not None:
                    self.send_header("Location", f"http://elsewhere.invalid{self.path}")
                self.end_headers()
                if not head:
                    self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def check(self, method: str, headers: Any, path: str) -> tuple[int, bytes]:
        """(status, object bytes or an S3-style error body) for one request."""
        if self.creds is None:
            if "Authorization" in headers:
                return 400, b"<Error><Code>UnexpectedSignature</Code></Error>"
        else:
            when = dt.datetime.strptime(headers.get("x-amz-date", "19700101T000000Z"), "%Y%m%dT%H%M%SZ")
            expected = reference_headers(method, f"http://{headers['Host']}{path}", self.creds, self.region,
                                         when.replace(tzinfo=dt.UTC))  # fmt: skip
            if any(headers.get(h) != expected.get(h) for h in SIGNED):
                return 403, b"<Error><Code>SignatureDoesNotMatch</Code></Error>"
        key = httpx.URL(path).path.lstrip("/")
        if key not in self.objects:
            return 404, b"<Error><Code>NoSuchKey</Code></Error>"
        return 200, self.objects[key]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def env(self, creds: S3Credentials | None = None) -> dict[str, str]:
        """What the operator gives an engine pod: the endpoint, the region and (`creds` or the stub's) keys."""
        creds = creds or self.creds
        env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": self.region}
        if creds is not None:
            env |= {"AWS_ACCESS_KEY_ID": creds.access_key, "AWS_SECRET_ACCESS_KEY": creds.secret_key}
            if creds.session_token:
                env["AWS_SESSION_TOKEN"] = creds.session_token
        return env

    def __enter__(self) -> StubS3:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


KEYS = S3Credentials("AKIASTUB", "stub/secret+key", "session/token==")
SPEC = AdapterSpec(8, ("q_proj", "v_proj", "down_proj"), alpha=16.0)
NUM_NEW = 6
PROMPTS = prompts(11, [5, 19])


@pytest.fixture(scope="module")
def s3_adapter(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[Path, list[list[int]]]:
    """An adapter made with peft, and peft's greedy tokens for PROMPTS."""
    folder = tmp_path_factory.mktemp("s3-adapter") / "x"
    model = make_adapter(tiny_model_dir, folder, SPEC, seed=5)
    return folder, [greedy(model, p, NUM_NEW) for p in PROMPTS]


def objects_of(folder: Path, prefix: str) -> dict[str, bytes]:
    return {f"{prefix}/{name}": (folder / name).read_bytes() for name in ADAPTER_FILES}


@pytest.fixture
def signed_s3(s3_adapter: tuple[Path, list[list[int]]]) -> Iterator[StubS3]:
    objects = objects_of(s3_adapter[0], "bucket/adapters/x") | objects_of(s3_adapter[0], "bucket/a b/r+8 (v2)")
    with StubS3(objects, KEYS, "eu-central-1") as stub:
        yield stub


def use_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], lora_dir: Path) -> None:
    for name in AWS_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in {**env, LORA_DIR_ENV: str(lora_dir)}.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("prefix", ["adapters/x", "a b/r+8 (v2)"])
def test_a_signed_fetch_lands_in_the_lora_dir_once(
    signed_s3: StubS3, s3_adapter: tuple[Path, list[list[int]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    prefix: str,
) -> None:  # fmt: skip
    use_env(monkeypatch, signed_s3.env(), tmp_path)
    folder = local_adapter_folder(f"s3://bucket/{prefix}")
    assert folder == str(tmp_path / "s3" / "bucket" / prefix)
    for name in ADAPTER_FILES:
        assert (Path(folder) / name).read_bytes() == (s3_adapter[0] / name).read_bytes()
    assert (Path(folder) / MARKER).exists() and not list(Path(folder).glob("*.incomplete"))
    assert {status for _, _, status in signed_s3.requests} == {200}
    seen = len(signed_s3.requests)
    assert local_adapter_folder(f"s3://bucket/{prefix}/") == folder  # the marker: no request at all
    assert len(signed_s3.requests) == seen


def test_a_public_bucket_is_read_unsigned(
    s3_adapter: tuple[Path, list[list[int]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with StubS3(objects_of(s3_adapter[0], "public/x"), None, "us-east-1") as stub:
        use_env(monkeypatch, stub.env(), tmp_path)
        folder = local_adapter_folder("s3://public/x")
    assert (Path(folder) / "adapter_config.json").exists()


@pytest.mark.parametrize(
    ("uri", "creds", "words"),
    [
        ("s3://bucket/adapters/missing", None, ["404", "s3://bucket/adapters/missing/adapter_config.json"]),
        ("s3://bucket/adapters/x", S3Credentials("AKIASTUB", "badsecret"), ["403", "s3://bucket/adapters/x/adapter_"]),
        ("s3://bucket/adapters/x", S3Credentials("AKIASTUB", KEYS.secret_key), ["403", "AWS_SESSION_TOKEN"]),
        ("s3://bucket/../etc", None, ["s3://bucket/prefix"]),
    ],
)
def test_failures_are_400s_naming_the_object(
    signed_s3: StubS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uri: str, creds: S3Credentials | None,
    words: list[str],
) -> None:  # fmt: skip
    use_env(monkeypatch, signed_s3.env(creds), tmp_path)
    with pytest.raises(LoRAError) as err:
        local_adapter_folder(uri)
    assert err.value.param == "lora_path"
    for word in words:
        assert word in str(err.value)
    assert "stub/secret" not in str(err.value) and "badsecret" not in str(err.value)


def test_a_bucket_in_another_region_is_named_not_followed(
    signed_s3: StubS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    signed_s3.status = 307  # S3's answer to a request sent to the wrong region's endpoint
    use_env(monkeypatch, signed_s3.env(), tmp_path)
    with pytest.raises(LoRAError, match=r"307 .*s3://bucket/adapters/x/adapter_config\.json.*AWS_REGION"):
        local_adapter_folder("s3://bucket/adapters/x")
    assert [status for _, _, status in signed_s3.requests] == [307]  # the unsigned hop was never sent


def test_one_key_without_the_other_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_env(monkeypatch, {"AWS_ACCESS_KEY_ID": "AKIA"}, tmp_path)
    with pytest.raises(LoRAError, match="AWS_SECRET_ACCESS_KEY is not set"):
        local_adapter_folder("s3://bucket/x")


def test_a_server_loads_an_s3_adapter_through_the_endpoint(
    signed_s3: StubS3, s3_adapter: tuple[Path, list[list[int]]], tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:  # fmt: skip
    lora_dir = tmp_path_factory.mktemp("s3-lora-cache")
    flags = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--allow-runtime-lora-updating"]
    with pytest.MonkeyPatch.context() as env:
        use_env(env, signed_s3.env(), lora_dir)
        server = start_server(tiny_model_dir, tmp_path_factory.mktemp("s3-logs"), *flags)
    try:
        check_server(server, signed_s3, s3_adapter[1], lora_dir)
    finally:
        server.stop()


def check_server(server: Server, stub: StubS3, expected: list[list[int]], lora_dir: Path) -> None:
    def load(name: str, path: str) -> httpx.Response:
        body = {"lora_name": name, "lora_path": path}
        return httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=120)

    reply = load("x", "s3://bucket/adapters/x")
    assert reply.status_code == 200, reply.text
    client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)
    roots = {m.id: m.root for m in client.models.list().data}
    assert roots["x"] == str(lora_dir / "s3" / "bucket" / "adapters" / "x")
    for prompt, tokens in zip(PROMPTS, expected, strict=True):
        extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
        resp = client.completions.create(
            model="x", prompt=prompt, max_tokens=NUM_NEW, temperature=0, logprobs=0, extra_body=extra
        )
        assert [int(t.removeprefix("token_id:")) for t in resp.choices[0].logprobs.tokens] == tokens
    reply = load("missing", "s3://bucket/adapters/missing")
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "lora_path" and "404" in error["message"]
    assert "s3://bucket/adapters/missing/adapter_config.json" in error["message"]
    stub.creds = S3Credentials(KEYS.access_key, "rotated", KEYS.session_token)  # the server's keys are now wrong
    reply = load("denied", "s3://bucket/a b/r+8 (v2)")
    assert reply.status_code == 400 and "403" in reply.json()["error"]["message"], reply.text
    assert "s3://bucket/a b/r+8 (v2)/adapter_config.json" in reply.json()["error"]["message"]
    assert client.completions.create(model="x", prompt=PROMPTS[0], max_tokens=1).choices  # still serving
