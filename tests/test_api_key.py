"""API keys (tidepool.common.api_key): where keys come from, key-file rotation, what a request presents,
the middleware's 401 and its open paths, the client-side auth; and the router's drain counter (common.graceful).

The rotation tests drive the re-read interval with a fake clock and replace the file the way the kubelet
rotates a mounted Secret (a new file moved into place), so nothing here waits on the wall clock.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tidepool.common.api_key import (
    ENV_VAR,
    OPEN_PATHS,
    ApiKeyAuth,
    ApiKeyError,
    ApiKeyMiddleware,
    ApiKeys,
    presented_keys,
)
from tidepool.common.graceful import Drain
from tidepool.contract import serve_flags


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def rotate(path: Path, text: str) -> None:
    """Replace the file by a new one moved into place (a new inode), as a Secret volume's symlink swap does."""
    fresh = path.with_name(path.name + ".new")
    fresh.write_text(text)
    os.replace(fresh, path)


def test_keys_from_flags_file_and_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# the service's keys\n\n  file-1  \nfile-2\n")
    keys = ApiKeys.from_flags(["flag-1"], str(key_file), environ={ENV_VAR: "env-1"})
    assert keys is not None
    assert [keys.is_valid(k) for k in (b"flag-1", b"file-1", b"file-2")] == [True, True, True]
    assert not keys.is_valid(b"env-1")  # the environment counts only when no flag is given
    assert not keys.is_valid(b"# the service's keys") and not keys.is_valid(b"")
    assert keys.first() == "flag-1" and keys.num_keys == 3
    env_only = ApiKeys.from_flags(None, None, environ={ENV_VAR: " env-1\n"})
    assert env_only is not None and env_only.is_valid(b"env-1") and env_only.first() == "env-1"
    assert ApiKeys.from_flags(None, None, environ={}) is None
    assert ApiKeys.from_flags([], None, environ={ENV_VAR: "  "}) is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read it"),
        ("\n# only a comment\n", "holds no key"),
        ("good\nhas space\n", "line 2: an API key must be printable ASCII without spaces"),
        ("caf\u00e9\n", "line 1: an API key must be printable ASCII"),
    ],
)
def test_bad_key_file_is_an_error_naming_the_flag(tmp_path: Path, content: str | None, message: str) -> None:
    key_file = tmp_path / "keys"
    if content is not None:
        key_file.write_text(content)
    with pytest.raises(ApiKeyError) as err:
        ApiKeys.from_flags(None, str(key_file))
    assert str(err.value).startswith(f"--api-key-file {key_file}") and message in str(err.value)


def test_malformed_flag_or_environment_key_is_refused() -> None:
    with pytest.raises(ApiKeyError, match="--api-key: an API key must be printable ASCII without spaces"):
        ApiKeys.from_flags(["two words"], None)
    with pytest.raises(ApiKeyError, match=rf"\${ENV_VAR}: an API key must be printable"):
        ApiKeys.from_flags(None, None, environ={ENV_VAR: "tab\tinside"})


def test_key_file_is_re_read_at_most_once_per_interval(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("old\n")
    clock = FakeClock()
    keys = ApiKeys(["fixed"], key_file, reload_interval_s=1.0, clock=clock)
    rotate(key_file, "new\nold\n")
    clock.now += 0.5
    assert keys.is_valid(b"old") and not keys.is_valid(b"new")  # not looked at yet
    clock.now += 0.5
    assert keys.is_valid(b"new") and keys.is_valid(b"old") and keys.is_valid(b"fixed")
    assert keys.first() == "fixed"
    rotate(key_file, "new\n")
    clock.now += 1.0
    assert keys.is_valid(b"new") and not keys.is_valid(b"old")


def test_a_rotation_that_empties_or_removes_the_file_keeps_the_keys(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("k1\n")
    clock = FakeClock()
    keys = ApiKeys([], key_file, reload_interval_s=1.0, clock=clock)
    rotate(key_file, "\n")
    clock.now += 1.0
    assert keys.is_valid(b"k1")  # closed, never open: the empty file changes nothing
    key_file.unlink()
    clock.now += 1.0
    assert keys.is_valid(b"k1") and keys.first() == "k1"
    rotate(key_file, "k2\n")
    clock.now += 1.0
    assert keys.is_valid(b"k2") and not keys.is_valid(b"k1") and keys.first() == "k2"


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([(b"authorization", b"Bearer sk-1")], [b"sk-1"]),
        ([(b"authorization", b"bearer   sk-1 ")], [b"sk-1"]),
        ([(b"authorization", b"Basic c2stMQ==")], []),
        ([(b"authorization", b"Bearer ")], []),
        ([(b"x-api-key", b" sk-2")], [b"sk-2"]),
        ([(b"authorization", b"Bearer a"), (b"x-api-key", b"b")], [b"a", b"b"]),
        ([(b"x-request-id", b"sk-1")], []),
    ],
)
def test_presented_keys(headers: list[tuple[bytes, bytes]], expected: list[bytes]) -> None:
    assert presented_keys(headers) == expected


