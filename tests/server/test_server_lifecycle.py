"""Backpressure (bounded queue -> 429 + Retry-After, or 400 when it can never fit) and graceful drain on SIGTERM.

The engine is paused (controlled_serve.py) while a test needs requests to be provably waiting
or in flight, and resumed when they may finish, so nothing here depends on machine speed: the
drain's grace period is far above anything waited for, and every in-flight request must
complete with its full token count.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Callable

import httpx
import pytest
from serve_proc import Server


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_queue_full_gets_429(serve_controlled: Callable[..., Server]) -> None:
    server = serve_controlled("--max-num-seqs", "1", "--max-queue-len", "2", "--retry-after", "3")
    server.pause()  # nothing gets scheduled: exactly max-queue-len requests fit in the queue
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 10, "ignore_eos": True, "temperature": 0}

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            tasks = [asyncio.create_task(http.post(server.api + "/completions", json=body)) for _ in range(8)]
            while len([t for t in tasks if t.done()]) < 6:  # the six that cannot fit are answered at once
                await asyncio.sleep(0.02)
            server.pause(False)
            return await asyncio.gather(*tasks)

    responses = asyncio.run(main())
    ok = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 429]
    assert (len(ok), len(rejected)) == (2, 6), [r.status_code for r in responses]
    assert all(r.json()["usage"]["completion_tokens"] == 10 for r in ok)
    for r in rejected:
        assert r.headers["retry-after"] == "3"
        error = r.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "queue_full" and "queue" in error["message"]
    # A request that could never fit the queue is a 400 saying why, not a 429 to retry forever (issue #14).
    for too_big in ({**body, "prompt": ["a", "b", "c"]}, {**body, "n": 3}):
        resp = httpx.post(server.api + "/completions", json=too_big, timeout=60)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["code"] == "too_many_completions" and "--max-queue-len 2" in error["message"], error
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    server.wait_pool_free()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_drains(serve_controlled: Callable[..., Server]) -> None:
    server = serve_controlled("--drain-timeout", "600")
    max_tokens = 64
    body = {"model": "tiny", "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    server.pause()

    async def main() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as http:

            async def stream(i: int) -> int:
                usage = 0
                async with http.stream("POST", server.api + "/completions", json={**body, "prompt": f"{i}"}) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        match = re.search(r'"completion_tokens":(\d+)', line)
                        if match:
                            usage = int(match.group(1))
                return usage

            tasks = [asyncio.create_task(stream(i)) for i in range(3)]
            while (await http.get(server.url + "/debug/kv")).json()["num_unfinished"] < 3:
                await asyncio.sleep(0.02)
            # All three are in the paused engine: provably unfinished when the signal lands.
            server.proc.send_signal(signal.SIGTERM)
            while (await http.get(server.url + "/ready")).status_code != 503:
                await asyncio.sleep(0.02)
            new = await http.post(server.api + "/completions", json={"model": "tiny", "prompt": "late"})
            late_chat = {"model": "tiny", "messages": [{"role": "user", "content": "late"}]}
            chat = await http.post(server.api + "/chat/completions", json=late_chat)
            assert new.status_code == 503 and new.json()["error"]["code"] == "draining", new.text
            assert chat.status_code == 503 and chat.json()["error"]["code"] == "draining", chat.text
            server.pause(False)
            return await asyncio.gather(*tasks)

    usages = asyncio.run(main())
    assert usages == [max_tokens] * 3  # no in-flight request lost
    assert server.proc.wait(60) == 0
    log = server.log()
    assert "draining: 3 in-flight request(s)" in log, log[-2000:]
    match = re.search(r"engine stopped: (\d+)/(\d+) KV blocks free", log)
    assert match and match.group(1) == match.group(2), log[-2000:]
