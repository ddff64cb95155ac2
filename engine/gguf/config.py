"""`ModelConfig` from a GGUF file's metadata (llama.cpp's `<arch>.*` keys) and tensor shapes.

The metadata is translated into the Hugging Face `config.json` fields Tidepool already validates, so
one code path (`ModelConfig.from_dict`) checks both formats. Sources, per field:

- layers / hidden / intermediate / heads / kv heads: `<arch>.block_count`, `.embedding_length`,
  `.feed_forward_length`, `.attention.head_count`, `.attention.head_count_kv`; vocabulary size: the
  rows of `token_embd.weight` (checked against `<arch>.vocab_size` and the token list).
- head_dim: `.attention.key_length` (else hidden / heads); `.rope.dimension_count` must equal it
  (partial rotary is not a llama-family feature).
- RoPE: `.rope.freq_base`; `.rope.scaling.type` linear with `.rope.scaling.factor`; Llama 3.x files
  carry no llama3 scaling metadata but a `rope_freqs.weight` tensor of per-frequency divisors, which
  is matched against the llama3 formula to recover its parameters.
- tied embeddings: no `output.weight` tensor. qkv/o/mlp biases: the bias tensors present.
- dtype "auto": float16/bfloat16/float32 when the projections are stored so, float32 when quantized
  (dequantized values are exact in float32; pass dtype="bfloat16" on a GPU).
- eos: `tokenizer.ggml.eos_token_id` plus `eot_token_id` / `eom_token_id` (llama.cpp stops on all).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..config import ModelConfig
from ..layers.rotary import inverse_frequencies
from .errors import GGUFError
from .reader import GGUFFile

# GGUF architecture -> the Hugging Face architecture Tidepool builds for it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_STOP_IDS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def check_architecture(gguf: GGUFFile) -> str:
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)} "
            "(llama also covers Mistral, SmolLM and other llama-family models converted by llama.cpp)"
        )
    return arch


def model_config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    arch = check_architecture(gguf)
    source = str(gguf.path)
    if "token_embd.weight" not in gguf.tensors:
        raise GGUFError(f"{source}: the tensor token_embd.weight (the token embeddings) is missing")
    gguf.check_types()
    vocab_size, hidden = gguf.tensors["token_embd.weight"].shape

    def meta(suffix: str, default: Any = None, required: bool = True) -> Any:
        key = f"{arch}.{suffix}"
        value = gguf.get(key, default)
        if value is None and required:
            raise GGUFError(f"{source}: required metadata {key!r} is missing")
        if isinstance(value, list):
            raise GGUFError(f"{source}: {key} varies per layer ({value[:4]}...), which Tidepool does not support")
        return value

    embedding_length = int(meta("embedding_length"))
    if embedding_length != hidden:
        raise GGUFError(f"{source}: {arch}.embedding_length={embedding_length} but token_embd.weight is {hidden} wide")
    _check_vocab(gguf, arch, vocab_size)
    num_heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // num_heads if num_heads else 0))
    value_length = meta("attention.value_length", head_dim)
    if int(value_length) != head_dim:
        raise GGUFError(f"{source}: key_length {head_dim} != value_length {value_length} is not supported")
    rope_dims = meta("rope.dimension_count", head_dim)
    if int(rope_dims) != head_dim:
        raise GGUFError(
            f"{source}: rope.dimension_count={rope_dims} differs from head_dim={head_dim} (partial rotary); "
            "Tidepool's llama-family models rotate the whole head"
        )
    theta = float(meta("rope.freq_base", 10000.0))
    tensors = gguf.tensors
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(meta("context_length", 2048)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(gguf, arch, head_dim, theta),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_gate.bias" in tensors,
        "torch_dtype": default_dtype(gguf),
        "eos_token_id": [int(i) for key in _STOP_IDS if (i := gguf.get(key)) is not None],
        "bos_token_id": gguf.get("tokenizer.ggml.bos_token_id"),
    }
    if arch == "llama" and ("blk.0.attn_q.bias" in tensors) != ("blk.0.attn_output.bias" in tensors):
        raise GGUFError(f"{source}: llama attention biases must be on q/k/v and output together")
    try:
        return ModelConfig.from_dict(raw, source=source)
    except GGUFError:
        raise
    except ValueError as err:
        raise GGUFError(str(err)) from None


def _check_vocab(gguf: GGUFFile, arch: str, rows: int) -> None:
    declared = gguf.get(f"{arch}.vocab_size")
    if declared is not None and int(declared) != rows:
        raise GGUFError(f"{gguf.path}: {arch}.vocab_size={declared} but token_embd.weight has {rows} rows")
    tokens = gguf.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) > rows:
        raise GGUFError(f"{gguf.path}: the tokenizer has {len(tokens)} tokens but token_embd.weight only {rows} rows")


def default_dtype(gguf: GGUFFile) -> str:
    """What dtype="auto" means for this file (see the module docstring)."""
    types = {t.type_name for name, t in gguf.tensors.items() if len(t.shape) == 2 and name.startswith("blk.")}
    if len(types) == 1 and (only := next(iter(types))) in _FLOAT_DTYPES:
        return _FLOAT_DTYPES[only]
    return "float32"


def _rope_scaling(gguf: GGUFFile, arch: str, head_dim: int, theta: float) -> dict[str, Any] | None:
    kind = gguf.get(f"{arch}.rope.scaling.type", "none")
    factor = gguf.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor is not None and float(factor) != 1.0:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind not in ("none", "linear"):
        raise GGUFError(
            f"{gguf.path}: rope scaling {kind!r} is not supported; supported: none, linear, llama3 (rope_freqs)"
        )
    if "rope_freqs.weight" in gguf.tensors:
        return llama3_from_rope_freqs(gguf, arch, head_dim, theta)
    return None


def llama3_from_rope_freqs(gguf: GGUFFile, arch: str, head_dim: int, theta: float) -> dict[str, Any] | None:
    """The llama3 scaling parameters whose per-frequency divisors are the file's `rope_freqs.weight`.

    llama3 scaling depends on ``x = 1 / wavelength`` through ``L = low_freq_factor / original_ctx`` and
    ``H = high_freq_factor / original_ctx`` only: divisor 1 where ``x > H``, ``factor`` where ``x < L``,
    and ``1 / ((1 - s) / factor + s)`` with ``s = (x - L) / (H - L)`` between. So ``factor`` is the largest
    divisor, ``L`` and ``H`` follow from the blended entries (a line fit of ``s`` against ``x``, or any
    values between the neighbouring entries when fewer than two are blended), and ``original_ctx`` is
    the file's `rope.scaling.original_context_length` (else 8192, Llama 3's). The result is checked by
    recomputing every divisor.
    """
    info = gguf.tensors["rope_freqs.weight"]
    if info.type_name != "F32" or info.shape != (head_dim // 2,):
        raise GGUFError(
            f"{gguf.path}: rope_freqs.weight must be F32 [{head_dim // 2}], got {info.type_name} {list(info.shape)}"
        )
    divisors = torch.from_numpy(np.array(info.raw, dtype=np.float64))
    factor = float(divisors.max())
    if factor <= 1.0 + 1e-6:
        return None  # present but neutral: no scaling
    x = inverse_frequencies(head_dim, theta, None).double() / (2 * math.pi)
    is_high = (divisors - 1.0).abs() < 1e-5
    is_low = (divisors - factor).abs() < 1e-5 * factor
    medium = ~(is_high | is_low)
    below = float(x[is_low].max()) if bool(is_low.any()) else 0.0
    above = float(x[is_high].min()) if bool(is_high.any()) else float(x.max()) * 2
    if int(medium.sum()) >= 2:
        s = (1 / divisors[medium] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(x[medium].numpy(), s.numpy(), 1)
        low_x, high_x = -intercept / slope, (1 - intercept) / slope
    elif int(medium.sum()) == 1:
        xm = float(x[medium][0])
        sm = float((1 / divisors[medium][0] - 1 / factor) / (1 - 1 / factor))
        low_x = (below + xm) / 2
        high_x = low_x + (xm - low_x) / sm
    else:
        low_x, high_x = below + (above - below) / 3, below + 2 * (above - below) / 3
    original = int(gguf.get(f"{arch}.rope.scaling.original_context_length", 8192))
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(low_x * original),
        "high_freq_factor": float(high_x * original),
        "original_max_position_embeddings": original,
    }
    recomputed = inverse_frequencies(head_dim, theta, None).double() / inverse_frequencies(head_dim, theta, params)
    if not 0 < low_x < high_x or not torch.allclose(recomputed, divisors, rtol=1e-4, atol=0):
        raise GGUFError(
            f"{gguf.path}: rope_freqs.weight does not follow llama3 rope scaling (factor {factor}); "
            "this rope scaling is not supported"
        )
    return params