def _guarded_app(keys: ApiKeys) -> FastAPI:
    app = FastAPI()
    for path in sorted(OPEN_PATHS):
        app.get(path)(lambda: {"open": True})

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> dict[str, Any]:
        return {"echo": body}

    @app.get("/debug/state")
    async def debug() -> dict[str, str]:
        return {"secret": "state"}

    app.add_middleware(ApiKeyMiddleware, keys=keys)  # type: ignore[arg-type]
    return app


def test_middleware_guards_everything_but_the_open_paths() -> None:
    client = TestClient(_guarded_app(ApiKeys(["sk-right", "sk-other"])))
    for path in sorted(OPEN_PATHS):
        assert client.get(path).status_code == 200, path
    assert client.get("/debug/state").status_code == 401
    assert client.get("/health/").status_code == 401  # only the exact probe paths are open
    body = {"prompt": "x" * 200_000}
    wrong = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-wrong"})
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
    error = wrong.json()["error"]
    assert error == {"message": "Incorrect API key provided.", "type": "invalid_request_error", "param": None,
                     "code": "invalid_api_key"}  # fmt: skip
    assert "sk-wrong" not in wrong.text
    missing = client.post("/v1/completions", json=body)
    assert missing.status_code == 401 and "didn't provide an API key" in missing.json()["error"]["message"]
    assert client.post("/v1/completions", json={"a": 1}, headers={"Authorization": "Bearer sk-other"}).json() == {
        "echo": {"a": 1}
    }
    assert client.get("/debug/state", headers={"x-api-key": "sk-right"}).json() == {"secret": "state"}
    # One valid credential among the presented ones is enough.
    assert client.get("/debug/state", headers={"x-api-key": "sk-wrong", "Authorization": "Bearer sk-right"}).is_success


def test_client_auth_sends_the_first_key_only_where_no_key_is_carried() -> None:
    seen: list[httpx.Headers] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200)

    keys = ApiKeys(["router-key", "second"])
    with httpx.Client(transport=httpx.MockTransport(handler), auth=ApiKeyAuth(keys)) as client:
        client.get("http://engine/v1/models")
        client.post("http://engine/v1/completions", headers={"Authorization": "Bearer client-key"})
        client.post("http://engine/v1/completions", headers={"x-api-key": "client-key"})
    assert seen[0]["authorization"] == "Bearer router-key"
    assert seen[1]["authorization"] == "Bearer client-key"
    assert "authorization" not in seen[2] and seen[2]["x-api-key"] == "client-key"


def test_api_key_flags_are_one_table_for_serve_and_router() -> None:
    from tidepool.engine.server.cli import build_parser as serve_parser
    from tidepool.router.cli import build_parser as router_parser

    argv = ["--api-key", "a", "b", "--api-key", "c", "--api-key-file", "/etc/keys"]
    serve = serve_parser().parse_args(["--model", "m", *argv])
    router = router_parser().parse_args(["--unified-url", "http://e:1", *argv])
    for parsed in (serve, router):
        assert parsed.api_key == ["a", "b", "c"] and parsed.api_key_file == "/etc/keys"
    assert {f.name for f in serve_flags.AUTH_FLAGS} == {"api-key", "api-key-file"}
    assert serve_flags.render_args({"api-key": ["a", "b"]}) == ["--api-key", "a", "b"]


def test_serve_refuses_a_key_file_it_cannot_read(tiny_model_dir: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from tidepool.engine.server.cli import main

    missing = tmp_path / "absent"
    assert main(["--model", str(tiny_model_dir), "--port", "0", "--api-key-file", str(missing)]) == 2
    assert f"tidepool serve: error: --api-key-file {missing}: cannot read it" in capsys.readouterr().err


def test_router_refuses_a_key_file_it_cannot_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tidepool.router.cli import main

    empty = tmp_path / "empty"
    empty.write_text("# rotated away\n")
    assert main(["--unified-url", "http://127.0.0.1:9", "--api-key-file", str(empty)]) == 2
    assert f"tidepool router: error: --api-key-file {empty}: holds no key" in capsys.readouterr().err


def test_drain_waits_for_the_last_request_or_the_grace_period() -> None:
    async def scenario() -> tuple[bool, bool, bool, int]:
        drain = Drain()
        drain.enter()
        drain.enter()
        waiter = asyncio.ensure_future(drain.wait_drained(60.0))
        await asyncio.sleep(0)
        drain.leave()
        await asyncio.sleep(0)
        still_waiting = not waiter.done()
        drain.leave()
        drained = await asyncio.wait_for(waiter, 10.0)
        drain.enter()
        timed_out = await drain.wait_drained(0.0)
        hurried = asyncio.ensure_future(drain.wait_drained(60.0))
        await asyncio.sleep(0)
        drain.hurry()
        return still_waiting, drained, timed_out or await asyncio.wait_for(hurried, 10.0), drain.num_inflight

    still_waiting, drained, ended_early, num_inflight = asyncio.run(scenario())
    assert still_waiting and drained and not ended_early and num_inflight == 1
