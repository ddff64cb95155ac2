"""quantization="gguf": Q4_0/Q4_1 stay 4-bit (Tidepool int4, mins form) exactly; Q8_0 becomes int8.

The kept int4 weights must stand for exactly the values the dense path dequantizes (same codes,
scales and mins: no rounding anywhere), the model must shrink, and its logits must match the dense
model's up to float summation order. Mixed files (parts of one fused projection in different types)
fall back as documented: side by side when all parts can be kept, dense when one cannot. On CPU the
engine's one-call decode step reads the kept int4 and int8 weights and gives what the layers give, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_files import hf_to_gguf

from decoder_steps import count_decoder_steps
from tidepool.engine import LLM, SamplingParams, cpu_ops
from tidepool.engine.loading.loader import load_model
from tidepool.engine.quant.perplexity import prefill_logits
from tidepool.engine.quant.runtime import ConcatWeight, Int4Weight, Int8Weight, weight_bytes
from tidepool.kernels.int4_packing import dequantize_int4

PROJECTIONS = ("self_attn.qkv_weight", "self_attn.o_weight", "mlp.gate_up_weight", "mlp.down_weight")


def _owner_attr(model: torch.nn.Module, name: str) -> object:
    owner, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(owner), attr)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-tied"])
def test_q4_kept_as_int4_is_exact(variant: str, type_name: str, gguf_model) -> None:
    file = gguf_model(variant, type_name)
    dense, config = load_model(file, show_progress=False)
    kept, _ = load_model(file, show_progress=False, quantization="gguf")
    dense_params = dict(dense.named_parameters())
    for layer in range(config.num_hidden_layers):
        for proj in PROJECTIONS:
            name = f"layers.{layer}.{proj}"
            weight = _owner_attr(kept, name)
            assert isinstance(weight, Int4Weight) and weight.group_size == 32 and weight.zeros is None
            assert weight.scales.dtype == weight.mins.dtype == torch.float16  # the file's own precision
            values = dequantize_int4(weight.qweight, weight.scales, None, 32, torch.float32, mins=weight.mins)
            assert torch.equal(values.t(), dense_params[name]), name
    assert weight_bytes(kept) < weight_bytes(dense) * 0.6
    ids = torch.tensor([5, 17, 99, 3, 250, 8, 8, 41])
    torch.testing.assert_close(prefill_logits(kept, ids), prefill_logits(dense, ids), rtol=1e-4, atol=1e-4)


def test_q8_0_kept_as_int8_within_half_a_step(gguf_model) -> None:
    file = gguf_model("llama-gqa", "Q8_0")
    dense, _ = load_model(file, show_progress=False)
    kept, _ = load_model(file, show_progress=False, quantization="gguf")
    dense_params = dict(dense.named_parameters())
    for proj in PROJECTIONS:
        name = f"layers.1.{proj}"
        weight = _owner_attr(kept, name)
        assert isinstance(weight, Int8Weight)
        error = (weight.w_int8.float() * weight.scales[:, None].float() - dense_params[name]).abs()
        assert bool((error <= weight.scales[:, None].float() / 2 * (1 + 1e-5)).all()), name
    ids = torch.tensor([5, 17, 99, 3, 250, 8])
    torch.testing.assert_close(prefill_logits(kept, ids), prefill_logits(dense, ids), rtol=0.05, atol=0.05)


def _mixed(name: str, shape: tuple[int, ...]) -> str:
    if len(shape) != 2:
        return "F32"
    kinds = {"attn_q": "Q4_1", "attn_k": "Q8_0", "attn_v": "Q4_0", "attn_output": "Q4_1", "ffn_up": "F16"}
    return next((kind for part, kind in kinds.items() if f".{part}." in name), "Q4_0")


def test_mixed_types_in_one_fused_projection(hf_model_dir, tmp_path: Path) -> None:
    file = hf_to_gguf(hf_model_dir("llama-gqa"), tmp_path / "mixed.gguf", _mixed)
    dense, _ = load_model(file, show_progress=False)
    kept, _ = load_model(file, show_progress=False, quantization="gguf")
    qkv = _owner_attr(kept, "layers.0.self_attn.qkv_weight")
    assert isinstance(qkv, ConcatWeight)  # q and v as int4, k as int8: one module per layout
    assert [type(p) for p in qkv.parts] == [Int4Weight, Int8Weight, Int4Weight]
    assert isinstance(_owner_attr(kept, "layers.0.self_attn.o_weight"), Int4Weight)
    # up is F16, so gate/up stays dense although gate is Q4_0.
    assert isinstance(_owner_attr(kept, "layers.0.mlp.gate_up_weight"), torch.nn.Parameter)
    ids = torch.tensor([5, 17, 99, 3, 250, 8])
    torch.testing.assert_close(prefill_logits(kept, ids), prefill_logits(dense, ids), rtol=0.05, atol=0.05)


def test_engine_runs_kept_and_quantized_at_load(gguf_model) -> None:
    file = gguf_model("llama-gqa", "Q4_1")
    engine = dict(device="cpu", num_kv_blocks=64, max_model_len=256, show_progress=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for quantization in ("gguf", "int8", "int4"):
        llm = LLM(str(file), quantization=quantization, **engine)
        out = llm.generate([[5, 17, 99]], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
    # int4 at load: K = 64 takes 64-wide groups, K = 160 (down) 80-wide: 128 divides neither.
    layer = llm.engine.model.layers[0]
    assert (layer.self_attn.qkv_weight.group_size, layer.mlp.down_weight.group_size) == (64, 80)


def test_quantization_methods_that_do_not_fit_are_refused(gguf_model, hf_model_dir, tmp_path: Path) -> None:
    from tidepool.engine.loading.quantized_copy import quantize_folder

    with pytest.raises(ValueError, match=r"is a GGUF file; `tidepool quantize` converts Hugging Face folders"):
        quantize_folder(gguf_model("llama-gqa", "F32"), tmp_path / "out", "int8")
    with pytest.raises(ValueError, match="is a GGUF file, not a GPTQ checkpoint"):
        LLM(str(gguf_model("llama-gqa", "Q4_1")), quantization="gptq", show_progress=False)
    with pytest.raises(ValueError, match=r"but .* is a Hugging Face folder"):
        LLM(str(hf_model_dir("llama-gqa")), quantization="gguf", show_progress=False)


@pytest.mark.parametrize(
    ("variant", "type_name", "step_runs"),
    [
        ("llama-gqa", "Q4_1", True),
        ("qwen2-tied", "Q4_1", True),
        ("llama-headdim24-linearrope", "Q4_1", False),
        ("llama-gqa", "Q8_0", True),
        ("llama-headdim24-linearrope", "Q8_0", True),
    ],
)
def test_quantized_decode_step_is_the_layers_bit_for_bit(
    variant: str, type_name: str, step_runs: bool, gguf_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU the kept Q4 weights are tiled for the compiled int4 op and Q8_0's int8 weights get float32 scales for
    the compiled GEMV, and the one-call decode step reads both (int4_tile.h, gemv.h in both): greedy tokens and
    logprobs are identical, bit for bit, with the step on and off (the layers then call the ops one projection at
    a time). A head_dim of 24 is no whole number of 16-column int4 tiles: the step refuses those weights and the
    layers run; int8 rows have no such constraint."""
    for env in (cpu_ops.MODE_ENV, cpu_ops.GEMV_MODE_ENV, cpu_ops.FUSED_MODE_ENV, cpu_ops.INT4_MODE_ENV):
        monkeypatch.setenv(env, "compiled")
    ran = count_decoder_steps(monkeypatch)
    file = gguf_model(variant, type_name)
    # 25 sequences: the int4 tiles take inputs four at a time (steps of 25 run seven passes per tile); the
    # int8 rows go through the packed-panel kernel (24 inputs and more; passes of 5).
    prompts = [[5, 17, 99], [3, 250, 8, 8, 41, 7, 7], [11] * 20, [300, 2, 9], [42] * 5, [7, 1, 400, 33]]
    prompts += [[9, 9, 120], [64] * 11, [2, 3, 5, 7, 11, 13], [77], [18, 260, 4, 4]]
    prompts += [[8, 6, 4], [150] * 7, [21, 22, 23, 24], [5], [310, 12], [99, 98, 97, 96, 95]]
    prompts += [[13, 14], [200] * 9, [31, 41, 59], [6], [444, 4, 44], [12] * 6, [88, 1], [3, 3, 3, 30]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    results = []
    for mode in ("compiled", "torch"):
        monkeypatch.setenv(cpu_ops.DECODER_MODE_ENV, mode)
        cpu_ops.reset()
        llm = LLM(str(file), quantization="gguf", num_kv_blocks=64, max_model_len=256, show_progress=False)
        qkv = llm.engine.model.layers[0].self_attn.qkv_weight
        if type_name == "Q8_0":
            assert isinstance(qkv, Int8Weight) and qkv.scales.dtype == torch.float32 and qkv.cpu_int8() is not None
        else:
            assert isinstance(qkv, Int4Weight) and qkv.tiled
        out = llm.generate(prompts, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out])
        if mode == "compiled":
            assert (ran["ran"] > 0) == step_runs
            assert ran["widest"] == (len(prompts) if step_runs else 0)  # all of them in one step
    cpu_ops.reset()
    assert results[0] == results[1]
