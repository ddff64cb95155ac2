"""Quantized tiny models against the dense one; `tidepool quantize` round trip and its errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tidepool.engine.loading.loader import load_model
from tidepool.engine.loading.quantized_copy import quantize_folder
from tidepool.engine.make_model import make_model
from tidepool.engine.quant.cli import main
from tidepool.engine.quant.perplexity import prefill_logits
from tidepool.engine.quant.runtime import Int4Weight, Int8Weight, QuantizedWeight, weight_bytes

PROMPT = torch.tensor([1, 17, 99, 250, 3, 42, 7, 300, 5, 11, 400, 64, 8, 9, 10, 200])


@pytest.fixture(scope="module")
def quantized_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("quantized")
    return {
        "int8": quantize_folder(tiny_model_dir, out / "int8", "int8"),
        "int4": quantize_folder(tiny_model_dir, out / "int4", "int4", group_size=32),
    }


# Random Gaussian weights are int4's worst case (no outliers to clip, every group full range): ~8% error per
# weight compounds through the layers. A wrong unpacking or group mapping gives errors of order 100%.
@pytest.mark.parametrize(("method", "max_rel_err"), [("int8", 0.02), ("int4", 0.4)])
def test_quantized_logits_close_to_dense(
    method: str, max_rel_err: float, tiny_model_dir: Path, quantized_dirs: dict[str, Path]
) -> None:
    dense, _ = load_model(tiny_model_dir, show_progress=False)
    quant, _ = load_model(quantized_dirs[method], show_progress=False)
    ref, got = prefill_logits(dense, PROMPT), prefill_logits(quant, PROMPT)
    rel_err = float((got - ref).norm() / ref.norm())
    assert 0 < rel_err < max_rel_err
    kind = Int8Weight if method == "int8" else Int4Weight
    assert isinstance(quant.layers[1].mlp.gate_up_weight, kind)
    assert isinstance(quant.layers[1].self_attn.o_weight, kind)


def test_weight_bytes_follow_the_layouts(tiny_model_dir: Path, quantized_dirs: dict[str, Path]) -> None:
    dense, config = load_model(tiny_model_dir, show_progress=False)
    dense_bytes = weight_bytes(dense)
    projections = [
        (name, p.shape)
        for name, p in dense.named_parameters()
        if name.endswith(("qkv_weight", "o_weight", "_up_weight", "down_weight"))
    ]
    dense_proj = sum(n * k * 4 for _, (n, k) in projections)
    int8_proj = sum(n * k + n * 4 for _, (n, k) in projections)  # int8 weights + fp32 scales
    int4_proj = sum(n * k // 2 + 2 * (k // 32) * n * 4 for _, (n, k) in projections)  # + scales and zeros
    for method, proj in (("int8", int8_proj), ("int4", int4_proj)):
        quant, _ = load_model(quantized_dirs[method], show_progress=False)
        assert weight_bytes(quant) == dense_bytes - dense_proj + proj
        assert config.torch_dtype == torch.float32


def test_cli_round_trip(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tidepool.engine.llm import LLM
    from tidepool.engine.sampling_params import SamplingParams

    out = tmp_path / "int4"
    assert main(["--method", "int4", "--group-size", "64", str(tiny_model_dir), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "tidepool"
    assert config["quantization_config"]["group_sizes"] == {"64": 64, "128": 64}  # every input width: as given
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["model.layers.0.mlp.down_proj.qweight"].dtype == torch.int32
    assert "model.layers.0.mlp.down_proj.weight" not in tensors
    llm = LLM(model=str(out))
    result = llm.generate(["hello world"], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert len(result[0].outputs[0].token_ids) == 6
    weight = llm.engine.model.layers[0].self_attn.qkv_weight
    assert isinstance(weight, QuantizedWeight) and weight.group_size == 64


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "int4", "--group-size", "48"], "group size 48 does not divide"),
        (["--method", "int4", "--group-size", "20"], "multiple of 8"),
    ],
)
def test_cli_bad_arguments_exit_2(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main([*args, str(tiny_model_dir), str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written for bad input


def test_cli_unknown_method_is_rejected(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--method", "int3", str(tiny_model_dir), str(tmp_path / "out")])
    assert exc.value.code == 2


def test_cli_refuses_non_empty_output_and_quantized_input(
    tiny_model_dir: Path, quantized_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    assert main(["--method", "int8", str(tiny_model_dir), str(tmp_path / "busy")]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert main(["--method", "int8", str(quantized_dirs["int4"]), str(tmp_path / "again")]) == 2
    assert "already quantized" in capsys.readouterr().err
    assert main(["--method", "int8", str(tmp_path / "missing"), str(tmp_path / "o")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_quantized_weight_refuses_other_ops(quantized_dirs: dict[str, Path]) -> None:
    model, _ = load_model(quantized_dirs["int8"], show_progress=False)
    with pytest.raises(TypeError, match=r"only supports F\.linear"):
        torch.matmul(torch.ones(2, 64), model.layers[0].self_attn.o_weight)


@pytest.mark.parametrize(("method", "max_rel_err"), [("int8", 0.05), ("int4", 0.4)])
def test_qkv_bias_and_tied_embeddings_survive_quantization(
    method: str, max_rel_err: float, hf_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    src = hf_model_dir("qwen2-tied")  # non-zero q/k/v biases, tied embeddings, intermediate 160
    out = quantize_folder(src, tmp_path / method, method, group_size=32)
    dense, _ = load_model(src, show_progress=False)
    quant, _ = load_model(out, show_progress=False)
    assert quant.layers[0].self_attn.qkv_bias is not None
    torch.testing.assert_close(quant.layers[0].self_attn.qkv_bias, dense.layers[0].self_attn.qkv_bias)
    ref, got = prefill_logits(dense, PROMPT), prefill_logits(quant, PROMPT)
    assert 0 < float((got - ref).norm() / ref.norm()) < max_rel_err


def test_cli_default_group_size_narrows_where_needed_and_a_given_one_is_kept(
    hf_model_dir: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = hf_model_dir("qwen2-tied")  # down_proj has 160 inputs: 128-wide groups cannot tile it
    assert main(["--method", "int4", "--group-size", "128", str(src), str(tmp_path / "given")]) == 2
    assert "group size 128 does not divide model.layers.0.mlp.down_proj.weight's 160" in capsys.readouterr().err
    assert main(["--method", "int4", str(src), str(tmp_path / "default")]) == 0
    tensors = load_file(str(tmp_path / "default" / "model.safetensors"))
    assert tensors["model.layers.0.mlp.down_proj.scales"].shape[0] == 160 // 80
    assert tensors["model.layers.0.mlp.up_proj.scales"].shape[0] == 64 // 64
    model, _ = load_model(tmp_path / "default", show_progress=False)
    assert model.layers[1].mlp.down_weight.group_size == 80


def test_int4_config_records_the_group_sizes_its_tensors_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The `small` preset's 704-wide down_proj inputs take groups of 88 (128 does not divide 704): config.json
    must say so (it once said 128), and the loader must read each projection's size from it."""
    src = make_model("llama", "small", tmp_path / "small", seed=0)
    out = tmp_path / "int4"
    assert main(["--method", "int4", str(src), str(out)]) == 0
    assert "704: 88" in capsys.readouterr().out
    tensors = load_file(str(out / "model.safetensors"))
    held: dict[int, set[int]] = {}  # input width -> the group sizes the tensors' shapes imply
    for name, qweight in tensors.items():
        if name.endswith(".qweight"):
            k = qweight.shape[0] * 8
            held.setdefault(k, set()).add(k // tensors[name.replace(".qweight", ".scales")].shape[0])
    assert held == {256: {128}, 704: {88}}
    path = out / "config.json"
    config = json.loads(path.read_text())
    assert config["quantization_config"]["group_sizes"] == {"256": 128, "704": 88}
    assert "group_size" not in config["quantization_config"]  # no size that some projections do not have
    model, _ = load_model(out, show_progress=False)
    assert (model.layers[0].mlp.down_weight.group_size, model.layers[0].mlp.gate_up_weight.group_size) == (88, 128)
    legacy = {k: v for k, v in config["quantization_config"].items() if k != "group_sizes"}
    path.write_text(json.dumps({**config, "quantization_config": {**legacy, "group_size": 128}}))
    model, _ = load_model(out, show_progress=False)  # a folder written before group_sizes: the old rule, 128 -> 88
    assert (model.layers[0].mlp.down_weight.group_size, model.layers[0].mlp.gate_up_weight.group_size) == (88, 128)
    config["quantization_config"]["group_sizes"]["704"] = 64  # a config that lies about the tensors is refused
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="group"):
        load_model(out, show_progress=False)
