"""Quantized folders (Tidepool's, GPTQ's, AWQ's) load with plain load_model / LLM(model=...).

Synthetic checkpoints: each projection of the tiny model is quantized here with a plain
min/max scheme and written in the checkpoint's own layout (independent loop packers). A dense
copy holding exactly the dequantized weights is the reference: the quantized model must
reproduce its logits to float precision, which checks unpacking, act-order permutation and the
fusion of q/k/v and gate/up together.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from quant_reference import AWQ_PACK_ORDER, dense_from_groups, pack_along_cols, pack_along_rows
from safetensors.torch import load_file, save_file

from tidepool.engine.loading.loader import load_model
from tidepool.engine.quant.perplexity import prefill_logits
from tidepool.engine.quant.quantize import is_quantizable
from tidepool.engine.quant.runtime import ConcatWeight, Int4Weight

GROUP = 32
PROMPT = torch.tensor([1, 17, 99, 250, 3, 42, 7, 300, 5, 11, 400, 64])


def _minmax_codes(w: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Linear weight [N, K] -> integer codes q [K, N], zeros [G, N] (1..15 or 8), scales [G, N]."""
    wt = w.t().reshape(-1, GROUP, w.shape[0])
    if symmetric:
        scales = wt.abs().amax(dim=1) / 7.5
        zeros = torch.full_like(scales, 8)
    else:
        lo, hi = wt.amin(dim=1), wt.amax(dim=1)
        scales = (hi - lo) / 14
        zeros = torch.clamp(torch.round(-lo / scales) + 1, 1, 15)
    q = torch.clamp(torch.round(wt / scales[:, None] + zeros[:, None]), 0, 15)
    return q.reshape(-1, w.shape[0]).long(), zeros.long(), scales


def _write_variant(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quant_config: dict | None) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    if quant_config is not None:
        config["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _make_pair(tiny: Path, out: Path, fmt: str) -> tuple[Path, Path]:
    """(quantized folder, dense folder with the dequantized weights) for `fmt` in gptq-v1/gptq-v2/awq."""
    dense = load_file(str(tiny / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)
    for index, (name, w) in enumerate(sorted(dense.items())):
        if not is_quantizable(name):
            quantized[name] = reference[name] = w
            continue
        prefix = name.removesuffix(".weight")
        k = w.shape[1]
        if fmt.startswith("gptq"):
            # Act-order on every other projection (different orders within q/k/v and gate/up too).
            perm = torch.randperm(k, generator=gen) if index % 2 else torch.arange(k)
            q_sorted, zeros, scales = _minmax_codes(w[:, perm], symmetric=index % 3 == 0)
            q = torch.empty_like(q_sorted)
            q[perm] = q_sorted
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[perm] = (torch.arange(k) // GROUP).to(torch.int32)
            stored_zeros = zeros - 1 if fmt == "gptq-v1" else zeros
            quantized[f"{prefix}.qweight"] = pack_along_rows(q)
            quantized[f"{prefix}.qzeros"] = pack_along_cols(stored_zeros)
            quantized[f"{prefix}.g_idx"] = g_idx
            quantized[f"{prefix}.bias"] = torch.zeros(w.shape[0])  # AutoGPTQ writes zero biases
        else:
            q, zeros, scales = _minmax_codes(w, symmetric=False)
            g_idx = torch.arange(k) // GROUP
            quantized[f"{prefix}.qweight"] = pack_along_cols(q, AWQ_PACK_ORDER)
            quantized[f"{prefix}.qzeros"] = pack_along_cols(zeros, AWQ_PACK_ORDER)
        quantized[f"{prefix}.scales"] = scales.half()
        reference[name] = dense_from_groups(q, zeros, scales.half(), g_idx.long()).t().contiguous()
    if fmt.startswith("gptq"):
        qcfg = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False}
        if fmt == "gptq-v2":
            qcfg["checkpoint_format"] = "gptq_v2"
    else:
        qcfg = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    return (
        _write_variant(tiny, out / fmt, quantized, qcfg),
        _write_variant(tiny, out / f"{fmt}-reference", reference, None),
    )


@pytest.mark.parametrize("fmt", ["gptq-v1", "gptq-v2", "awq"])
def test_hub_format_matches_its_dequantized_dense_model(fmt: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    quant_dir, ref_dir = _make_pair(tiny_model_dir, tmp_path, fmt)
    model, _ = load_model(quant_dir, show_progress=False)
    reference, _ = load_model(ref_dir, show_progress=False)
    attn = model.layers[0].self_attn
    assert "qkv_weight" not in dict(attn.named_parameters(recurse=False))
    if fmt.startswith("gptq"):
        assert isinstance(attn.qkv_weight, ConcatWeight)  # q/k/v were quantized in different orders
    else:
        assert isinstance(attn.qkv_weight, Int4Weight)
    torch.testing.assert_close(prefill_logits(model, PROMPT), prefill_logits(reference, PROMPT), rtol=1e-4, atol=1e-4)


def test_gptq_nonzero_bias_without_a_place_is_an_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    quant_dir, _ = _make_pair(tiny_model_dir, tmp_path, "gptq-v1")
    tensors = load_file(str(quant_dir / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.ones_like(tensors["model.layers.0.self_attn.q_proj.bias"])
    save_file(tensors, str(quant_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"q_proj\.bias' is a non-zero bias"):
        load_model(quant_dir, show_progress=False)


def test_partly_quantized_fused_projection_is_an_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    quant_dir, _ = _make_pair(tiny_model_dir, tmp_path, "awq")
    tensors = load_file(str(quant_dir / "model.safetensors"))
    for suffix in ("qweight", "qzeros", "scales"):
        del tensors[f"model.layers.1.self_attn.k_proj.{suffix}"]
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, str(quant_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="k_proj not quantized while fused partners"):
        load_model(quant_dir, show_progress=False)


@pytest.mark.parametrize(
    ("qcfg", "message"),
    [
        ({"quant_method": "fp8"}, "unsupported quant_method 'fp8'"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 32}, "only 4-bit GPTQ"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "AWQ version 'gemv'"),
        ({"quant_method": "tidepool", "method": "int2"}, "method must be one of int8, int4"),
        ({"quant_method": "gptq", "bits": "4"}, "bits must be an integer"),
    ],
)
def test_unsupported_quantization_configs(tiny_model_dir: Path, tmp_path: Path, qcfg: dict, message: str) -> None:
    folder = _write_variant(tiny_model_dir, tmp_path / "m", load_file(str(tiny_model_dir / "model.safetensors")), qcfg)
    with pytest.raises(ValueError, match=message):
        load_model(folder, show_progress=False)
