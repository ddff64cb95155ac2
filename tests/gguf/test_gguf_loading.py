"""GGUF files of random models load into exactly the weights and config of their Hugging Face source.

Each variant differs from SmolLM2 (GQA 4:2, MQA with llama3 rope and tied embeddings, head_dim 24
with linear rope, untied embeddings, qwen2 with qkv biases), so the name map, the q/k row order and
the metadata translation are checked in general. Float files must reproduce the folder's weights
bit for bit; quantized ones must equal the `gguf` package's own dequantization of the same bytes.
transformers' GGUF loader (its own reverse of the row interleave) is a second, independent reader.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_files import gguf_name, llama_cpp_permute

from tidepool.engine import LLM, SamplingParams
from tidepool.engine.engine_config import resolve_model_path
from tidepool.engine.layers.rotary import inverse_frequencies
from tidepool.engine.loading.formats import read_model_config
from tidepool.engine.loading.loader import load_model

VARIANTS = ["llama-gqa", "llama-mqa-tied-llama3rope", "llama-headdim24-linearrope", "qwen2-tied"]
CONFIG_FIELDS = (
    "architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta", "tie_word_embeddings",
    "attention_bias", "o_proj_bias", "mlp_bias", "bos_token_id",
)  # fmt: skip


def _params(path: Path, **kwargs: object) -> dict[str, torch.Tensor]:
    model, _ = load_model(path, show_progress=False, **kwargs)  # type: ignore[arg-type]
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_file_is_the_folder(variant: str, hf_model_dir: Callable[[str], Path], gguf_model) -> None:
    folder, file = hf_model_dir(variant), gguf_model(variant, "F32")
    from_gguf, from_hf = read_model_config(file), read_model_config(folder)
    for field in CONFIG_FIELDS:
        assert getattr(from_gguf, field) == getattr(from_hf, field), field
    assert from_gguf.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps, rel=1e-6)  # stored as float32
    # Linear scaling comes from metadata, llama3 is recovered from rope_freqs.weight: same frequencies either way.
    assert (from_gguf.rope_scaling is None) == (from_hf.rope_scaling is None)
    torch.testing.assert_close(
        inverse_frequencies(from_gguf.head_dim, from_gguf.rope_theta, from_gguf.rope_scaling),
        inverse_frequencies(from_hf.head_dim, from_hf.rope_theta, from_hf.rope_scaling),
        rtol=1e-5,
        atol=0,
    )
    dense, reference = _params(file), _params(folder)
    assert dense.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(dense[name], tensor), name


def _file_values(path: Path, hf: str, heads: int, kv_heads: int) -> torch.Tensor:
    """The gguf package's dequantization of tensor `hf`, rows put back in Hugging Face order."""
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == gguf_name(hf))
    values = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
    rows = torch.arange(values.shape[0])
    if ".q_proj." in hf or ".k_proj." in hf:
        order = llama_cpp_permute(rows, heads if ".q_proj." in hf else kv_heads)  # GGUF row r holds HF row order[r]
        values = values[torch.argsort(order)]
    return values.reshape(values.shape[0], -1) if values.dim() > 1 else values


