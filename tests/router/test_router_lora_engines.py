"""LoRA through the router, against real `tidepool serve` processes on the tiny model with `peft` adapters.

Unified: replica a holds adapter "sql", replica b holds "chat" (and may load more at run time);
every adapter request must land on the replica holding it and answer exactly what that replica
answers directly. Disaggregated: a prefill and a decode replica both hold "sql"; the hand-off
through the router must give the tokens a unified engine with the adapter gives (replica a).

The adapters are made with `peft` on the tiny model by the LoRA tests' helper (tests/lora/lora_helpers.py:
random, non-zero A and B), of different ranks, targets and scalings.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from router_helpers import ENGINE_FLAGS, Proc, free_port, spawn, wait_for, wait_ready
from router_lora_helpers import adapters_seen, affinity, serving_with_adapters

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lora"))  # lora_helpers, imported where used (torch)

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox jumps over the lazy dog", "def fibonacci(n):", "Once upon a time", "SELECT name"]
GREEDY: dict[str, Any] = dict(max_tokens=12, temperature=0)


@dataclass
class Fleet:
    adapters: dict[str, Path]
    a: Proc  # unified, holds "sql"
    b: Proc  # unified, holds "chat"; loads more at run time
    router: Proc  # a and b
    prefill: Proc  # holds "sql"
    decode: Proc  # holds "sql"
    pd_router: Proc


def lora_flags(*modules: str) -> list[str]:
    return ["--enable-lora", "--max-loras", "2", "--lora-modules", *modules]


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from lora_helpers import AdapterSpec, make_adapter

    root = tmp_path_factory.mktemp("router-lora")
    specs = {
        "sql": AdapterSpec(8, ("q_proj", "v_proj", "down_proj")),
        "chat": AdapterSpec(4, ("k_proj", "o_proj", "gate_proj", "up_proj"), alpha=8.0, use_rslora=True),
        "extra": AdapterSpec(2, ("q_proj", "up_proj"), alpha=4.0),
    }
    adapters = {name: root / name for name in specs}
    for seed, (name, spec) in enumerate(specs.items(), start=1):
        make_adapter(tiny_model_dir, adapters[name], spec, seed)
    sql, chat = f"sql={adapters['sql']}", f"chat={adapters['chat']}"

    def serve(name: str, *flags: str) -> Proc:
        return spawn(root, name, ["serve", "--model", str(tiny_model_dir), *ENGINE_FLAGS, *flags])

    kv_port = free_port()
    procs = [
        serve("a", *lora_flags(sql)),
        serve("b", *lora_flags(chat), "--allow-runtime-lora-updating"),
        serve("prefill", *lora_flags(sql), "--role", "prefill", "--kv-transfer-timeout", "10"),
        serve("decode", *lora_flags(sql), "--role", "decode", "--kv-port", str(kv_port), "--kv-transfer-timeout", "10"),
    ]
    a, b, prefill, decode = procs
    try:
        unified = ["--unified-url", a.url, "--unified-url", b.url]
        disaggregated = ["--prefill-url", prefill.url, "--decode-url", f"{decode.url},kv=127.0.0.1:{kv_port}"]
        routers = [
            spawn(root, "router", ["router", "--health-interval", "0.2", *unified]),
            spawn(root, "pd-router", ["router", "--health-interval", "0.2", *disaggregated]),
        ]
        procs += routers
        wait_ready(*procs)
        for router, pools in ((routers[0], ("unified",)), (routers[1], ("prefill", "decode"))):
            for pool in pools:
                wait_for(lambda r=router, p=pool: serving_with_adapters(r.url, p), timeout=120,
                         what=f"the {pool} pool's replicas ready with their adapters scraped")  # fmt: skip
        yield Fleet(adapters, a, b, routers[0], prefill, decode, routers[1])
    finally:
        for proc in reversed(procs):
            proc.stop()


def api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def text(url: str, model: str, prompt: str) -> str:
    return api(url).completions.create(model=model, prompt=prompt, **GREEDY).choices[0].text


def label(proc: Proc) -> str:
    return proc.url.removeprefix("http://")


def test_each_adapter_request_lands_on_its_holder_with_the_direct_engines_greedy_output(fleet: Fleet) -> None:
    routed = api(fleet.router.url)
    hits, misses = affinity(fleet.router.url)
    num_sent = 0
    for model, holder in (("sql", fleet.a), ("chat", fleet.b)):
        for prompt in PROMPTS:
            want = text(holder.url, model, prompt)
            raw = routed.completions.with_raw_response.create(model=model, prompt=prompt, **GREEDY)
            assert raw.headers["x-tidepool-replica"] == label(holder)
            assert raw.parse().choices[0].text == want
            stream = routed.completions.create(model=model, prompt=prompt, stream=True, **GREEDY)
            assert "".join(chunk.choices[0].text for chunk in stream) == want
            num_sent += 2
        messages: Any = [{"role": "user", "content": "hello there"}]
        want_chat = api(holder.url).chat.completions.create(model=model, messages=messages, **GREEDY)
        got_chat = routed.chat.completions.create(model=model, messages=messages, **GREEDY)
        assert got_chat.choices[0].message.content == want_chat.choices[0].message.content
        num_sent += 1
    assert affinity(fleet.router.url) == (hits + num_sent, misses)
    # The adapters change the output (so landing on the wrong replica would show); the base model is unchanged.
    base = [text(fleet.router.url, "tiny", p) for p in PROMPTS]
    assert base == [text(fleet.b.url, "tiny", p) for p in PROMPTS]
    assert base != [text(fleet.a.url, "sql", p) for p in PROMPTS]
    assert base != [text(fleet.b.url, "chat", p) for p in PROMPTS]
    assert affinity(fleet.router.url) == (hits + num_sent, misses)  # base-model requests count in neither
    listed = {m.id: getattr(m, "parent", None) for m in routed.models.list().data}
    assert listed == {"tiny": None, "sql": "tiny", "chat": "tiny"}  # the union of both replicas' lists


def test_an_adapter_loaded_at_run_time_is_routed_to_its_holder_and_a_removed_one_gets_a_404(fleet: Fleet) -> None:
    body = {"lora_name": "extra", "lora_path": str(fleet.adapters["extra"])}
    assert httpx.post(f"{fleet.b.url}/v1/load_lora_adapter", json=body, timeout=60).status_code == 200
    try:
        wait_for(lambda: "extra" in (adapters_seen(fleet.router.url)[fleet.b.url] or []), what="extra scraped")
        for prompt in PROMPTS:
            raw = api(fleet.router.url).completions.with_raw_response.create(model="extra", prompt=prompt, **GREEDY)
            assert raw.headers["x-tidepool-replica"] == label(fleet.b)
            assert raw.parse().choices[0].text == text(fleet.b.url, "extra", prompt)
    finally:
        unloaded = httpx.post(f"{fleet.b.url}/v1/unload_lora_adapter", json={"lora_name": "extra"}, timeout=60)
    assert unloaded.status_code == 200
    wait_for(lambda: "extra" not in (adapters_seen(fleet.router.url)[fleet.b.url] or ["extra"]), what="unload seen")
    misses = affinity(fleet.router.url)[1]
    with pytest.raises(openai.NotFoundError) as err:
        api(fleet.router.url).completions.create(model="extra", prompt=PROMPTS[0], **GREEDY)
    assert err.value.code == "model_not_found"  # the engine's answer, relayed
    assert affinity(fleet.router.url)[1] == misses + 1


def test_disaggregated_adapter_requests_give_the_unified_engines_greedy_tokens(fleet: Fleet) -> None:
    routed = api(fleet.pd_router.url)
    for model in ("sql", "tiny"):
        for prompt in PROMPTS:
            want = text(fleet.a.url, model, prompt)
            raw = routed.completions.with_raw_response.create(model=model, prompt=prompt, **GREEDY)
            assert raw.headers["x-tidepool-replica"] == label(fleet.decode)
            assert raw.parse().choices[0].text == want
            stream = routed.completions.create(model=model, prompt=prompt, stream=True, **GREEDY)
            assert "".join(chunk.choices[0].text for chunk in stream) == want
    messages: Any = [{"role": "user", "content": "hello there"}]
    want_chat = api(fleet.a.url).chat.completions.create(model="sql", messages=messages, **GREEDY)
    got_chat = routed.chat.completions.create(model="sql", messages=messages, **GREEDY)
    assert got_chat.choices[0].message.content == want_chat.choices[0].message.content
    num_adapter_requests = 2 * len(PROMPTS) + 1
    assert affinity(fleet.pd_router.url, "prefill") == affinity(fleet.pd_router.url, "decode")
    assert affinity(fleet.pd_router.url, "decode") == (num_adapter_requests, 0)
