"""Per-shape weight layout: wide projections stored [in, out] on CPU, values, shapes, ties and outputs kept."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from tidepool.engine.layers.attention_metadata import AttentionMetadata, PrefillChunk
from tidepool.engine.layers.weight_layout import apply_weight_layout, is_input_major, prefers_input_major
from tidepool.engine.loading.loader import load_model

BLOCK = 16


def _prefill_meta(num_tokens: int) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.arange(num_tokens),
        num_decode_seqs=0,
        decode_block_tables=torch.zeros(0, 0, dtype=torch.long),
        decode_mask=None,
        prefills=[PrefillChunk(0, num_tokens, num_tokens, torch.arange(-(-num_tokens // BLOCK)), None)],
    )


@torch.inference_mode()
def _logits(model: nn.Module, token_ids: list[int]) -> torch.Tensor:
    config = model.config
    num_blocks = -(-len(token_ids) // BLOCK)
    shape = (num_blocks, BLOCK, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
    ids = torch.tensor(token_ids)
    hidden = model(ids, torch.arange(len(ids)), caches, _prefill_meta(len(ids)))
    return model.compute_logits(hidden)


def test_rule_is_by_shape_and_dtype() -> None:
    assert prefers_input_major(3072, 576) and prefers_input_major(49152, 576)
    assert not prefers_input_major(576, 576) and not prefers_input_major(576, 1536)
    assert not prefers_input_major(3072, 576, torch.bfloat16) and not prefers_input_major(3072, 576, torch.float16)


def test_low_precision_models_keep_out_in(tiny_model_dir: Path) -> None:
    model, _ = load_model(tiny_model_dir, dtype=torch.bfloat16, show_progress=False)
    assert apply_weight_layout(model).converted == []


@pytest.mark.parametrize("variant", ["tiny", "llama-mqa-tied-llama3rope", "qwen2-tied"])
def test_layout_keeps_values_ties_and_outputs(
    variant: str, tiny_model_dir: Path, hf_model_dir: Callable[[str], Path]
) -> None:
    folder = tiny_model_dir if variant == "tiny" else hf_model_dir(variant)
    model, config = load_model(folder, dtype=torch.float32, show_progress=False)
    before = copy.deepcopy(model)
    report = apply_weight_layout(model)

    params = dict(model.named_parameters())
    originals = dict(before.named_parameters())
    assert set(params) == set(originals)  # nothing added or lost (a tied table stays one parameter)
    for name, param in params.items():
        assert param.shape == originals[name].shape and torch.equal(param, originals[name]), name
        assert is_input_major(param) == (name in report.converted), name
    expected = {
        name
        for name, p in originals.items()
        if p.dim() == 2
        and prefers_input_major(*p.shape)
        and (name.rsplit(".", 1)[-1] in {"qkv_weight", "gate_up_weight", "o_weight", "down_weight", "lm_head"}
             or (name == "embed_tokens" and config.tie_word_embeddings))
    }  # fmt: skip
    assert set(report.converted) == expected and any("qkv_weight" in n for n in expected)
    if config.tie_word_embeddings:
        assert model.lm_head_weight is model.embed_tokens and "embed_tokens" in report.converted
    else:
        assert "lm_head" in report.converted and not is_input_major(model.embed_tokens)
    assert apply_weight_layout(model).converted == []  # idempotent

    prompt = [3, 17, 42, 99, 5, 250, 7, 81, 64, 12, 400, 33, 1, 2, 8, 77, 150, 19]
    want, got = _logits(before, prompt), _logits(model, prompt)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_shared_parameter_is_converted_once_and_stays_shared() -> None:
    class Stage(nn.Module):  # a pipeline stage holding the tied table under both names
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Parameter(torch.randn(40, 8), requires_grad=False)
            self.lm_head = self.embed_tokens

    stage = Stage()
    report = apply_weight_layout(stage)
    assert report.converted == ["embed_tokens"] and stage.lm_head is stage.embed_tokens
    assert is_input_major(stage.lm_head)


def test_leaves_quantized_int_and_non_cpu_weights_alone() -> None:
    class Attn(nn.Module):
        def __init__(self, device: str) -> None:
            super().__init__()
            self.qkv_weight = nn.Parameter(torch.zeros(96, 32, device=device), requires_grad=False)
            self.o_weight = nn.Parameter(torch.zeros(32, 32, dtype=torch.int8), requires_grad=False)

    meta = Attn("meta")
    assert apply_weight_layout(meta).converted == []
    cpu = Attn("cpu")
    assert apply_weight_layout(cpu).converted == ["qkv_weight"]
    assert cpu.o_weight.is_contiguous()


def test_quantized_model_keeps_quantized_projections(tiny_model_dir: Path, tmp_path: Path) -> None:
    from tidepool.engine.loading.quantized_copy import quantize_folder
    from tidepool.engine.quant.runtime import QuantizedWeight

    folder = quantize_folder(tiny_model_dir, tmp_path / "int8", "int8")
    model, _ = load_model(folder, dtype=torch.float32, show_progress=False)
    prompt = [3, 17, 42, 99, 5, 250, 7]
    want = _logits(model, prompt)
    report = apply_weight_layout(model)
    assert all(isinstance(layer.self_attn.qkv_weight, QuantizedWeight) for layer in model.layers)
    assert report.converted == ["lm_head"]  # the dense LM head of this untied model
    torch.testing.assert_close(_logits(model, prompt), want, atol=1e-5, rtol=1e-5)
