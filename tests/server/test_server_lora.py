"""LoRA adapters through a real `tidepool serve`, driven by the official `openai` client, checked against `peft`.

One server for the module (tiny model, --enable-lora, three device slots, rank up to 16, two adapters
from --lora-modules, --allow-runtime-lora-updating), run under lora_gated_serve.py so a test can hold
the engine (controlled_serve.py's pause/hold) or an adapter read mid-way, never by timing. The
adapters are made here with `peft` on transformers (random non-zero A and B, saved with
`save_pretrained`), of different ranks, targets and scalings; the greedy tokens the server returns
(as token ids) must equal PEFT's own, in one mixed concurrent batch with base-model requests.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from download_stub import REPO, StubHub
from lora.lora_helpers import AdapterSpec, base_model, greedy, make_adapter, prompts
from lora_gated_serve import launcher
from prometheus_client.parser import text_string_to_metric_families
from serve_proc import Server, start_server

from tidepool.contract import metrics_names as names
from tidepool.contract.lora import LORA_DIR_ENV
from tidepool.engine.server.lora_fetch import ADAPTER_FILES

NUM_NEW = 6
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPECS = {
    "qv": AdapterSpec(8, ("q_proj", "v_proj"), rank_pattern={"v_proj": 4}),
    "all": AdapterSpec(4, ALL, alpha=8.0, use_rslora=True),
    "mlp": AdapterSpec(16, ("o_proj", "gate_proj", "up_proj", "down_proj"), alpha_pattern={"down_proj": 32.0}),
}
AT_START = ("qv", "all")  # --lora-modules; "mlp" is loaded through the API
GREEDY: dict[str, Any] = dict(max_tokens=NUM_NEW, temperature=0, logprobs=0,
                              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})  # fmt: skip


@dataclass
class Adapters:
    paths: dict[str, Path]
    expected: dict[str | None, list[list[int]]]  # adapter (None: base) -> greedy tokens of each prompt, by peft
    bad: dict[str, Path]  # case -> a folder the server must refuse with a 400


# Longer than a KV block (16 tokens) and sharing a prefix: every adapter and the base model send the same
# prompts, so prefix caching (on) would hand one adapter another's KV if it were not keyed by adapter.
PROMPTS = prompts(7, [6, 22], prefix=prompts(3, [18])[0])


@pytest.fixture(scope="module")
def http_adapters(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, hf_model_dir: Callable[[str], Path]
) -> Adapters:
    root = tmp_path_factory.mktemp("lora-adapters")
    paths, expected = {}, {}
    for seed, (name, spec) in enumerate(SPECS.items(), start=1):
        model = make_adapter(tiny_model_dir, root / name, spec, seed)
        paths[name], expected[name] = root / name, [greedy(model, p, NUM_NEW) for p in PROMPTS]
    expected[None] = [greedy(base_model(tiny_model_dir), p, NUM_NEW) for p in PROMPTS]
    bad = {
        "rank_too_large": root / "r32",
        "wrong_base": root / "other-base",
        "missing_file": root / "no-weights",
        "corrupt": root / "corrupt",
    }
    make_adapter(tiny_model_dir, bad["rank_too_large"], AdapterSpec(32, ("q_proj",)), 9)
    # A base with intermediate_size 160 (the tiny model's is 128): the MLP shapes do not fit.
    make_adapter(hf_model_dir("llama-gqa"), bad["wrong_base"], AdapterSpec(4, ("gate_proj",)), 9)
    for case in ("missing_file", "corrupt"):
        bad[case].mkdir()
        (bad[case] / "adapter_config.json").write_text((paths["qv"] / "adapter_config.json").read_text())
    (bad["corrupt"] / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    return Adapters(paths, expected, bad)


@pytest.fixture(scope="module")
def adapter_hub(http_adapters: Adapters) -> Iterator[StubHub]:
    """A stub Hugging Face Hub serving the "qv" adapter's files as hf://org/tiny."""
    files = {name: (http_adapters.paths["qv"] / name).read_bytes() for name in ADAPTER_FILES}
    with StubHub(files, lfs=("adapter_model.safetensors",)) as stub:
        yield stub


