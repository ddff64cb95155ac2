"""Write a step's new K/V rows into the paged KV cache.

Cache layout (K and V alike): ``[num_blocks, block_size, num_kv_heads, head_dim]``; token
``t`` goes to flat slot ``slot_mapping[t]``, i.e. block ``slot // block_size``, row
``slot % block_size``. One program per token copies all its KV heads (a ``[heads, head_dim]``
tile), so the launch is independent of the cache size. ``k``/``v`` may be strided views (the
engine slices them out of a fused qkv projection); only their last dimension must be contiguous.
Slots must be distinct and in range (the scheduler guarantees it; the kernel does not check).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import (
    check_dim,
    check_int,
    check_kv_cache,
    check_last_contiguous,
    check_same_device,
    checked_once,
    next_power_of_2,
)


@triton.jit
def _store_kv_kernel(
    K,
    V,
    K_CACHE,
    V_CACHE,
    SLOTS,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    row = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    dst = row + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(K + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    tl.store(K_CACHE + dst, k, mask=mask)
    v = tl.load(V + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(V_CACHE + dst, v, mask=mask)


@checked_once
def _check(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    for name, t in (("k", k), ("v", v)):
        check_dim(name, t, 3, "[num_tokens, num_kv_heads, head_dim]")
        if tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            expected = f"[num_tokens, {num_kv_heads}, {head_dim}]"
            raise ValueError(f"{name} must be {expected} for this cache, got {tuple(t.shape)}")
        if t.dtype != k_cache.dtype:
            raise ValueError(f"{name} ({t.dtype}) must have the cache's dtype ({k_cache.dtype})")
        check_last_contiguous(name, t)
    check_dim("slot_mapping", slots, 1, "[num_tokens]")
    check_int("slot_mapping", slots, (torch.int32, torch.int64))
    if not k.shape[0] == v.shape[0] == slots.shape[0]:
        raise ValueError(f"k, v and slot_mapping disagree on num_tokens: {k.shape[0]}, {v.shape[0]}, {slots.shape[0]}")
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Copy ``k``/``v`` ``[num_tokens, num_kv_heads, head_dim]`` into their cache slots (in place)."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Torch reference of :func:`store_kv` (also the CPU path): an index copy into the flattened slots."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping.long()
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)
