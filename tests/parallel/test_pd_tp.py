"""P/D disaggregation with tensor/pipeline parallelism: every prefill rank pushes its own KV slab's pieces.

Greedy outputs of a disaggregated pair must equal a unified single-process engine's, for the same TP on both
sides and for layouts where heads or layers regroup (prefill tp 2 -> decode tp 1, tp 1 -> tp 2, tp 2 -> decode
pp 2, prefill pp 2 -> decode tp 2). One torch.distributed group per process: the prefill engines run in this
process (the tp 2 one is the only parallel engine here) except the pp 2 one, the decode engines as `tidepool
serve --role decode` subprocesses reached over HTTP, as the router reaches them. After each pair's requests
every block pool is free again (the workers' slabs were filled into blocks, not left behind), and a transfer
refused by the decode engine tells the prefill side which ranks are missing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tidepool.engine import SamplingParams
from tidepool.engine.engine_config import EngineConfig
from tidepool.engine.kv_transfer import KVTransferError, ProducerParams
from tidepool.engine.llm_engine import LLMEngine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
from serve_proc import Server, start_server

pytestmark = pytest.mark.slow

PROMPTS = [
    "The quick brown fox jumps over the lazy dog and keeps running",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a king who had three daughters and",
    "a",
]
MAX_TOKENS = 10
ENGINE = dict(dtype="float32", block_size=8, max_model_len=256, num_kv_blocks=64, show_progress=False)
FLAGS = ("--device", "cpu", "--dtype", "float32", "--block-size", "8", "--max-model-len", "256",
         "--num-kv-blocks", "64", "--kv-transfer-timeout", "20")  # fmt: skip


def _run(engine: LLMEngine) -> dict[str, str]:
    done: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].text
    return done


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> list[str]:
    unified = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", **ENGINE))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        unified.add_request(f"r{i}", prompt, params)
    done = _run(unified)
    unified.close()
    return [done[f"r{i}"] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def prefills(tiny_model_dir: Path) -> Iterator[dict[str, LLMEngine]]:
    def config(tp: int) -> EngineConfig:
        return EngineConfig(model=str(tiny_model_dir), device="cpu", role="prefill", kv_port=0,
                            tensor_parallel_size=tp, **ENGINE)  # fmt: skip

    engines = {name: LLMEngine(config(tp)) for name, tp in (("tp1", 1), ("tp2", 2))}
    yield engines
    for engine in engines.values():
        engine.close()


@pytest.fixture(scope="module")
def decodes(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Server, int]]]:
    log_dir = tmp_path_factory.mktemp("pd-tp-logs")
    started: dict[str, tuple[Server, int]] = {}
    try:
        for name, parallel in (("tp2", ("--tensor-parallel-size", "2")), ("tp1", ()),
                               ("pp2", ("--pipeline-parallel-size", "2"))):  # fmt: skip
            # --kv-port 0: the driver and each worker rank listen on any free port (else --kv-port + rank).
            server = start_server(tiny_model_dir, log_dir, "--role", "decode", "--kv-port", "0", *FLAGS, *parallel)
            started[name] = (server, _kv_port(server))
        yield started
    finally:
        for server, _ in started.values():
            server.stop()


def _kv_port(server: Server) -> int:
    """The decode driver's KV port, as its log announces it (it was started with --kv-port 0)."""
    for line in server.log().splitlines():
        if "KV transfers for this engine on port" in line:
            return int(line.split("on port ", 1)[1].split()[0])
    raise AssertionError(f"the decode server announced no KV port:\n{server.log()}")


