"""Tensor parallelism applied to a built, loaded Llama-family model (gpt-fast `tp.py` style).

The model file is untouched: `shard_layer` slices one decoder layer's loaded parameters in
place and registers an all-reduce hook; the embedding and LM head are vocabulary-parallel
shards used by the pipeline stage (`pp.StageModel`).

- Attention: column-parallel fused qkv, split by heads. The fused rows are [q | k | v], so
  each section is sliced on its own: rank r keeps q heads [r*H/tp, (r+1)*H/tp) and the kv
  heads those q heads read. When kv heads are fewer than tp (GQA/MQA with tp > num_kv_heads)
  and tp is a multiple of them, each rank keeps a replica of the one kv head its q heads
  share (as vLLM does); any other combination raises ValueError naming the sizes.
  o_proj is row-parallel: each rank multiplies its heads' slice, then one all-reduce sums.
- MLP: the fused [gate | up] rows are split separately (gate rows and up rows of the same
  intermediate slice), down_proj is row-parallel with one all-reduce.
- Row-parallel biases are kept on TP rank 0 only, so the all-reduce adds them once.
- Vocabulary: rows [r*ceil(V/tp), ...) per rank, the last shard padded with zero rows so
  every rank's logits shard has the same width (gather, then trim to V). The embedding
  looks up ids in its range, zeroes the rest and all-reduces: the sum has one non-zero term
  per token, so it is exact.
Invariant: after sharding, the layer's attributes (num_heads, q_size, intermediate_size, …)
describe the local shard, so the unchanged model code computes the local part.
The all-reduce changes the summation order of o_proj/down_proj versus one process: results
agree to float rounding, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig


def check_tp(config: ModelConfig, tp: int) -> None:
    """Raise ValueError when the model cannot be split `tp` ways."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide num_attention_heads={heads}; choose a divisor of {heads}"
        )
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} and num_key_value_heads={kv_heads}: one must divide the other "
            "(kv heads are split when tp divides them and replicated when they divide tp)"
        )
    if config.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide intermediate_size={config.intermediate_size}")


def check_tp_weights(tp: int, quantization: str | None) -> None:
    """Raise ValueError when the weights cannot be split `tp` ways before anything loads (the CRD's twin rule:
    operator/api/rules.py, "parallelism.tensor > 1 needs model.quantization none")."""
    if tp > 1 and quantization is not None:
        raise ValueError(
            f"tensor_parallel_size={tp} with quantization={quantization!r}: tensor parallelism splits only "
            "unquantized layers; run a quantized model with tensor_parallel_size=1"
        )


