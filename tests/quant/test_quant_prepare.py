"""`LLM(quantization=...)`, `tidepool serve --quantization`: check a quantized folder or quantize a dense one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidepool.engine import LLM, SamplingParams
from tidepool.engine.loading.formats import detect_format
from tidepool.engine.loading.prepare import prepare_quantized
from tidepool.engine.loading.quantized_copy import quantize_folder
from tidepool.engine.quant.perplexity import prefill_logits


def test_dense_folder_is_quantized_once_and_cached(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TIDEPOOL_QUANT_CACHE", str(tmp_path / "cache"))
    first = prepare_quantized(str(tiny_model_dir), "int8")
    assert first != str(tiny_model_dir)
    assert detect_format(first).name == "tidepool-int8"
    mtime = (Path(first) / "config.json").stat().st_mtime_ns
    assert prepare_quantized(str(tiny_model_dir), "int8") == first  # reused, not rewritten
    assert (Path(first) / "config.json").stat().st_mtime_ns == mtime
    assert prepare_quantized(str(tiny_model_dir), None) == str(tiny_model_dir)

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(tiny_model_dir), quantization="int8", dtype="float32", num_kv_blocks=64, max_model_len=256,
              show_progress=False)  # fmt: skip
    assert llm.engine.config.model == first and llm.engine.config.tokenizer == str(tiny_model_dir)
    out = llm.generate(["The quick brown fox"], params)[0].outputs[0]
    assert len(out.token_ids) == 8


def test_mismatched_or_impossible_methods_name_the_fix(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TIDEPOOL_QUANT_CACHE", str(tmp_path / "cache"))
    int4 = quantize_folder(tiny_model_dir, tmp_path / "int4", "int4", group_size=32)
    assert prepare_quantized(str(int4), "int4") == str(int4)
    with pytest.raises(ValueError, match="already quantized as tidepool-int4, not int8"):
        prepare_quantized(str(int4), "int8")
    with pytest.raises(ValueError, match="needs a GPTQ checkpoint"):
        prepare_quantized(str(tiny_model_dir), "gptq")
    with pytest.raises(ValueError, match="quantization must be one of"):
        prepare_quantized(str(tiny_model_dir), "fp8")


def test_int4_at_load_narrows_groups_where_128_does_not_divide(hf_model_dir, tmp_path: Path, monkeypatch) -> None:
    """Real models need this: SmolLM2's 576-wide hidden size is not a multiple of 128."""
    import torch

    monkeypatch.setenv("TIDEPOOL_QUANT_CACHE", str(tmp_path / "cache"))
    src = hf_model_dir("qwen2-tied")  # hidden 64, intermediate 160: 128 divides neither
    engine = dict(dtype="float32", num_kv_blocks=64, max_model_len=256, show_progress=False)
    dense, int4 = LLM(str(src), **engine), LLM(str(src), quantization="int4", **engine)
    folder = Path(int4.engine.config.model)
    assert detect_format(folder).quant.group_sizes == {64: 64, 160: 80}  # what the folder holds, per input width
    layer = int4.engine.model.layers[0]
    sizes = (layer.self_attn.qkv_weight.group_size, layer.self_attn.o_weight.group_size,
             layer.mlp.gate_up_weight.group_size, layer.mlp.down_weight.group_size)  # fmt: skip
    assert sizes == (64, 64, 64, 80)
    prompt = torch.tensor([1, 17, 99, 250, 3, 42, 7, 300, 5, 11, 400, 64, 8, 9, 10, 200])
    ref, got = prefill_logits(dense.engine.model, prompt), prefill_logits(int4.engine.model, prompt)
    assert 0 < float((got - ref).norm() / ref.norm()) < 0.4
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert len(int4.generate([[5, 17, 99]], params, use_tqdm=False)[0].outputs[0].token_ids) == 8
