"""GGUF tensors -> Hugging Face-named torch tensors: the name map, dequantization, and Q/K row order.

Names (llama.cpp's llama/qwen2 converters): ``token_embd`` -> ``model.embed_tokens``, ``output_norm``
-> ``model.norm``, ``output`` -> ``lm_head``, and per block ``blk.N.{attn_norm, ffn_norm, attn_q,
attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down}`` -> ``model.layers.N.{input_layernorm,
post_attention_layernorm, self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj}`` (``.weight``/``.bias``).
``rope_freqs`` is read by the config (llama3 rope scaling), not loaded.

Q/K rows: llama.cpp's converter reorders the rows of a llama q/k projection (weight and bias) from
Hugging Face's "rotate half" layout to its interleaved RoPE layout: within each head, HF row
``j * hd/2 + i`` (``j`` in {0, 1}) becomes GGUF row ``2i + j``, with q split over ``head_count`` heads
and k over ``head_count_kv``. `hf_row_order` gives the inverse as a row index, which applies to
quantized rows too (blocks run along a row, never across rows). qwen2 files are not reordered.

Block layouts (ggml's, little-endian; 32 values per block, values along the row):
- Q8_0: fp16 ``d``, 32 x int8 ``q``; ``x = d * q``.
- Q4_0: fp16 ``d``, 16 bytes; value ``j < 16`` is the low nibble of byte ``j``, value ``j + 16`` the
  high nibble; ``x = d * (q - 8)``.
- Q4_1: fp16 ``d``, fp16 ``m``, 16 bytes as Q4_0; ``x = d * q + m``.
Dequantization runs in float32 (the products ``d * q`` are exact there), then casts to the model dtype.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from .errors import GGUFError
from .reader import REFERENCE_TYPES, GGUFFile, TensorInfo

QK = 32  # values per block of the Q8_0/Q4_0/Q4_1 types
_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_CONFIG_ONLY = ("rope_freqs.weight",)  # consumed by the config


def hf_name(name: str, path: object = "") -> str | None:
    """The Hugging Face name of GGUF tensor `name`; None for tensors the config consumes; else GGUFError."""
    if name in _CONFIG_ONLY:
        return None
    top, _, kind = name.rpartition(".")
    if top in _TOP_LEVEL and kind == "weight":
        return f"{_TOP_LEVEL[top]}.weight"
    match = _BLOCK_NAME.match(name)
    if match is not None and match.group(2) in _PER_BLOCK:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_PER_BLOCK[part]}.{kind}"
    raise GGUFError(f"{path}: tensor {name!r} has no place in a llama-family model")


def hf_row_order(name: str, arch: str, num_heads: int, num_kv_heads: int, num_rows: int) -> torch.Tensor | None:
    """Row index that turns GGUF rows of `name` back into Hugging Face order; None when not reordered."""
    if arch != "llama":
        return None
    match = _BLOCK_NAME.match(name)
    if match is None or match.group(2) not in ("attn_q", "attn_k"):
        return None
    heads = num_heads if match.group(2) == "attn_q" else num_kv_heads
    head_dim = num_rows // heads
    if head_dim * heads != num_rows or head_dim % 2:
        raise GGUFError(f"tensor {name!r} has {num_rows} rows, not {heads} heads of an even head_dim")
    return torch.arange(num_rows).view(heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)


def raw_blocks(info: TensorInfo, block_bytes: int) -> torch.Tensor:
    """uint8 ``[rows, blocks, block_bytes]`` of a block-quantized matrix (a copy, off the memory map)."""
    rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
    data = torch.from_numpy(np.array(info.raw, dtype=np.uint8, copy=True)).reshape(rows, -1)
    if data.shape[1] % block_bytes:
        raise GGUFError(f"tensor {info.name!r}: {data.shape[1]} bytes per row is not whole {info.type_name} blocks")
    return data.view(rows, -1, block_bytes)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 stored at bytes ``start:start+2`` of each block, as float32 ``[rows, blocks, 1]``."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()


def unpack_q4(nibble_bytes: torch.Tensor) -> torch.Tensor:
    """16 bytes per block -> the 32 values 0..15 in order (low nibbles first, then high nibbles)."""
    return torch.cat((nibble_bytes & 0xF, nibble_bytes >> 4), dim=-1)


def q4_parts(info: TensorInfo) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0/Q4_1 as ``(q uint8 [rows, K], d [rows, K/32], m [rows, K/32])`` float32 with ``x = d*q + m``."""
    if info.type_name == "Q4_0":
        blocks = raw_blocks(info, 18)
        d = _half(blocks, 0)
        q, m = unpack_q4(blocks[..., 2:]), -8.0 * d  # d * (q - 8) == d * q + (-8 d), exactly
    elif info.type_name == "Q4_1":
        blocks = raw_blocks(info, 20)
        d, m, q = _half(blocks, 0), _half(blocks, 2), unpack_q4(blocks[..., 4:])
    else:
        raise GGUFError(f"tensor {info.name!r} is {info.type_name}, not Q4_0/Q4_1")
    rows = q.shape[0]
    return q.reshape(rows, -1), d.reshape(rows, -1), m.reshape(rows, -1)