def _handoff(prefill: LLMEngine, decode: Server, kv_port: int, tag: str) -> list[str]:
    addr = f"127.0.0.1:{kv_port}"
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        prefill.add_request(f"{tag}-{i}", prompt, first, kv_transfer=ProducerParams(f"{tag}-{i}", addr))
    _run(prefill)
    texts = []
    for i, prompt in enumerate(PROMPTS):
        prefill.kv_connector.sender.wait_sent(f"{tag}-{i}")
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "kv_transfer_params": {"role": "consumer", "transfer_id": f"{tag}-{i}"}}  # fmt: skip
        resp = httpx.post(f"{decode.api}/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        texts.append(resp.json()["choices"][0]["text"])
    return texts


@pytest.mark.parametrize(
    ("prefill_name", "decode_name"),
    [("tp2", "tp2"), ("tp2", "tp1"), ("tp1", "tp2"), ("tp2", "pp2")],
    ids=["tp2-to-tp2", "tp2-to-tp1", "tp1-to-tp2", "tp2-to-pp2"],
)
def test_disaggregated_parallel_output_equals_unified(
    prefills: dict[str, LLMEngine],
    decodes: dict[str, tuple[Server, int]],
    expected: list[str],
    prefill_name: str,
    decode_name: str,
) -> None:
    prefill = prefills[prefill_name]
    decode, kv_port = decodes[decode_name]
    assert _handoff(prefill, decode, kv_port, f"{prefill_name}-{decode_name}") == expected
    decode.wait_pool_free()
    assert prefill.kv_cache.num_free_blocks == prefill.num_kv_blocks


def test_a_missing_rank_is_named_and_nothing_is_left_behind(
    prefills: dict[str, LLMEngine], decodes: dict[str, tuple[Server, int]]
) -> None:
    """Only the driver's pieces and manifest arrive (its worker never sends): the manifest is refused, naming rank 1."""
    import torch

    from tidepool.engine.kv_transfer import KVLayout, Manifest
    from tidepool.engine.kv_transfer.sender import KVSender

    decode, kv_port = decodes["tp2"]
    prefill = prefills["tp1"]
    mc = prefill.model_config
    # A sender that claims to be rank 0 of a tp 2 prefill engine: it holds and sends head 0 only.
    layout = KVLayout(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, 8, "float32", tp=2)
    sender = KVSender(layout, rank=0, timeout_s=30)
    kv = torch.zeros(mc.num_hidden_layers, 2, 1, 8, 1, mc.head_dim)
    future = sender.send(f"127.0.0.1:{kv_port}", "lonely", kv, Manifest("lonely", [5, 6, 7], 9, 1))
    with pytest.raises(KVTransferError, match=r"decode ranks \[1\] did not receive"):
        sender.wait_sent("lonely")
    assert future.done()
    sender.close()
    decode.wait_pool_free()


def test_pipeline_parallel_prefill_server_hands_off_to_tensor_parallel_decode(
    tiny_model_dir: Path,
    tmp_path: Path,
    decodes: dict[str, tuple[Server, int]],
    expected: list[str],
) -> None:
    """Layers regroup on the sending side too: prefill stages 0 and 1 each push their layer to both decode ranks.
    Both engines are `tidepool serve` processes driven over HTTP, as the router drives them."""
    prefill = start_server(tiny_model_dir, tmp_path, "--role", "prefill", "--pipeline-parallel-size", "2", *FLAGS)
    decode, kv_port = decodes["tp2"]
    try:
        for i, prompt in enumerate(PROMPTS):
            tid = f"pp2-tp2-{i}"
            first = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {
                "role": "producer", "transfer_id": tid, "decode_kv_addr": f"127.0.0.1:{kv_port}"}}  # fmt: skip
            resp = httpx.post(f"{prefill.api}/completions", json=first, timeout=60)
            assert resp.status_code == 200, resp.text
            assert resp.json()["kv_transfer_params"]["status"] == "sent"
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                    "kv_transfer_params": {"role": "consumer", "transfer_id": tid}}  # fmt: skip
            resp = httpx.post(f"{decode.api}/completions", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == expected[i]
        prefill.wait_pool_free()
        decode.wait_pool_free()
    finally:
        prefill.stop()