@pytest.fixture(scope="module")
def adapter_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora-cache")


@pytest.fixture(scope="module")
def lora_http_server(
    http_adapters: Adapters,
    adapter_hub: StubHub,
    adapter_cache: Path,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Server]:
    control = tmp_path_factory.mktemp("lora-control")
    modules = [f"{name}={http_adapters.paths[name]}" for name in AT_START]
    flags = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "16", "--allow-runtime-lora-updating",
             "--lora-modules", *modules]  # fmt: skip
    with pytest.MonkeyPatch.context() as env:  # what the operator gives an engine pod with spec.lora
        env.setenv(LORA_DIR_ENV, str(adapter_cache))
        env.setenv("HF_ENDPOINT", adapter_hub.endpoint)
        server = start_server(tiny_model_dir, tmp_path_factory.mktemp("lora-logs"), *flags, control_dir=control,
                              launcher=launcher(control))  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def lora_client(lora_http_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=lora_http_server.api, api_key="unused", max_retries=0, timeout=120)


def complete(client: openai.OpenAI, model: str, prompt: list[int]) -> list[int]:
    """Greedy token ids of `model` (the base or an adapter) for a token-id prompt; the reply echoes `model`."""
    resp = client.completions.create(model=model, prompt=prompt, **GREEDY)
    assert resp.model == model
    return token_ids(resp)


def token_ids(resp: Any) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in resp.choices[0].logprobs.tokens]