@pytest.mark.parametrize("type_name", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_types_dequantize_like_the_gguf_package(type_name: str, gguf_model) -> None:
    file = gguf_model("llama-gqa", type_name)
    config = read_model_config(file)
    # dtype "auto": the projections' own float type, float32 for quantized ones (exact there).
    assert config.torch_dtype == {"F16": torch.float16, "BF16": torch.bfloat16}.get(type_name, torch.float32)
    model, _ = load_model(file, dtype=torch.float32, show_progress=False)
    layout = model.checkpoint_layout()
    params = dict(model.named_parameters())
    for hf in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.input_layernorm.weight"):
        assert torch.equal(params[layout[hf][0]], _file_values(file, hf, 4, 2)), hf
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.down_proj"):
        hf = f"model.layers.0.{proj}.weight"
        name, offset, rows = layout[hf]
        got = params[name][offset : offset + rows]
        assert torch.equal(got, _file_values(file, hf, config.num_attention_heads, config.num_key_value_heads)), hf


# K-quants: gguf's writer cannot quantize them, so random blocks with a sane fp16 scale stand in.
K_QUANTS = {"Q6_K": (210, (208,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2))}  # block bytes, fp16 offsets


@pytest.mark.parametrize("type_name", sorted(K_QUANTS))
def test_k_quants_go_through_the_gguf_dequantizer(type_name: str) -> None:
    from tidepool.engine.gguf.reader import TensorInfo
    from tidepool.engine.gguf.tensors import dequantize

    block_bytes, halves = K_QUANTS[type_name]
    blocks = np.random.default_rng(0).integers(0, 256, size=(6, block_bytes), dtype=np.uint8)
    for offset in halves:
        blocks[:, offset : offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    kind = gguf.GGMLQuantizationType[type_name]
    info = TensorInfo("blk.0.ffn_down.weight", kind, (6, 256), blocks)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, kind))
    assert expected.isfinite().all()
    assert torch.equal(dequantize(info), expected)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["llama-gqa", "llama-headdim24-linearrope", "qwen2-tied"])
def test_transformers_reads_the_same_weights(variant: str, gguf_model) -> None:
    """transformers' GGUF loader (its own un-permute) gives the tensors Tidepool loaded, per HF name."""
    transformers = pytest.importorskip("transformers")
    file = gguf_model(variant, "Q8_0")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name).eval()
    model, _ = load_model(file, show_progress=False)
    params = dict(model.named_parameters())
    state = hf.state_dict()
    for hf_name, (name, offset, rows) in model.checkpoint_layout().items():
        if hf_name in state:
            torch.testing.assert_close(params[name][offset : offset + rows], state[hf_name], rtol=0, atol=0)


def test_engine_generates_the_folder_tokens(hf_model_dir: Callable[[str], Path], gguf_model, tmp_path: Path) -> None:
    folder, file = hf_model_dir("llama-gqa"), gguf_model("llama-gqa", "F32")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 99, 3], [200, 201, 7, 7, 7, 42, 11]]
    engine = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=256, show_progress=False)
    want = [o.outputs[0].token_ids for o in LLM(str(folder), **engine).generate(prompts, params, use_tqdm=False)]
    alone = tmp_path / "one-gguf"  # a folder holding exactly one .gguf resolves to that file
    alone.mkdir()
    shutil.copy(file, alone / file.name)
    assert resolve_model_path(str(alone)) == str(alone / file.name)
    got = [o.outputs[0].token_ids for o in LLM(str(alone), **engine).generate(prompts, params, use_tqdm=False)]
    assert got == want
    text = LLM(str(file), **engine).generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0))
    assert text[0].outputs[0].token_ids  # the GGUF's own tokenizer encodes text prompts


def test_folder_with_several_gguf_files_is_refused(gguf_model, tmp_path: Path) -> None:
    for type_name in ("F32", "Q8_0"):
        shutil.copy(gguf_model("llama-gqa", type_name), tmp_path)
    with pytest.raises(ValueError, match=r"holds 2 \.gguf files .*give the file to load"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ValueError, match=r"holds 2 \.gguf files"):
        LLM(str(tmp_path), show_progress=False)


def test_draft_model_may_be_a_gguf(gguf_model) -> None:
    """Speculative decoding with a GGUF draft (here the target itself) keeps greedy output identical."""
    file = gguf_model("llama-gqa", "Q8_0")
    engine = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=256, show_progress=False)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 99, 3, 5, 17, 99]]
    plain = LLM(str(file), **engine).generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
    spec = {"method": "draft", "draft_model": str(file), "num_speculative_tokens": 3}
    llm = LLM(str(file), speculative_config=spec, **engine)
    assert llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids == plain
    assert llm.engine.get_stats().spec_num_accepted_tokens > 0