def local_kv_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads each rank holds (and caches): a split, or one replica when kv heads < tp."""
    return max(num_kv_heads // tp, 1)


def kv_head_range(num_kv_heads: int, tp: int, tp_rank: int) -> range:
    """The KV heads tensor rank `tp_rank` of `tp` caches (global head indices; see `local_kv_heads`)."""
    if num_kv_heads % tp == 0:
        per = num_kv_heads // tp
        return range(tp_rank * per, (tp_rank + 1) * per)
    head = tp_rank // (tp // num_kv_heads)  # the kv head shared by this rank's q heads
    return range(head, head + 1)


def _keep(tensor: torch.Tensor, rows: list[slice], dim: int = 0) -> nn.Parameter:
    """A new parameter made of the given row (or column) slices, copied so the full tensor can be freed."""
    parts = [tensor[sl] if dim == 0 else tensor[:, sl] for sl in rows]
    return nn.Parameter(torch.cat(parts, dim=dim).contiguous(), requires_grad=False)


def _all_reduce_hook(group: dist.ProcessGroup | None) -> Callable[[nn.Module, tuple, torch.Tensor], None]:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        dist.all_reduce(output, group=group)

    return hook


@dataclass(slots=True, frozen=True)
class TPShard:
    """What TP rank `tp_rank` of `tp` keeps of one decoder layer, in each projection's own output features.

    `q`: rows of q_proj (= columns of o_proj's input); `kv`: rows of k_proj and of v_proj (a split, or the
    replica of the one kv head this rank's q heads read); `inter`: rows of gate_proj and of up_proj
    (= columns of down_proj's input). The one source of the shard arithmetic: the base weights
    (`shard_layer`) and the LoRA adapters (`distributed/lora_tp.py`) are both cut with it.
    """

    q: slice
    kv: slice
    inter: slice

    @classmethod
    def of(
        cls, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int, tp: int, tp_rank: int
    ) -> TPShard:
        local_heads = num_heads // tp
        kv_range = kv_head_range(num_kv_heads, tp, tp_rank)
        local_inter = intermediate_size // tp
        return cls(
            slice(tp_rank * local_heads * head_dim, (tp_rank + 1) * local_heads * head_dim),
            slice(kv_range.start * head_dim, kv_range.stop * head_dim),
            slice(tp_rank * local_inter, (tp_rank + 1) * local_inter),
        )

    @classmethod
    def for_model(cls, config: ModelConfig, tp: int, tp_rank: int) -> TPShard:
        return cls.of(
            config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.intermediate_size,
            tp, tp_rank,
        )  # fmt: skip


def _offset(rows: slice, start: int) -> slice:
    return slice(start + rows.start, start + rows.stop)


def shard_layer(layer: nn.Module, tp: int, tp_rank: int, group: dist.ProcessGroup | None) -> None:
    """Slice one LlamaDecoderLayer's attention and MLP to TP rank `tp_rank` of `tp`, in place."""
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(getattr(attn, "qkv_weight", None), nn.Parameter) or not isinstance(
        getattr(mlp, "gate_up_weight", None), nn.Parameter
    ):
        raise ValueError(
            "tensor parallelism needs the plain (unquantized) Llama layers; "
            "this model's layers were swapped (quantized?): run it with tensor_parallel_size=1"
        )
    shard = TPShard.of(attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.intermediate_size, tp, tp_rank)
    q_rows = shard.q
    k_rows = _offset(shard.kv, attn.q_size)
    v_rows = _offset(shard.kv, attn.q_size + attn.kv_size)
    attn.qkv_weight = _keep(attn.qkv_weight.data, [q_rows, k_rows, v_rows])
    if attn.qkv_bias is not None:
        attn.qkv_bias = _keep(attn.qkv_bias.data, [q_rows, k_rows, v_rows])
    attn.o_weight = _keep(attn.o_weight.data, [q_rows], dim=1)
    if attn.o_bias is not None and tp_rank != 0:
        attn.o_bias = None
    local_kv = (shard.kv.stop - shard.kv.start) // attn.head_dim
    attn.num_heads, attn.num_kv_heads = attn.num_heads // tp, local_kv
    attn.q_size, attn.kv_size = q_rows.stop - q_rows.start, shard.kv.stop - shard.kv.start

    gate = shard.inter
    up = _offset(gate, mlp.intermediate_size)
    mlp.gate_up_weight = _keep(mlp.gate_up_weight.data, [gate, up])
    if mlp.gate_up_bias is not None:
        mlp.gate_up_bias = _keep(mlp.gate_up_bias.data, [gate, up])
    mlp.down_weight = _keep(mlp.down_weight.data, [gate], dim=1)
    if mlp.down_bias is not None and tp_rank != 0:
        mlp.down_bias = None
    mlp.intermediate_size = gate.stop - gate.start

    attn.register_forward_hook(_all_reduce_hook(group))
    mlp.register_forward_hook(_all_reduce_hook(group))


@dataclass(slots=True, frozen=True)
class VocabShard:
    """Rows [start, stop) of the vocabulary on one rank; `width` rows stored (the last shard zero-padded)."""

    start: int
    stop: int
    width: int

    @classmethod
    def of(cls, vocab_size: int, tp: int, tp_rank: int) -> VocabShard:
        width = -(-vocab_size // tp)
        start = min(tp_rank * width, vocab_size)
        return cls(start, min(start + width, vocab_size), width)

    def slice_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """This shard's rows of a [V, hidden] table, zero-padded to `width` rows."""
        rows = weight[self.start : self.stop]
        if rows.shape[0] == self.width:
            return rows.clone()
        padded = torch.zeros(self.width, weight.shape[1], dtype=weight.dtype, device=weight.device)
        padded[: rows.shape[0]] = rows
        return padded


def vocab_parallel_embedding(
    input_ids: torch.Tensor, weight: torch.Tensor, shard: VocabShard, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Embedding rows for ids in this shard, zeros elsewhere, summed over the TP group."""
    in_shard = (input_ids >= shard.start) & (input_ids < shard.stop)
    local_ids = torch.where(in_shard, input_ids - shard.start, torch.zeros_like(input_ids))
    out = F.embedding(local_ids, weight)
    out.mul_(in_shard.unsqueeze(1).to(out.dtype))
    dist.all_reduce(out, group=group)
    return out