def _q4_values(info: TensorInfo) -> torch.Tensor:
    """Q4_0/Q4_1 in float32 ``[rows, blocks, 32]``: nibbles widened straight into the output, scaled in place.

    ``q * d + m`` with ``m = -8 d`` for Q4_0 rounds once, like ``d * (q - 8)`` (``q * d`` is exact in float32).
    """
    is_q4_1 = info.type_name == "Q4_1"
    blocks = raw_blocks(info, 20 if is_q4_1 else 18)
    d = _half(blocks, 0)
    m = _half(blocks, 2) if is_q4_1 else -8.0 * d
    nibbles = blocks[..., 4:] if is_q4_1 else blocks[..., 2:]
    out = torch.empty(*blocks.shape[:2], QK)
    out[..., : QK // 2] = nibbles & 0xF
    out[..., QK // 2 :] = nibbles >> 4
    return out.mul_(d).add_(m)


def dequantize(info: TensorInfo) -> torch.Tensor:
    """The tensor's values in float32 (F16/BF16 widened), shaped as `info.shape`."""
    kind = info.type_name
    if kind in ("F32", "F16"):
        values = torch.from_numpy(np.array(info.raw, dtype=np.float32))
    elif kind == "BF16":
        values = torch.from_numpy(np.array(info.raw, dtype=np.uint8)).view(torch.bfloat16).float()
    elif kind == "Q8_0":
        blocks = raw_blocks(info, 34)
        values = _half(blocks, 0) * blocks[..., 2:].contiguous().view(torch.int8).float()
    elif kind in ("Q4_0", "Q4_1"):
        values = _q4_values(info)
    elif kind in REFERENCE_TYPES:
        from gguf.quants import dequantize as gguf_dequantize

        values = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(np.array(info.raw), info.type)))
    else:
        raise GGUFError(f"tensor {info.name!r} has type {kind}, which Tidepool cannot load")
    return values.reshape(info.shape)


class WeightSource:
    """The tensors of one GGUF file under Hugging Face names, rows in Hugging Face order."""

    def __init__(self, gguf: GGUFFile, num_heads: int, num_kv_heads: int) -> None:
        self.gguf = gguf
        self.arch = gguf.architecture
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.by_hf_name: dict[str, TensorInfo] = {}
        for name, info in gguf.tensors.items():
            target = hf_name(name, gguf.path)
            if target is not None:
                self.by_hf_name[target] = info

    def row_order(self, info: TensorInfo) -> torch.Tensor | None:
        return hf_row_order(info.name, self.arch, self.num_heads, self.num_kv_heads, info.shape[0])

    def dense(self, hf: str, dtype: torch.dtype) -> torch.Tensor:
        info = self.by_hf_name[hf]
        values = dequantize(info)
        order = self.row_order(info)
        if order is not None:
            values = values.index_select(0, order)
        return values.to(dtype)

    def iter_dense(self, names: list[str], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        for hf in names:
            yield hf, self.dense(hf, dtype)
