"""Adapters with the engine's other features, each against PEFT on transformers (greedy, tiny model).

Chunked prefill with preemption (a tiny KV cache and token budget), speculative decoding (ngram and
suffix proposers: the target verifies with the adapters), the P/D KV hand-off (the adapter name travels
with the KV; a decode request for another adapter is refused), and int8/int4 base weights (the reference
is PEFT on the engine's own dequantized base weights: the LoRA delta is independent of the base format).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lora_helpers import base_model, engine_tokens, expected_tokens, greedy, greedy_params, prompts

from tidepool.engine import LLM
from tidepool.engine.cuda_graphs import EagerReplayBackend
from tidepool.engine.engine_config import EngineConfig
from tidepool.engine.kv_transfer import ProducerParams
from tidepool.engine.llm_engine import LLMEngine
from tidepool.engine.lora.types import LoRARequest
from tidepool.engine.model_runner import ModelRunner

NUM_NEW = 8


def _requests(adapters: dict, count: int) -> list[LoRARequest | None]:
    names = [None, *sorted(adapters)]
    return [None if (n := names[i % len(names)]) is None else LoRARequest(n, str(adapters[n][0])) for i in range(count)]


def test_chunked_prefill_and_preemption(tiny_model_dir: Path, lora_adapters: dict) -> None:
    batch = prompts(3, [70, 41, 66, 30, 55, 12, 63, 48])
    requests = _requests(lora_adapters, len(batch))
    llm = LLM(str(tiny_model_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              max_num_batched_tokens=24, num_kv_blocks=10, max_model_len=128, show_progress=False)  # fmt: skip
    expected = expected_tokens(tiny_model_dir, lora_adapters, batch, requests, NUM_NEW)
    assert engine_tokens(llm, batch, requests, NUM_NEW) == expected
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_speculative_decoding_verifies_with_adapters(tiny_model_dir: Path, lora_adapters: dict, method: str) -> None:
    """The draft (here the base model itself) ignores adapters; the target verifies with them."""
    batch = [p * 4 for p in prompts(5, [6, 9, 7, 5])]  # repetitive: the proposers find n-grams to propose
    requests = _requests(lora_adapters, len(batch))
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft":
        spec["draft_model"] = str(tiny_model_dir)
    llm = LLM(str(tiny_model_dir), dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16,
              speculative_config=spec, show_progress=False)  # fmt: skip
    expected = expected_tokens(tiny_model_dir, lora_adapters, batch, requests, NUM_NEW)
    assert engine_tokens(llm, batch, requests, NUM_NEW) == expected
    assert llm.engine.get_stats().spec_num_draft_tokens > 0


def _pd_engine(model: Path, role: str) -> LLMEngine:
    config = EngineConfig(model=str(model), dtype="float32", role=role, kv_port=0, num_kv_blocks=64,
                          max_model_len=256, block_size=8, enable_lora=True, max_loras=2, max_lora_rank=16,
                          show_progress=False)  # fmt: skip
    return LLMEngine(config)


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def test_pd_handoff_carries_the_adapter(tiny_model_dir: Path, lora_adapters: dict) -> None:
    prefill, decode = _pd_engine(tiny_model_dir, "prefill"), _pd_engine(tiny_model_dir, "decode")
    try:
        for engine in (prefill, decode):
            for name in ("qv", "mlp"):
                engine.lora.register(engine.lora.read(name, str(lora_adapters[name][0])))
        batch, names = prompts(9, [5, 19, 11]), ["qv", None, "mlp"]
        addr = f"127.0.0.1:{decode.kv_connector.port}"
        params = greedy_params(NUM_NEW)
        payloads = {}
        for i, (prompt, name) in enumerate(zip(batch, names, strict=True)):
            first = dataclasses.replace(params, max_tokens=1)
            prefill.add_request(f"r{i}", prompt, first, kv_transfer=ProducerParams(f"t{i}", addr), lora_name=name)
            _run(prefill)
            prefill.kv_connector.sender.wait_sent(f"t{i}")
            payloads[i] = decode.kv_connector.receiver.take(f"t{i}", timeout_s=10)
            assert payloads[i].lora_name == name
        with pytest.raises(ValueError, match="prefilled with adapter 'qv'"):
            decode.add_request("wrong", batch[0], params, kv_transfer=payloads[0], lora_name="mlp")
        for i, (prompt, name) in enumerate(zip(batch, names, strict=True)):
            decode.add_request(f"r{i}", prompt, params, kv_transfer=payloads[i], lora_name=name)
        got = _run(decode)
        hf = base_model(tiny_model_dir)
        expected = {f"r{i}": greedy(hf if n is None else lora_adapters[n][1], p, NUM_NEW)
                    for i, (p, n) in enumerate(zip(batch, names, strict=True))}  # fmt: skip
        assert got == expected
        assert decode.last_stats.step_num_prompt_tokens == 0
    finally:
        prefill.close()
        decode.close()


def _dequantized_reference(llm: LLM, base: Path) -> torch.nn.Module:
    """transformers' model carrying the engine's own (dequantized) base weights: W = linear(I, W_quantized).T."""
    hf = base_model(base)
    config = llm.engine.model_config
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    with torch.no_grad():
        for ours, theirs in zip(llm.engine.model.layers, hf.model.layers, strict=True):

            def dense(weight: torch.Tensor) -> torch.Tensor:
                return F.linear(torch.eye(weight.shape[1]), weight).t()

            qkv, gate_up = dense(ours.self_attn.qkv_weight), dense(ours.mlp.gate_up_weight)
            attn, mlp = theirs.self_attn, theirs.mlp
            attn.q_proj.weight.copy_(qkv[:q]), attn.k_proj.weight.copy_(qkv[q : q + kv])
            attn.v_proj.weight.copy_(qkv[q + kv :]), attn.o_proj.weight.copy_(dense(ours.self_attn.o_weight))
            mlp.gate_proj.weight.copy_(gate_up[:inter]), mlp.up_proj.weight.copy_(gate_up[inter:])
            mlp.down_proj.weight.copy_(dense(ours.mlp.down_weight))
    return hf


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_base_weights(
    tiny_model_dir: Path, lora_adapters: dict, quantization: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peft import PeftModel

    monkeypatch.setenv("TIDEPOOL_QUANT_CACHE", str(tmp_path / "cache"))
    llm = LLM(str(tiny_model_dir), quantization=quantization, dtype="float32", enable_lora=True, max_loras=3,
              max_lora_rank=16, num_kv_blocks=64, max_model_len=256, show_progress=False)  # fmt: skip
    batch = prompts(4, [7, 20, 3, 33])
    requests = _requests(lora_adapters, len(batch))
    reference = {n: (path, PeftModel.from_pretrained(_dequantized_reference(llm, tiny_model_dir), path).eval())
                 for n, (path, _) in lora_adapters.items()}  # fmt: skip
    expected = expected_tokens(_dequantized_reference(llm, tiny_model_dir), reference, batch, requests, NUM_NEW)
    assert engine_tokens(llm, batch, requests, NUM_NEW) == expected


def test_decode_graphs_replay_only_steps_without_adapter_tokens(tiny_model_dir: Path, lora_adapters: dict) -> None:
    """A captured decode graph holds no LoRA: steps with adapter tokens run eagerly, base-only steps replay."""
    llm = LLM(str(tiny_model_dir), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
              num_kv_blocks=64, max_model_len=128, block_size=8, show_progress=False)  # fmt: skip
    engine = llm.engine
    engine.runner = ModelRunner(engine.model, engine.model_config, 8, engine.num_kv_blocks, engine.sampler,
                                torch.device("cpu"), graph_backend=EagerReplayBackend(), max_model_len=128)  # fmt: skip
    engine.runner.serves_lora = True
    batch = prompts(6, [4, 9, 13, 6])
    requests = _requests(lora_adapters, len(batch))
    expected = expected_tokens(tiny_model_dir, lora_adapters, batch, requests, NUM_NEW)
    assert engine_tokens(llm, batch, requests, NUM_NEW) == expected  # decode steps mix adapters: eager
    base_only = [None] * len(batch)
    base_expected = expected_tokens(tiny_model_dir, lora_adapters, batch, base_only, NUM_NEW)
    assert engine_tokens(llm, batch, base_only, NUM_NEW) == base_expected
    assert sum(engine.runner.graphs.stats.num_replays.values()) > 0  # the base-only decode steps replayed