def admin(server: Server, action: str, **body: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{action}_lora_adapter", json=body, timeout=120)


def load(server: Server, name: str, path: Path | str) -> httpx.Response:
    return admin(server, "load", lora_name=name, lora_path=str(path))


def base_still_serves(client: openai.OpenAI, http_adapters: Adapters) -> None:
    assert complete(client, "tiny", PROMPTS[0]) == http_adapters.expected[None][0]


def test_models_lists_adapters_with_parent_and_root(lora_client: openai.OpenAI, http_adapters: Adapters) -> None:
    models = {m.id: m for m in lora_client.models.list().data}
    assert set(models) >= {"tiny", "qv", "all"}
    base = models["tiny"].model_dump()
    assert base["parent"] is None
    for name in ("qv", "all"):
        card = models[name].model_dump()
        assert card["parent"] == "tiny" and card["root"] == str(http_adapters.paths[name]) and card["object"] == "model"


def test_mixed_concurrent_batch_equals_peft(lora_http_server: Server, http_adapters: Adapters) -> None:
    """Three adapters (ranks 8/4, 4 with rsLoRA, 16 with an alpha pattern) and the base model in one batch."""
    aclient = openai.AsyncOpenAI(base_url=lora_http_server.api, api_key="unused", max_retries=0, timeout=120)
    models: list[str | None] = [None, "qv", "all", "mlp"]
    assert load(lora_http_server, "mlp", http_adapters.paths["mlp"]).status_code == 200

    async def one(model: str | None, prompt: list[int]) -> list[int]:
        resp = await aclient.completions.create(model=model or "tiny", prompt=prompt, **GREEDY)
        assert resp.model == (model or "tiny")
        return token_ids(resp)

    async def batch() -> list[list[int]]:
        async with aclient:
            return await asyncio.gather(*(one(m, p) for m in models for p in PROMPTS))

    got = asyncio.run(batch())
    assert admin(lora_http_server, "unload", lora_name="mlp").status_code == 200
    want = [tokens for m in models for tokens in http_adapters.expected[m]]
    assert got == want
    distinct = {tuple(map(tuple, tokens)) for tokens in http_adapters.expected.values()}
    assert len(distinct) == len(http_adapters.expected)  # every adapter changes the output: no adapter is a no-op


def test_chat_stream_and_tokenize_take_the_adapter(lora_http_server: Server, lora_client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    chat = lora_client.chat.completions.create(model="all", messages=messages, max_tokens=3, temperature=0)  # type: ignore[arg-type]
    assert chat.model == "all" and chat.choices[0].message.content is not None
    chunks = list(lora_client.completions.create(model="qv", prompt="Once", max_tokens=3, stream=True))
    assert chunks and all(c.model == "qv" for c in chunks)
    tokens = httpx.post(f"{lora_http_server.url}/tokenize", json={"model": "qv", "prompt": "Once"}, timeout=30)
    assert tokens.status_code == 200 and tokens.json()["count"] > 0


def test_load_use_unload_404_reload(
    lora_http_server: Server, lora_client: openai.OpenAI, http_adapters: Adapters
) -> None:
    path = http_adapters.paths["mlp"]
    reply = load(lora_http_server, "mlp", path)
    assert (reply.status_code, reply.text) == (200, "Success: LoRA adapter 'mlp' added successfully.")
    assert reply.headers["content-type"].startswith("text/plain")
    assert {m.id: m.model_dump()["parent"] for m in lora_client.models.list().data}["mlp"] == "tiny"
    assert [complete(lora_client, name, PROMPTS[1]) for name in ("mlp", "qv", "all", "mlp")] == [
        http_adapters.expected[name][1] for name in ("mlp", "qv", "all", "mlp")
    ]
    # A fourth adapter over three device slots: its requests wait for a slot, the others go on.
    assert load(lora_http_server, "qv-copy", http_adapters.paths["qv"]).status_code == 200
    served = ["mlp", "qv", "all", "qv-copy"] * 2
    with ThreadPoolExecutor(len(served)) as pool:
        got = list(pool.map(lambda name: complete(lora_client, name, PROMPTS[0]), served))
    assert got == [http_adapters.expected[name.removesuffix("-copy")][0] for name in served]
    assert admin(lora_http_server, "unload", lora_name="qv-copy").status_code == 200
    reply = admin(lora_http_server, "unload", lora_name="mlp")
    assert (reply.status_code, reply.text) == (200, "Success: LoRA adapter 'mlp' removed successfully.")
    with pytest.raises(openai.NotFoundError) as err:
        complete(lora_client, "mlp", PROMPTS[1])
    assert err.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert "mlp" not in {m.id for m in lora_client.models.list().data}
    again = admin(lora_http_server, "unload", lora_name="mlp")
    assert again.status_code == 404 and again.json()["error"]["code"] == "model_not_found"
    assert load(lora_http_server, "mlp", path).status_code == 200
    assert complete(lora_client, "mlp", PROMPTS[0]) == http_adapters.expected["mlp"][0]
    assert admin(lora_http_server, "unload", lora_name="mlp").status_code == 200


@pytest.mark.parametrize("case", ["rank_too_large", "wrong_base", "missing_file", "corrupt"])
def test_a_bad_adapter_is_a_400_and_everything_else_keeps_serving(
    case: str, lora_http_server: Server, lora_client: openai.OpenAI, http_adapters: Adapters
) -> None:
    reply = load(lora_http_server, f"bad-{case}", http_adapters.bad[case])
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if case == "rank_too_large":
        assert error["code"] == "lora_rank_too_large" and "--max-lora-rank" in error["message"]
    assert f"bad-{case}" not in {m.id for m in lora_client.models.list().data}
    base_still_serves(lora_client, http_adapters)
    assert complete(lora_client, "qv", PROMPTS[0]) == http_adapters.expected["qv"][0]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"lora_name": "qv", "lora_path": "/anywhere"}, "lora_name"),  # already loaded
        ({"lora_name": "a,b", "lora_path": "/anywhere"}, "lora_name"),  # would break the metric's list
        ({"lora_name": "tiny", "lora_path": "/anywhere"}, "lora_name"),  # the base model's own name
        ({"lora_name": "x", "lora_path": "/nowhere/at/all"}, None),
        ({"lora_name": "x"}, "lora_path"),
    ],
)
def test_bad_load_requests(
    body: dict[str, str],
    param: str | None,
    lora_http_server: Server,
    lora_client: openai.OpenAI,
    http_adapters: Adapters,
) -> None:
    reply = httpx.post(f"{lora_http_server.url}/v1/load_lora_adapter", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    if param is not None:
        assert reply.json()["error"]["param"] == param
    base_still_serves(lora_client, http_adapters)


def test_an_unknown_adapter_is_a_404_on_every_route(lora_http_server: Server, lora_client: openai.OpenAI) -> None:
    for call in (
        lambda: lora_client.completions.create(model="nope", prompt="Hi", max_tokens=2),
        lambda: lora_client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}]),
    ):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.body["code"] == "model_not_found"  # type: ignore[index]
    for route, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [5]})):
        reply = httpx.post(lora_http_server.url + route, json={**body, "model": "nope"}, timeout=30)
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"


