"""The single attention dispatch point: paged attention over the KV cache.

`paged_attention` stores the step's new K/V into the paged cache (layout
[num_blocks, block_size, num_kv_heads, head_dim]) and attends; the model never sees which
implementation ran.

- CUDA tensors (with the runner's int32 kernel views in the metadata): Triton kernels through
  `tidepool.kernels.dispatch`: `store_kv`, paged decode for the decode rows (split-K when the
  batch is small), and one varlen flash-attention launch for all prefill chunks, reading
  cached prefix and new tokens from the paged cache.
- CPU tensors with the kernel views, when the compiled CPU op is available
  (`tidepool.engine.cpu_ops`, switched by TIDEPOOL_CPU_ATTENTION): one call for the whole step,
  decodes and prefill chunks alike, reading each sequence's blocks in place (no gather, no
  padding; the query heads of a KV head share each K/V read). On the CPU the runner's backend
  (`engine/runner_backend.py`, chosen once per runner) attaches the views only when
  `cpu_kernel_available()`, and then skips the torch path's decode mask and scratch.
- Otherwise (the reference and fallback), torch's scaled_dot_product_attention: decodes are
  batched by gathering each sequence's blocks (padded to the longest, masked); prefill chunks go
  one by one, attending to the cached prefix plus the chunk, causally aligned to the end of the
  sequence. GQA/MQA via `enable_gqa`. Given views without a decode mask (a worker whose op
  failed to load while rank 0's did), it builds the mask from the views.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from ...kernels import dispatch
from .. import cpu_ops
from .attention_metadata import AttentionMetadata

MAX_KERNEL_HEAD_DIM = 256  # the Triton kernels hold a head row in registers; larger heads take the SDPA path


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    if k.dtype == torch.float32 and k.device.type == "cpu":  # a float32 cache: one compiled copy when available
        op = cpu_ops.fused_op()
        if op is not None and op.store_kv(k, v, k_cache, v_cache, slots):
            return
    dispatch.store_kv(k, v, k_cache, v_cache, slots)


def cpu_kernel_available() -> bool:
    """Whether CPU steps take the compiled op (decided once per process; may build it, logs which path)."""
    return cpu_ops.paged_attention_op() is not None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] (this step's tokens) -> [T, Hq, D]."""
    has_views = meta.block_tables is not None and meta.seq_lens is not None and meta.cu_seqlens_q is not None
    if q.is_cuda and has_views and q.shape[-1] <= MAX_KERNEL_HEAD_DIM:
        return _paged_attention_triton(q, k, v, k_cache, v_cache, meta, scale)
    if has_views and not q.is_cuda:
        op = cpu_ops.paged_attention_op()
        if op is not None and op.supports(q, k_cache):
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            out = torch.empty(q.shape, dtype=q.dtype)
            views = (meta.block_tables, meta.seq_lens, meta.cu_seqlens_q)
            return op(q, k_cache, v_cache, *views, scale, meta.sliding_window, out=out)
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    num_decode = meta.num_decode_seqs
    if num_decode:
        out[:num_decode] = _decode(q[:num_decode], k_cache, v_cache, meta, scale)
    for chunk in meta.prefills:
        sl = slice(chunk.query_start, chunk.query_start + chunk.num_query_tokens)
        if chunk.mask is None:
            keys, values = k[sl], v[sl]
        else:
            keys = _gather(k_cache, chunk.block_ids, chunk.context_len)
            values = _gather(v_cache, chunk.block_ids, chunk.context_len)
        attn = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[sl] = attn.transpose(0, 1)
    return out


def _paged_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    dispatch.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_decode = meta.num_decode_seqs
    window = meta.sliding_window
    if num_decode:
        tables, lens = meta.block_tables[:num_decode], meta.seq_lens[:num_decode]
        dispatch.paged_attention_decode(
            q[:num_decode], k_cache, v_cache, tables, lens, scale, sliding_window=window, out=out[:num_decode]
        )
    if meta.prefills:
        # cu_seqlens_q holds absolute row offsets, so the prefill rows are addressed inside the full q/out.
        dispatch.flash_attention_varlen(
            q,
            k_cache,
            v_cache,
            meta.cu_seqlens_q[num_decode:],
            meta.seq_lens[num_decode:],
            meta.block_tables[num_decode:],
            scale,
            sliding_window=window,
            out=out,
        )
    return out


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    blocks = cache.index_select(0, block_ids)
    return blocks.view(-1, cache.shape[2], cache.shape[3])[:length]


def _decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    num_seqs, max_blocks = meta.decode_block_tables.shape
    flat = meta.decode_block_tables.reshape(-1)
    shape = (num_seqs, max_blocks * k_cache.shape[1], k_cache.shape[2], k_cache.shape[3])
    if meta.decode_kv_scratch is None:
        keys, values = k_cache.index_select(0, flat), v_cache.index_select(0, flat)
    else:
        keys, values = meta.decode_kv_scratch
        torch.index_select(k_cache, 0, flat, out=keys)
        torch.index_select(v_cache, 0, flat, out=values)
    keys, values = keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)
    mask = meta.decode_mask
    if mask is None and meta.seq_lens is not None:
        lens = meta.seq_lens[:num_seqs].tolist()
        mask = build_decode_mask(lens, shape[1], meta.sliding_window, q.device)
    attn = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return attn.squeeze(2)


def attach_kernel_views(
    meta: AttentionMetadata,
    block_tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    sliding_window: int | None,
) -> None:
    """Fill the kernel-facing int32 views (sequences in token-layout order) with one host-to-device copy.

    Block tables are padded with block 0; the kernels never read an entry past a sequence's length.
    """
    num_seqs = len(seq_lens)
    max_blocks = max((len(t) for t in block_tables), default=0)
    flat: list[int] = []
    for table in block_tables:
        flat.extend(table)
        flat.extend([0] * (max_blocks - len(table)))
    host = torch.tensor(flat + seq_lens + list(itertools.accumulate(query_lens, initial=0)), dtype=torch.int32)
    device_buf = host.to(meta.slot_mapping.device)
    num_table = num_seqs * max_blocks
    meta.block_tables = device_buf[:num_table].view(num_seqs, max_blocks)
    meta.seq_lens = device_buf[num_table : num_table + num_seqs]
    meta.cu_seqlens_q = device_buf[num_table + num_seqs :]
    meta.sliding_window = sliding_window


def build_decode_mask(
    seq_lens: list[int], num_key_slots: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """Key positions each decode query may see: [0, seq_len) minus anything outside the window."""
    lens = torch.tensor(seq_lens, device=device).unsqueeze(1)
    positions = torch.arange(num_key_slots, device=device).unsqueeze(0)
    mask = positions < lens
    if sliding_window is not None:
        mask &= positions > lens - 1 - sliding_window
    return mask[:, None, None, :]


def build_prefill_mask(
    start: int, num_query: int, context_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Causal mask with queries aligned to the end of the context; None when plain causal suffices."""
    if start == 0 and (sliding_window is None or sliding_window >= context_len):
        return None
    query_pos = torch.arange(start, start + num_query, device=device).unsqueeze(1)
    key_pos = torch.arange(context_len, device=device).unsqueeze(0)
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask
