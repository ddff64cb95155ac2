"""`LLM(quantization=...)`, `tidepool serve --quantization`: check a quantized folder or quantize a dense one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidepool.engine import LLM, SamplingParams
from tidepool.engine.quant.cli import quantize_folder
from tidepool.engine.quant.load import read_quant_spec
from tidepool.engine.quant.prepare import prepare_quantized


def test_dense_folder_is_quantized_once_and_cached(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TIDEPOOL_QUANT_CACHE", str(tmp_path / "cache"))
    first = prepare_quantized(str(tiny_model_dir), "int8")
    assert first != str(tiny_model_dir)
    assert read_quant_spec(Path(first)).kind == "tidepool-int8"
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