def test_requests_keep_being_served_while_an_adapter_loads(
    lora_http_server: Server, lora_client: openai.OpenAI, http_adapters: Adapters
) -> None:
    control = lora_http_server.control_dir
    assert control is not None
    in_flight: list[list[int]] = []
    request = threading.Thread(target=lambda: in_flight.append(complete(lora_client, "qv", PROMPTS[0])))
    replies: list[httpx.Response] = []
    loading = threading.Thread(target=lambda: replies.append(load(lora_http_server, "mlp", http_adapters.paths["mlp"])))
    (control / "hold_lora_read").touch()
    try:
        with lora_http_server.holding():
            request.start()
            lora_http_server.wait_held(1)  # a request mid-generation in the engine before the load starts
            loading.start()
            while not (control / "reading_lora").exists():  # the load is now inside its file read
                loading.join(0.05)
                assert loading.is_alive(), replies
        request.join(60)
        assert in_flight == [http_adapters.expected["qv"][0]]
        base_still_serves(lora_client, http_adapters)
        assert complete(lora_client, "all", PROMPTS[1]) == http_adapters.expected["all"][1]
        assert loading.is_alive() and not replies  # all of that while the load was still held mid-read
    finally:
        (control / "hold_lora_read").unlink()
        (control / "reading_lora").unlink(missing_ok=True)
        loading.join(60)
    assert replies[0].status_code == 200, replies[0].text
    assert complete(lora_client, "mlp", PROMPTS[1]) == http_adapters.expected["mlp"][1]
    assert admin(lora_http_server, "unload", lora_name="mlp").status_code == 200


def lora_info(server: Server) -> list[tuple[dict[str, str], float]]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == names.LORA_REQUESTS_INFO)
    assert family.type == "gauge"
    return [(s.labels, s.value) for s in family.samples]


def current(server: Server) -> dict[str, str]:
    return max(lora_info(server), key=lambda item: item[1])[0]


def lora_counts(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == names.LORA_REQUESTS)
    return {s.labels[names.LORA_ADAPTER_LABEL]: s.value for s in family.samples if s.name.endswith("_total")}


def wait_for(server: Server, running: str, waiting: str) -> None:
    for _ in range(600):
        labels = current(server)
        if (labels[names.LORA_RUNNING_ADAPTERS_LABEL], labels[names.LORA_WAITING_ADAPTERS_LABEL]) == (running, waiting):
            return
        threading.Event().wait(0.05)
    raise AssertionError(f"lora_requests_info never showed running={running!r} waiting={waiting!r}: {current(server)}")


