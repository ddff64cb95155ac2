"""`tidepool sparsify` end to end on the tiny random model: the folder it writes, transformers on it, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tidepool.cli import main as tidepool_main
from tidepool.engine.sparsity.format import CONFIG_KEY, read_sparsity_config, validate
from tidepool.engine.sparsity.prune import cached_sparse_checkpoint, densify_folder, sparsify_folder
from tidepool.engine.sparsity.wanda import magnitude_mask

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
PROJECTIONS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FAST = ["--num-samples", "4", "--seq-len", "32", "--no-progress"]


def hf_model(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_logits(folder: Path, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(folder)(input_ids=input_ids).logits


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_sparsify_writes_the_documented_layout(tiny_model_dir: Path, tmp_path: Path, method: str) -> None:
    out = tmp_path / method
    assert tidepool_main(["sparsify", str(tiny_model_dir), str(out), "--method", method, *FAST]) == 0
    config = json.loads((out / "config.json").read_text())
    spec = read_sparsity_config(config)
    assert spec is not None and spec.method == method and spec.values_dtype == "float32"
    assert (spec.calibration["source"] is None) == (method == "magnitude")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / file).read_bytes() == (tiny_model_dir / file).read_bytes()
    tensors, source = load_file(out / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    for layer in range(2):
        for proj in PROJECTIONS:
            prefix = f"model.layers.{layer}.{proj}"
            assert f"{prefix}.weight" not in tensors
            validate(prefix, tensors[f"{prefix}.values"], tensors[f"{prefix}.meta"])
            assert tensors[f"{prefix}.values"].dtype == torch.float32
    for name, tensor in source.items():  # every other tensor unchanged
        if not name.endswith("_proj.weight"):
            assert torch.equal(tensors[name], tensor), name
    dense = densify_folder(out, tmp_path / f"{method}-dense")
    weights = load_file(dense / "model.safetensors")
    if method != "sparsegpt":  # the mask-only methods keep the surviving weights exactly
        name = "model.layers.1.mlp.down_proj.weight"
        kept = weights[name] != 0
        assert torch.equal(weights[name][kept], source[name][kept])
    if method == "magnitude":
        name = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(weights[name], source[name] * magnitude_mask(source[name]))
    assert CONFIG_KEY not in json.loads((dense / "config.json").read_text())
    logits = hf_logits(dense, torch.tensor([[1, 5, 9, 200, 33, 7]]))
    assert bool(torch.isfinite(logits).all())


def test_int8_values_carry_scales_and_stay_close_to_float(tiny_model_dir: Path, tmp_path: Path) -> None:
    float_dir = sparsify_folder(tiny_model_dir, tmp_path / "f", "wanda", num_samples=4, seq_len=32, show_progress=False)
    int8_dir = sparsify_folder(
        tiny_model_dir, tmp_path / "q", "wanda", "int8", num_samples=4, seq_len=32, show_progress=False
    )
    q = load_file(int8_dir / "model.safetensors")
    prefix = "model.layers.0.mlp.up_proj"
    assert q[f"{prefix}.values"].dtype == torch.int8 and q[f"{prefix}.scales"].dtype == torch.float32
    assert torch.equal(q[f"{prefix}.meta"], load_file(float_dir / "model.safetensors")[f"{prefix}.meta"])
    ids = torch.tensor([[1, 17, 42, 99, 3]])
    want = hf_logits(densify_folder(float_dir, tmp_path / "fd"), ids)
    got = hf_logits(densify_folder(int8_dir, tmp_path / "qd"), ids)
    assert torch.allclose(got, want, atol=0.05 * float(want.abs().max()))


def _model_with_inputs_not_divisible_by_4(tmp_path: Path, tiny_model_dir: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=130, num_hidden_layers=1, num_attention_heads=4
    )
    folder = tmp_path / "odd"
    LlamaForCausalLM(config).save_pretrained(folder)
    shutil.copy(tiny_model_dir / "tokenizer.json", folder / "tokenizer.json")
    return folder


def test_bad_input_gives_one_clear_error(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    odd = _model_with_inputs_not_divisible_by_4(tmp_path, tiny_model_dir)
    assert tidepool_main(["sparsify", str(odd), str(tmp_path / "o1"), "--method", "magnitude"]) == 2
    err = capsys.readouterr().err
    assert "model.layers.0.mlp.down_proj.weight has 130 input features, not a multiple of 4" in err
    assert not (tmp_path / "o1").exists()

    from tidepool.engine.loading.quantized_copy import quantize_folder

    quantized = quantize_folder(tiny_model_dir, tmp_path / "int8", "int8")
    assert tidepool_main(["sparsify", str(quantized), str(tmp_path / "o2"), "--method", "wanda"]) == 2
    assert "already quantized (tidepool-int8)" in capsys.readouterr().err

    sparse = sparsify_folder(tiny_model_dir, tmp_path / "s", "magnitude", show_progress=False)
    assert tidepool_main(["sparsify", str(sparse), str(tmp_path / "o3"), "--method", "magnitude"]) == 2
    assert "already 2:4 sparse" in capsys.readouterr().err

    assert tidepool_main(["sparsify", str(tiny_model_dir), str(sparse), "--method", "magnitude"]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err

    args = ["sparsify", str(tiny_model_dir), str(tmp_path / "o4"), "--method", "wanda", "--calibration", "nope.txt"]
    assert tidepool_main(args) == 2
    assert "calibration source 'nope.txt' is neither one of pydoc nor a text file" in capsys.readouterr().err


def test_corrupt_metadata_is_named_when_densified(tiny_model_dir: Path, tmp_path: Path) -> None:
    sparse = sparsify_folder(tiny_model_dir, tmp_path / "s", "magnitude", show_progress=False)
    tensors = load_file(sparse / "model.safetensors")
    tensors["model.layers.1.self_attn.v_proj.meta"][3, 0] = 0x0F  # indices (3, 3)
    save_file(tensors, str(sparse / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.v_proj\.meta: row 3, group 0"):
        densify_folder(sparse, tmp_path / "d")


def test_text_file_calibration_is_recorded(tiny_model_dir: Path, tmp_path: Path) -> None:
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    out = sparsify_folder(
        tiny_model_dir, tmp_path / "o", "wanda", calibration=str(text), num_samples=2, seq_len=16, show_progress=False
    )
    calibration = json.loads((out / "config.json").read_text())[CONFIG_KEY]["calibration"]
    assert calibration["source"] == str(text) and calibration["num_samples"] == 2


def test_cached_checkpoint_is_built_once(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEPOOL_CACHE", str(tmp_path / "cache"))
    first = cached_sparse_checkpoint(tiny_model_dir, "magnitude")
    assert first.parent.parent == tmp_path / "cache" / "sparse"
    assert first.name == "magnitude-float32" and first.parent.name.startswith(tiny_model_dir.name + "-")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert cached_sparse_checkpoint(tiny_model_dir, "magnitude") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == ["magnitude-float32"]  # no leftover build folder
    int8 = cached_sparse_checkpoint(tiny_model_dir, "magnitude", "int8")  # converted from the float32 entry
    assert int8.name == "magnitude-int8"
    direct = sparsify_folder(tiny_model_dir, tmp_path / "direct", "magnitude", "int8", show_progress=False)
    converted, pruned = load_file(int8 / "model.safetensors"), load_file(direct / "model.safetensors")
    assert converted.keys() == pruned.keys()
    assert all(torch.equal(converted[k], pruned[k]) for k in pruned)


@pytest.mark.slow
@pytest.mark.parametrize("values_dtype", ["float32", "int8"])
def test_engine_loads_the_written_folder_and_agrees_with_transformers(
    tiny_model_dir: Path, tmp_path: Path, values_dtype: str
) -> None:
    from tidepool.engine import LLM, SamplingParams

    sparse = sparsify_folder(
        tiny_model_dir, tmp_path / "s", "wanda", values_dtype, num_samples=4, seq_len=32, show_progress=False
    )
    prompt = [1, 45, 300, 12, 7, 99, 250]
    llm = LLM(str(sparse), show_progress=False)
    got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    ids = torch.tensor([prompt])
    model = hf_model(densify_folder(sparse, tmp_path / "d"))
    want: list[int] = []
    for _ in range(8):  # greedy with transformers on the densified weights, no cache
        with torch.no_grad():
            token = int(model(input_ids=ids).logits[0, -1].argmax())
        want.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    assert got[0].outputs[0].token_ids == want
