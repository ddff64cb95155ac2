"""vLLM's sleep mode through a real `tidepool serve --enable-sleep-mode` (tiny random model), driven by httpx and the
official `openai` client: POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping (contract/sleep.py).

What must hold: greedy outputs are identical before and after a sleep/wake round trip at both levels; the
prefix cache is emptied by sleep and its hits after wake give the same tokens; requests in flight when the
engine is put to sleep are answered (503 `sleeping`), never left hanging, and their KV blocks freed; requests
while asleep get 503 `sleeping` while /health and /ready stay 200; the state shows in /is_sleeping and in
vLLM's `vllm:engine_sleep_state` gauge; a bad `level` or `tags` is a 400 naming the field; without the flag
the paths are 404; with --api-key they need the key. In-flight requests are held by the test's hand on the
engine (controlled_serve.py), never by timing.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_proc import Server

from tidepool.contract import metrics_names as names
from tidepool.contract import sleep as contract

NUM_NEW = 8
PROMPTS = ["The tide comes in and", "Once upon a time, far away, there lived a", "1 2 3 4 5 6 7 8 9 10 11 12 13 14"]
GREEDY: dict[str, Any] = dict(max_tokens=NUM_NEW, temperature=0, logprobs=0,
                              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})  # fmt: skip


@pytest.fixture(scope="module")
def sleepy(serve_controlled: Callable[..., Server]) -> Server:
    return serve_controlled(f"--{contract.SLEEP_MODE_FLAG}")


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)


def _greedy(server: Server, prompt: str) -> list[str]:
    """The greedy tokens (as `token_id:N` strings) of one prompt."""
    out = _client(server).completions.create(model=server.model, prompt=prompt, **GREEDY)
    assert out.choices[0].logprobs is not None and out.choices[0].logprobs.tokens is not None
    return out.choices[0].logprobs.tokens


def _post(server: Server, path: str, **params: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", params=params, timeout=120)


def _is_sleeping(server: Server) -> bool:
    response = httpx.get(f"{server.url}{contract.IS_SLEEPING_PATH}", timeout=10)
    assert response.status_code == 200
    return response.json()[contract.IS_SLEEPING_KEY]


def _metrics(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _sleep_gauge(server: Server) -> dict[str, float]:
    return {
        dict(labels)[names.SLEEP_STATE_LABEL]: value
        for (name, labels), value in _metrics(server).items()
        if name == names.ENGINE_SLEEP_STATE
    }


def _prefix_hits(server: Server) -> float:
    return sum(v for (n, _), v in _metrics(server).items() if n == names.sample_total(names.PREFIX_CACHE_HITS))


def test_without_the_flag_the_endpoints_are_404(server: Server) -> None:
    assert _post(server, contract.SLEEP_PATH).status_code == 404
    assert _post(server, contract.WAKE_UP_PATH).status_code == 404
    assert httpx.get(f"{server.url}{contract.IS_SLEEPING_PATH}", timeout=10).status_code == 404
    assert not any(name == names.ENGINE_SLEEP_STATE for name, _ in _metrics(server))


@pytest.mark.parametrize("level", contract.SLEEP_LEVELS)
def test_round_trip_keeps_greedy_outputs(sleepy: Server, level: int) -> None:
    before = [_greedy(sleepy, p) for p in PROMPTS]
    assert not _is_sleeping(sleepy)
    assert _sleep_gauge(sleepy) == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}

    assert _post(sleepy, contract.SLEEP_PATH, level=level).status_code == 200
    assert _is_sleeping(sleepy)
    state = contract.sleep_state(level)
    assert _sleep_gauge(sleepy) == {s: 1.0 if s == state else 0.0 for s in contract.SLEEP_STATES}
    # Alive and routed: the pool may be kept asleep on purpose.
    assert httpx.get(f"{sleepy.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{sleepy.url}/ready", timeout=10).status_code == 200
    with pytest.raises(openai.APIStatusError) as refused:
        _greedy(sleepy, PROMPTS[0])
    assert refused.value.status_code == 503 and refused.value.code == contract.SLEEPING_CODE
    assert "asleep" in refused.value.message and contract.WAKE_UP_PATH in refused.value.message
    tokens = httpx.post(f"{sleepy.url}/tokenize", json={"prompt": "still tokenizes"}, timeout=10)
    assert tokens.status_code == 200 and tokens.json()["count"] > 0
    assert _post(sleepy, contract.SLEEP_PATH, level=level).status_code == 200  # asleep already: a no-op

    assert _post(sleepy, contract.WAKE_UP_PATH).status_code == 200
    assert not _is_sleeping(sleepy)
    assert _sleep_gauge(sleepy)["awake"] == 1.0
    assert [_greedy(sleepy, p) for p in PROMPTS] == before
    # The prefix cache was emptied by the sleep; what it holds now was computed after the wake, and hits on it
    # give the same tokens again.
    hits = _prefix_hits(sleepy)
    assert [_greedy(sleepy, p) for p in PROMPTS] == before
    assert _prefix_hits(sleepy) > hits
    assert _post(sleepy, contract.WAKE_UP_PATH).status_code == 200  # awake already: a no-op
    sleepy.wait_pool_free()


def test_level_one_then_two_then_wake(sleepy: Server) -> None:
    before = _greedy(sleepy, PROMPTS[1])
    assert _post(sleepy, contract.SLEEP_PATH).status_code == 200  # no level: vLLM's default, 1
    assert _sleep_gauge(sleepy)["weights_offloaded"] == 1.0
    assert _post(sleepy, contract.SLEEP_PATH, level=2).status_code == 200  # deeper: the weights go too
    assert _sleep_gauge(sleepy)["discard_all"] == 1.0
    assert _post(sleepy, contract.WAKE_UP_PATH, tags="weights").status_code == 200  # vLLM's tags: wakes whole
    assert _greedy(sleepy, PROMPTS[1]) == before


def test_sleep_aborts_requests_in_flight(sleepy: Server) -> None:
    before = _greedy(sleepy, PROMPTS[2])
    client = _client(sleepy)
    long = dict(GREEDY, max_tokens=200)
    with sleepy.holding(), ThreadPoolExecutor(2) as pool:
        plain = pool.submit(client.completions.create, model=sleepy.model, prompt=PROMPTS[0], **long)

        def streamed() -> list[Any]:
            return list(client.completions.create(model=sleepy.model, prompt=PROMPTS[1], stream=True, **long))

        stream = pool.submit(streamed)
        sleepy.wait_held(2)
        assert _post(sleepy, contract.SLEEP_PATH, level=1).status_code == 200
        with pytest.raises(openai.APIStatusError) as aborted:
            plain.result(timeout=60)
        assert aborted.value.status_code == 503 and aborted.value.code == contract.SLEEPING_CODE
        with pytest.raises(openai.APIError) as ended:
            stream.result(timeout=60)  # the stream ends with an error event after finish_reason "abort"
        assert "put to sleep" in str(ended.value)
    kv = sleepy.kv()
    assert kv["num_unfinished"] == 0 and kv["num_free_blocks"] == kv["num_blocks"]
    assert _post(sleepy, contract.WAKE_UP_PATH).status_code == 200
    assert _greedy(sleepy, PROMPTS[2]) == before


@pytest.mark.parametrize(
    ("path", "params", "field"),
    [
        (contract.SLEEP_PATH, {"level": "3"}, contract.LEVEL_PARAM),
        (contract.SLEEP_PATH, {"level": "deep"}, contract.LEVEL_PARAM),
        (contract.WAKE_UP_PATH, {"tags": "everything"}, contract.TAGS_PARAM),
    ],
)
def test_bad_parameters_name_the_field(sleepy: Server, path: str, params: dict[str, str], field: str) -> None:
    response = _post(sleepy, path, **params)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]
    assert not _is_sleeping(sleepy)


def test_the_endpoints_need_the_api_key(serve: Callable[..., Server]) -> None:
    server = serve(f"--{contract.SLEEP_MODE_FLAG}", "--api-key", "sleep-key")
    auth = {"Authorization": "Bearer sleep-key"}
    for method, path in (("POST", contract.SLEEP_PATH), ("POST", contract.WAKE_UP_PATH),
                         ("GET", contract.IS_SLEEPING_PATH)):  # fmt: skip
        assert httpx.request(method, f"{server.url}{path}", timeout=60).status_code == 401
    assert httpx.post(f"{server.url}{contract.SLEEP_PATH}", headers=auth, timeout=60).status_code == 200
    assert httpx.get(f"{server.url}{contract.IS_SLEEPING_PATH}", headers=auth, timeout=10).json() == {
        contract.IS_SLEEPING_KEY: True
    }
    assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200  # probes stay open
    assert httpx.post(f"{server.url}{contract.WAKE_UP_PATH}", headers=auth, timeout=60).status_code == 200
