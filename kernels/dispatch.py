"""The one dispatch point between Tidepool's layers and its kernels.

Each function picks an implementation from the tensors it is given, at call time (never a
device query at import): Triton kernels for CUDA tensors, torch code elsewhere. Layers in
the engine call these and nothing else, so the model code never knows which ran. Kernel
modules are imported lazily, on the first CUDA call: importing this module (the engine does)
neither needs Triton nor decorates kernels, so tests can still switch Triton's interpreter on
before the kernels are compiled.

Quantized linears take the layouts documented in ``int4_packing`` (int4) and below (int8):
int8 weights are ``[N, K]`` (a ``torch.nn.Linear`` weight) with one float scale per output
channel ``[N]``: ``W[n, k] = w_int8[n, k] * scales[n]``.

Attention takes the paged KV cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` and
int32 block tables / sequence lengths / query offsets (see the kernel modules for shapes).
On CPU the attention and norm entry points run the torch references (a loop over sequences
for attention); the engine's CPU path keeps its own batched SDPA and norm code instead, so
on a CPU-only machine the engine never imports a kernel module.
"""

from __future__ import annotations

import sys

import torch

from .int4_packing import check_int4_shapes, dequantize_int4, offset_args


def int8_linear(
    x: torch.Tensor, w_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` with per-output-channel int8 weights ``[N, K]`` and scales ``[N]``."""
    if x.is_cuda:
        from .int8_matmul import int8_matmul

        y = int8_matmul(x.reshape(-1, x.shape[-1]), w_int8, scales).view(*x.shape[:-1], w_int8.shape[0])
    else:
        # CPU: the scale commutes with the reduction, so convert the int8 weight and scale the
        # (much smaller) output instead of the weight.
        y = torch.nn.functional.linear(x, w_int8.to(x.dtype)) * scales.to(x.dtype)
    return y if bias is None else y + bias


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` with group-wise int4 weights in Tidepool's packing (``int4_packing``).

    The group offset is either ``zeros`` (``W = (q - z) * s``) or ``mins`` (``W = q * s + m``).
    """
    if x.is_cuda:
        from .int4_matmul import int4_matmul

        y2 = int4_matmul(x.reshape(-1, x.shape[-1]), qweight, scales, zeros, group_size, mins=mins)
        y = y2.view(*x.shape[:-1], qweight.shape[1])
    elif sys.byteorder == "little":
        y = _int4_matmul_cpu(x.reshape(-1, x.shape[-1]), qweight, scales, zeros, group_size, mins)
        y = y.view(*x.shape[:-1], qweight.shape[1])
    else:
        y = x @ dequantize_int4(qweight, scales, zeros, group_size, dtype=x.dtype, mins=mins)
    return y if bias is None else y + bias


def _int4_matmul_cpu(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """CPU int4 matmul ``x [M, K]`` without materialising the dequantized weight.

    Integer shifts/masks are slow elementwise ops on CPU; instead each packed int32 is read as its
    four little-endian bytes (byte j of word r holds rows 8r+2j (low nibble) and 8r+2j+1 (high)),
    converted to float once and split with float ops: ``high = floor(b / 16)``, ``low = b - 16 * high``
    (in place; folding ``low`` away algebraically would cancel badly in bfloat16).
    Scales and offsets are applied per group to the small partial products:
    ``y = sum_g s_g * (x_g @ q_g) - (sum_g x_g) @ (s * z)`` with zero points, or
    ``... + (sum_g x_g) @ m`` with mins.
    """
    offset, is_min = offset_args(zeros, mins)
    k = check_int4_shapes(qweight, scales, offset, group_size)
    n = qweight.shape[1]
    num_groups, rows = k // group_size, group_size // 2
    # [K/8, 4, N] in float: byte j of every word, laid out so each group is one [rows, N] matrix.
    packed = qweight.view(torch.uint8).view(k // 8, n, 4).permute(0, 2, 1)
    both = packed.to(x.dtype, memory_format=torch.contiguous_format).view(num_groups, rows, n)
    high = torch.div(both, 16, rounding_mode="floor")
    low = both.sub_(high, alpha=16)
    xv = x.reshape(-1, k // 8, 4, 2)
    x_low = xv[..., 0].reshape(-1, num_groups, rows).transpose(0, 1)  # [G, M, rows]
    x_high = xv[..., 1].reshape(-1, num_groups, rows).transpose(0, 1)
    partial = torch.baddbmm(torch.bmm(x_low, low), x_high, high)  # [G, M, N]: x_g @ q_g
    scales = scales.to(x.dtype)
    y = (partial * scales.unsqueeze(1)).sum(dim=0)
    group_sums = x.reshape(-1, num_groups, group_size).sum(dim=-1)  # [M, G]
    if is_min:
        return y + group_sums @ offset.to(x.dtype)
    return y - group_sums @ (scales * offset.to(x.dtype))


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``k``/``v`` ``[num_tokens, num_kv_heads, head_dim]`` into the paged cache at ``slot_mapping``."""
    if k.is_cuda:
        from .store_kv import store_kv as kernel

        kernel(k, v, k_cache, v_cache, slot_mapping)
        return
    # CPU: index_copy_ into the flattened slots (what store_kv_ref does, minus the checks on the hot path).
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence over its cached keys (``kernels.paged_attention_decode``)."""
    if q.is_cuda:
        from .paged_attention_decode import paged_attention_decode as impl
    else:
        from .paged_attention_decode import paged_attention_decode_ref as impl
    return impl(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=sliding_window, out=out)


def flash_attention_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new query chunks over the cache (``kernels.flash_attention_varlen``)."""
    if q.is_cuda:
        from .flash_attention_varlen import flash_attention_varlen as impl
    else:
        from .flash_attention_varlen import flash_attention_varlen_ref as impl
    window = sliding_window
    return impl(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, sliding_window=window, out=out)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in place on ``x [tokens, heads, head_dim]`` with sign-folded sin (``kernels.rotary``)."""
    if x.is_cuda:
        from .rotary import rotary_ as impl
    else:
        from .rotary import rotary_ref as impl
    return impl(x, cos, sin_signed)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm, fused with the residual add when ``residual`` is given (then returns ``(normed, x + residual)``)."""
    if x.is_cuda:
        from .rms_norm import rms_norm as impl
    else:
        from .rms_norm import rms_norm_ref as impl
    return impl(x, weight, eps, residual)


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    sub_offsets: tuple[int, ...],
    slots: torch.Tensor,
    ranks: torch.Tensor,
) -> None:
    """Add multi-LoRA deltas to ``y`` in place (layout in ``kernels.lora_ref``; ``kernels.lora_shrink_expand``)."""
    if x.is_cuda:
        from .lora_shrink_expand import lora_apply as impl
    else:
        from .lora_ref import lora_apply_ref as impl
    impl(y, x, a, b, sub_offsets, slots, ranks)