def test_the_gateway_metric_follows_running_and_waiting_adapters(
    lora_http_server: Server, lora_client: openai.OpenAI, http_adapters: Adapters
) -> None:
    before = lora_counts(lora_http_server)
    done: list[list[int]] = []

    def run(model: str) -> None:
        done.append(complete(lora_client, model, PROMPTS[0]))

    threads = [threading.Thread(target=run, args=(m,)) for m in ("qv", "all", "tiny")]
    lora_http_server.pause()
    try:
        for thread in threads:
            thread.start()
        wait_for(lora_http_server, "", "all,qv")  # added, not scheduled: waiting (the base request is not listed)
        lora_http_server.hold()  # before the pause ends, so no request can finish before the hold catches it
    finally:
        lora_http_server.pause(False)
    try:
        lora_http_server.wait_held(3)
        wait_for(lora_http_server, "all,qv", "")
        assert current(lora_http_server)[names.LORA_MAX_LORA_LABEL] == "3"
    finally:
        lora_http_server.hold(False)
    for thread in threads:
        thread.join(60)
    assert sorted(done) == sorted([http_adapters.expected[m][0] for m in ("qv", "all", None)])
    wait_for(lora_http_server, "", "")
    busy = [labels for labels, _ in lora_info(lora_http_server) if labels[names.LORA_RUNNING_ADAPTERS_LABEL]]
    assert len(lora_info(lora_http_server)) <= 2 and busy  # idle now; the last busy set is still there
    after = lora_counts(lora_http_server)
    assert (after["qv"] - before.get("qv", 0), after["all"] - before.get("all", 0)) == (1, 1)
    assert "tiny" not in after


def test_unloading_lets_admitted_requests_finish(
    lora_http_server: Server, lora_client: openai.OpenAI, http_adapters: Adapters
) -> None:
    assert load(lora_http_server, "mlp", http_adapters.paths["mlp"]).status_code == 200
    done: list[list[int]] = []
    thread = threading.Thread(target=lambda: done.append(complete(lora_client, "mlp", PROMPTS[0])))
    with lora_http_server.holding():
        thread.start()
        lora_http_server.wait_held(1)
        assert admin(lora_http_server, "unload", lora_name="mlp").status_code == 200
        with pytest.raises(openai.NotFoundError):
            complete(lora_client, "mlp", PROMPTS[1])
    thread.join(60)
    assert done == [http_adapters.expected["mlp"][0]]


def test_an_hf_source_is_fetched_into_the_lora_dir(
    lora_http_server: Server, lora_client: openai.OpenAI, http_adapters: Adapters, adapter_cache: Path
) -> None:
    reply = load(lora_http_server, "from-hub", f"hf://{REPO}")
    assert reply.status_code == 200, reply.text
    roots = {m.id: m.root for m in lora_client.models.list().data}
    assert roots["from-hub"] == str(adapter_cache / "hf" / REPO / "main")
    assert complete(lora_client, "from-hub", PROMPTS[0]) == http_adapters.expected["qv"][0]
    assert admin(lora_http_server, "unload", lora_name="from-hub").status_code == 200
    for path in ("s3://bucket/../adapter", "gs://bucket/adapter", "hf://just-a-name"):  # s3:// fetches: test_lora_s3
        reply = load(lora_http_server, "elsewhere", path)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "lora_path", reply.text
    assert "s3://bucket/prefix" in load(lora_http_server, "elsewhere", "gs://bucket/adapter").json()["error"]["message"]


def test_a_server_without_the_runtime_flag_has_no_load_endpoints(server: Server) -> None:
    for action in ("load", "unload"):
        reply = admin(server, action, lora_name="x", lora_path="/x")
        assert reply.status_code == 404 and reply.json()["error"]["type"] == "not_found_error"


def test_a_lora_module_that_fails_stops_the_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(RuntimeError) as err:
        start_server(tiny_model_dir, tmp_path, "--enable-lora", "--lora-modules", f"broken={broken}")
    message = str(err.value)
    assert "exited with 1" in message and f"--lora-modules broken={broken}" in message


def test_lora_families_are_exported(lora_http_server: Server) -> None:
    text = httpx.get(f"{lora_http_server.url}/metrics", timeout=30).text
    kinds = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert kinds[names.LORA_REQUESTS_INFO] == "gauge" and kinds[names.LORA_REQUESTS] == "counter"
    assert kinds[names.LORA_ADAPTERS_LOADED] == "gauge"
