"""Write GGUF files for tests with the `gguf` package's own writer and quantizers.

`hf_to_gguf` converts a Hugging Face folder (config.json, model.safetensors, tokenizer.json) the way
llama.cpp's converter does, written here independently of Tidepool's loader: tensor names, the
llama q/k row interleave (`llama_cpp_permute`, the converter's transform, applied forward), the
llama3 `rope_freqs` tensor, and the tokenizer as ``tokenizer.ggml.*`` metadata. Each tensor is
stored in the GGML type `types(name)` chooses, quantized with `gguf.quants.quantize`, so files of
every supported type can be made from one random model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

T = gguf.GGMLQuantizationType
HF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_TOP["lm_head.weight"] = "output.weight"


def gguf_name(hf: str) -> str:
    if hf in _TOP:
        return _TOP[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_BLOCK[module]}.{kind}"


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter: per head, rows (half j, index i) -> row 2i + j (weights and biases)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def matrices_as(type_name: str) -> Callable[[str, tuple[int, ...]], str]:
    """2-D tensors in `type_name`, everything else F32 (llama.cpp keeps norms in F32)."""
    return lambda name, shape: type_name if len(shape) == 2 else "F32"


def encode(values: np.ndarray, type_name: str) -> tuple[np.ndarray, T | None]:
    """The array to hand GGUFWriter and its raw type (None: the numpy dtype says it)."""
    kind = T[type_name]
    if kind == T.F32:
        return values.astype(np.float32), None
    if kind == T.F16:
        return values.astype(np.float16), None
    return gguf.quants.quantize(values.astype(np.float32), kind), kind


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """The converter's rope_freqs: per frequency 1 (high), factor (low) or the smooth blend's inverse."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def add_tokenizer(writer: gguf.GGUFWriter, folder: Path, pre: str | None = "default") -> None:
    """A byte-level BPE tokenizer.json (and its config's chat template) as gpt2-type metadata."""
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    special = {t["content"] for t in data["added_tokens"] if t.get("special")}
    for added in data["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id)):
        if config.get(key) in vocab:
            add(vocab[config[key]])
    if config.get("pad_token") in vocab:
        writer.add_pad_token_id(vocab[config["pad_token"]])
    writer.add_add_bos_token(bool(config.get("add_bos_token", False)))
    if config.get("chat_template"):
        writer.add_chat_template(config["chat_template"])


def hf_to_gguf(
    folder: Path,
    out: Path,
    types: Callable[[str, tuple[int, ...]], str] | None = None,
    *,
    arch: str | None = None,
    tokenizer: bool = True,
    pre: str | None = "default",
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """Write `folder`'s model as a GGUF file at `out` (see the module docstring); F32 unless `types` says."""
    types = types or matrices_as("F32")
    config = json.loads((folder / "config.json").read_text())
    arch = arch or HF_ARCH[config["architectures"][0]]
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    rope = {**(config.get("rope_parameters") or {}), **(config.get("rope_scaling") or {})}  # transformers 5 / 4
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    scaling = rope if rope.get("rope_type", rope.get("type")) in ("linear", "llama3") else {}
    if scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    if tokenizer:
        add_tokenizer(writer, folder, pre)
    if extra is not None:
        extra(writer)
    tensors = load_file(str(folder / "model.safetensors"))
    if scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, theta, scaling))
    for hf, tensor in sorted(tensors.items()):
        name = gguf_name(hf)
        values = tensor.float()
        if arch == "llama" and ".attn_q." in name:
            values = llama_cpp_permute(values, heads)
        elif arch == "llama" and ".attn_k." in name:
            values = llama_cpp_permute(values, kv_heads)
        array, raw_dtype = encode(values.numpy(), types(name, tuple(values.shape)))
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def sentencepiece_metadata(corpus: list[str], vocab_size: int = 300) -> Callable[[gguf.GGUFWriter], None]:
    """An `extra` writer adding a SentencePiece-style (``llama``) vocabulary trained on `corpus`.

    Layout as llama.cpp's converter writes one: <unk> (UNKNOWN), <s> and </s> (CONTROL), the 256
    byte-fallback tokens <0xNN> (BYTE), then the pieces best-first with descending scores; no merges
    (the reader must derive them from the scores).
    """
    from tokenizers import SentencePieceBPETokenizer

    trainer = SentencePieceBPETokenizer()
    trainer.train_from_iterator(corpus, vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"])
    by_id = sorted(trainer.get_vocab().items(), key=lambda kv: kv[1])
    pieces = [t for t, _ in by_id if t not in ("<unk>", "<s>", "</s>")]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3, *([6] * 256), *([1] * len(pieces))]

    def add(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(True)

    return add
