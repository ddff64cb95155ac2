"""Rotary position embedding ("rotate half", Llama/NeoX style) applied in place, one launch for q and k.

``rotary_(x, cos, sin_signed)``: ``x [num_tokens, num_heads, head_dim]`` (last two dimensions
contiguous, any token stride: the engine passes the q and k heads of its fused qkv output as one
view), ``cos``/``sin_signed [num_tokens, head_dim]`` float32 rows for each token's position, where
``sin_signed = cat(-sin, sin)`` of the half-width frequencies. Each row becomes
``x * cos + swap_halves(x) * sin_signed``, which equals Hugging Face's
``x * cos + rotate_half(x) * sin`` (the sign sits in the table instead of a negation). Works
for any even head_dim (64, 80, 96, 128, ...): the partner of column ``i`` is ``(i + D/2) mod D``.

The arithmetic runs in float32 and rounds once to x's dtype (Hugging Face rounds cos/sin and each
product to x's dtype first: equal in float32 up to the last bit of the sum, a little more accurate
in bfloat16/float16). One program handles ``BLOCK_H`` heads of one token, so the token's cos/sin
row is read once for all of them, and the five elementwise launches of the torch form become one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_dim, check_float, check_last_contiguous, check_same_device, checked_once, next_power_of_2


@triton.jit
def _rotary_kernel(
    X,
    COS,
    SIN,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    half = HEAD_DIM // 2
    partner = tl.where(cols < half, cols + half, cols - half)
    col_mask = cols < HEAD_DIM
    mask = (heads[:, None] < num_heads) & col_mask[None, :]
    cos = tl.load(COS + token * stride_ct + cols, mask=col_mask, other=0.0).to(tl.float32)
    sin = tl.load(SIN + token * stride_st + cols, mask=col_mask, other=0.0).to(tl.float32)
    rows = X + token * stride_xt + heads[:, None] * stride_xh
    x = tl.load(rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    swapped = tl.load(rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    out = x * cos[None, :] + swapped * sin[None, :]
    tl.store(rows + cols[None, :], out.to(X.dtype.element_ty), mask=mask)


@checked_once
def _check(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    check_float("x", x)
    check_dim("x", x, 3, "[num_tokens, num_heads, head_dim]")
    head_dim = x.shape[2]
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
    if x.numel() and x.stride(1) != head_dim:
        raise ValueError(f"x must have contiguous heads (stride(1) == head_dim), got strides {x.stride()}")
    check_last_contiguous("x", x)
    for name, t in (("cos", cos), ("sin_signed", sin_signed)):
        check_float(name, t)
        if tuple(t.shape) != (x.shape[0], head_dim):
            expected = f"[num_tokens, head_dim] = [{x.shape[0]}, {head_dim}]"
            raise ValueError(f"{name} must be {expected}, got {tuple(t.shape)}")
        check_last_contiguous(name, t)
    check_same_device(x=x, cos=cos, sin_signed=sin_signed)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` in place (see the module docstring); returns ``x``."""
    _check(x, cos, sin_signed)
    num_tokens, num_heads, head_dim = x.shape
    if x.numel() == 0:
        return x
    block_h = min(next_power_of_2(num_heads), 16)
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        x,
        cos,
        sin_signed,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin_signed.stride(0),
        num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=max(next_power_of_2(head_dim), 16),
        num_warps=4 if block_h * head_dim >= 1024 else 2,
    )
    return x


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Torch reference, in place: the same float32 arithmetic, one rounding to x's dtype."""
    _check(x, cos, sin_signed)
    half = x.shape[-1] // 2
    xf = x.float()
    swapped = torch.cat((xf[..., half:], xf[..., :half]), dim=-1)
    x.copy_(xf * cos.float().unsqueeze(1) + swapped * sin_signed.float().unsqueeze(1))
    return x
