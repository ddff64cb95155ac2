"""LoRA affinity in the router, against fake engines that hold adapters (in-process), and its pure parts.

`LoRAFake` is the tests' `FakeEngine` that lists its adapters in `/v1/models` the way vLLM does
(`parent` = the base model) and answers an OpenAI-shaped 404 `model_not_found` for a name it does
not serve, as the real server does. Its adapters can change while it runs (a load or unload).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from router_fake_engine import FakeEngine, ThreadServer, fake_tokens
from router_helpers import Servers, wait_for
from router_lora_helpers import adapters_seen, affinity

from tidepool.router.lora import ReplicaModels, adapter_holders, merge_model_lists, parse_models
from tidepool.router.policy import PrefixAwarePolicy
from tidepool.router.pool import Endpoint, Pool

BASE = "fake"


@dataclass
class LoRAFake(FakeEngine):
    adapters: list[str] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = super().app()
        app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) != "/v1/models"]

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            cards = [{"id": BASE, "object": "model", "owned_by": self.name, "root": "/models/base", "parent": None}]
            cards += [
                {"id": name, "object": "model", "owned_by": self.name, "root": f"/adapters/{name}", "parent": BASE}
                for name in self.adapters
            ]
            return {"object": "list", "data": cards}

        return app

    async def answer(self, body: dict[str, Any], raw: Request, chat: bool) -> Response:
        if body.get("model") not in (BASE, *self.adapters):
            self.bodies.append(body)
            error = {"message": f"The model `{body.get('model')}` does not exist.", "type": "NotFoundError",
                     "param": "model", "code": "model_not_found"}  # fmt: skip
            return JSONResponse({"error": error}, status_code=404)
        return await super().answer(body, raw, chat)


def lora_engine(servers: Servers, name: str, *adapters: str) -> tuple[LoRAFake, ThreadServer]:
    fake = LoRAFake(name, adapters=list(adapters))
    server = ThreadServer(fake.app())
    servers.started.append(server)
    return fake, server


def api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20)


def served_by(url: str, model: str, prompt: str, max_tokens: int = 3) -> str:
    raw = api(url).completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=max_tokens)
    assert raw.parse().choices[0].text == " ".join(fake_tokens(prompt, 0, max_tokens))
    return raw.headers["x-tidepool-replica"]


def label(server: ThreadServer) -> str:
    return server.url.removeprefix("http://")


# --- pure parts ---------------------------------------------------------------------------------------------------


def test_parse_models_reads_vllms_list_base_entries_have_no_parent() -> None:
    body = {
        "object": "list",
        "data": [
            {"id": "base", "object": "model", "root": "/m", "parent": None},
            {"id": "sql", "object": "model", "root": "/a/sql", "parent": "base"},
            {"id": "chat", "object": "model", "parent": "base"},
            {"object": "model"},  # no id: ignored
            "junk",
        ],
    }
    assert parse_models(body) == ReplicaModels(frozenset({"base"}), frozenset({"sql", "chat"}))
    assert parse_models({"data": [{"id": "m"}]}) == ReplicaModels(frozenset({"m"}), frozenset())  # no parent key
    for bad in ({"error": "x"}, [], "text", None, {"data": "x"}):
        assert parse_models(bad) is None


def test_adapter_holders_only_for_names_no_replica_serves_as_its_base_model() -> None:
    a = ReplicaModels(frozenset({"base"}), frozenset({"sql"}))
    b = ReplicaModels(frozenset({"base"}), frozenset({"chat", "sql"}))
    known = {"http://a": a, "http://b": b, "http://c": None}
    assert adapter_holders("sql", known) == {"http://a", "http://b"}
    assert adapter_holders("chat", known) == {"http://b"}
    assert adapter_holders("nobody-has-it", known) == frozenset()  # an adapter request nobody holds: a miss
    for model in ("base", None, "", 7):
        assert adapter_holders(model, known) is None  # routed as without LoRA
    assert adapter_holders("sql", {"http://c": None}) is None  # nothing known yet: routed as without LoRA


def test_merge_model_lists_keeps_every_id_once_in_first_seen_order() -> None:
    one = {"object": "list", "data": [{"id": "base", "root": "1"}, {"id": "sql", "parent": "base"}]}
    two = {"object": "list", "data": [{"id": "base", "root": "2"}, {"id": "chat", "parent": "base"}]}
    merged = merge_model_lists([one, None, two])
    assert merged is not None
    assert [(m["id"], m.get("root")) for m in merged["data"]] == [("base", "1"), ("sql", None), ("chat", None)]
    assert merge_model_lists([None, {"x": 1}]) is None


def make_pool(models: dict[str, ReplicaModels | None], loads: dict[str, int]) -> Pool:
    pool = Pool("unified", PrefixAwarePolicy())
    pool.set_members([Endpoint(url) for url in models])
    for url, replica_models in models.items():
        pool.set_models(url, replica_models)
        pool.mark_ready(url, 0, loads.get(url, 0), 0.0)
    return pool


def test_pool_chooses_among_holders_by_prefix_then_by_load_when_none_holds_it() -> None:
    holds = ReplicaModels(frozenset({"base"}), frozenset({"sql"}))
    bare = ReplicaModels(frozenset({"base"}), frozenset())
    pool = make_pool({"http://a": holds, "http://b": holds, "http://c": bare}, {"http://a": 0, "http://c": 0})
    candidates = pool.ready()
    keys = [f"prompt {i}".encode() for i in range(64)]
    chosen = {pool.choose(candidates, key, pool.policy, "sql").replica_id for key in keys}
    assert chosen == {"http://a", "http://b"}  # both holders, spread by the prefix ring; never the bare one
    choice = pool.choose(candidates, keys[0], pool.policy, "sql")
    assert (choice.reason, choice.affinity) == ("prefix", "hit")
    # A holder too hot for the prefix rule gives way to the other holder, still not to the idle bare replica.
    target = choice.replica_id
    other = next(url for url in ("http://a", "http://b") if url != target)
    pool.mark_ready(target, 0, 50, 0.0)
    pool.mark_ready(other, 0, 10, 0.0)
    hot = pool.choose(pool.ready(), keys[0], pool.policy, "sql")
    assert (hot.replica_id, hot.reason, hot.affinity) == (other, "prefix_fallback", "hit")
    # Nobody holds it (or the holders are excluded): the least loaded of the rest, counted as a miss.
    miss = pool.choose([pool.replicas["http://c"]], keys[0], pool.policy, "sql")
    assert (miss.replica_id, miss.reason, miss.affinity) == ("http://c", "least_load", "miss")
    unknown = pool.choose(pool.ready(), keys[0], pool.policy, "gone")
    assert (unknown.replica_id, unknown.affinity) == ("http://c", "miss")
    base = pool.choose(pool.ready(), keys[0], pool.policy, "base")
    assert base.affinity is None and base.reason in ("prefix", "prefix_fallback")


# --- through the router, fake engines -----------------------------------------------------------------------------


def test_each_adapter_goes_to_the_replica_holding_it_and_base_requests_still_spread(servers: Servers) -> None:
    _, a = lora_engine(servers, "a", "sql")
    _, b = lora_engine(servers, "b", "chat")
    router = servers.router("--unified-url", a.url, "--unified-url", b.url, "--policy", "prefix-aware", wait_ready=2)
    wait_for(lambda: all(v is not None for v in adapters_seen(router.url).values()), what="adapters scraped")
    assert adapters_seen(router.url) == {a.url: ["sql"], b.url: ["chat"]}
    prompts = [f"Story {i}: once upon a time there was a {i}" for i in range(12)]
    assert {served_by(router.url, "sql", p) for p in prompts} == {label(a)}
    assert {served_by(router.url, "chat", p) for p in prompts} == {label(b)}
    assert affinity(router.url) == (24, 0)
    many = [f"Base {i}: once upon a time there was a {i}" for i in range(24)]
    assert {served_by(router.url, BASE, p) for p in many} == {label(a), label(b)}  # the prefix ring, as before
    assert affinity(router.url) == (24, 0)  # base-model requests count in neither
    chat = api(router.url).chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2, stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chat) == " ".join(fake_tokens("user:hi\n", 0, 2))
    assert [m.id for m in api(router.url).models.list().data] in (["fake", "sql", "chat"], ["fake", "chat", "sql"])


def test_an_adapter_nobody_holds_goes_by_load_and_gets_the_engines_404(servers: Servers) -> None:
    fake_a, a = lora_engine(servers, "a", "sql")
    fake_b, b = lora_engine(servers, "b")
    fake_a.num_running = 5  # the scrape says a is busier: a miss goes to b
    router = servers.router("--unified-url", a.url, "--unified-url", b.url, wait_ready=2)
    wait_for(lambda: adapters_seen(router.url) == {a.url: ["sql"], b.url: []}, what="adapters scraped")
    with pytest.raises(openai.NotFoundError) as err:
        api(router.url).completions.create(model="nope", prompt="hello", max_tokens=2)
    assert err.value.code == "model_not_found"  # the engine's own answer, relayed (4xx: not retried)
    assert (len(fake_a.bodies), len(fake_b.bodies)) == (0, 1)
    assert affinity(router.url) == (0, 1)


def test_a_load_or_unload_on_a_replica_moves_the_adapters_requests_at_the_next_probe(servers: Servers) -> None:
    fake_a, a = lora_engine(servers, "a", "sql")
    fake_b, b = lora_engine(servers, "b")
    router = servers.router("--unified-url", a.url, "--unified-url", b.url, wait_ready=2)
    wait_for(lambda: adapters_seen(router.url)[b.url] == [], what="adapters scraped")
    fake_b.adapters.append("sql")  # loaded on b too
    fake_a.adapters.remove("sql")  # and unloaded from a
    wait_for(lambda: adapters_seen(router.url) == {a.url: [], b.url: ["sql"]}, what="the change scraped")
    assert {served_by(router.url, "sql", f"question {i}") for i in range(6)} == {label(b)}
    assert affinity(router.url) == (6, 0)


def test_an_adapter_whose_only_holder_is_not_ready_is_a_miss_until_it_is(servers: Servers) -> None:
    fake_a, a = lora_engine(servers, "a", "sql")
    fake_a.is_ready = False
    _, b = lora_engine(servers, "b", "chat")
    router = servers.router("--unified-url", a.url, "--unified-url", b.url, wait_ready=1)
    wait_for(lambda: adapters_seen(router.url)[b.url] == ["chat"], what="b's adapters scraped")
    # a is not ready: its adapters are unknown, so "sql" is an adapter nobody ready holds: a miss, to b (404).
    with pytest.raises(openai.NotFoundError):
        api(router.url).completions.create(model="sql", prompt="hello", max_tokens=2)
    assert affinity(router.url) == (0, 1)
    fake_a.is_ready = True
    wait_for(lambda: adapters_seen(router.url)[a.url] == ["sql"], what="a ready and scraped")
    assert served_by(router.url, "sql", "hello") == label(a)
    assert affinity(router.url) == (1, 1)


def test_disaggregated_each_pool_prefers_its_holders_and_model_is_forwarded_unchanged(servers: Servers) -> None:
    fakes: dict[str, LoRAFake] = {}
    flags: list[str] = []
    for name, adapters in (("p1", ()), ("p2", ("sql",))):
        fakes[name], server = lora_engine(servers, name, *adapters)
        flags += ["--prefill-url", server.url]
    for name, adapters in (("d1", ("sql",)), ("d2", ())):
        fakes[name], server = lora_engine(servers, name, *adapters)
        flags += ["--decode-url", f"{server.url},kv=127.0.0.1:{server.port}"]  # the fake's KV "listener"
    router = servers.router(*flags, wait_ready=2, pool="decode")
    wait_for(lambda: None not in adapters_seen(router.url, "prefill").values(), what="prefill adapters scraped")
    wait_for(lambda: None not in adapters_seen(router.url, "decode").values(), what="decode adapters scraped")
    prompts = [f"Summarise chapter {i}" for i in range(6)]
    for prompt in prompts:
        served_by(router.url, "sql", prompt, max_tokens=5)  # first token from p2, the rest from d1: as unified
    stream = api(router.url).completions.create(model="sql", prompt=prompts[0], max_tokens=5, stream=True)
    assert "".join(c.choices[0].text for c in stream) == " ".join(fake_tokens(prompts[0], 0, 5))
    assert (len(fakes["p1"].bodies), len(fakes["d2"].bodies)) == (0, 0)
    assert [b["model"] for b in fakes["p2"].bodies] == [b["model"] for b in fakes["d1"].bodies] == ["sql"] * 7
    assert affinity(router.url, "prefill") == affinity(router.url, "decode") == (7, 0)
