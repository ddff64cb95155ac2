"""Fused residual add + RMSNorm, one row per program.

``rms_norm(x, weight, eps, residual=None)``: ``x [..., hidden]`` (last dimension contiguous),
``weight [hidden]`` of x's dtype. Without a residual it returns ``normed``; with one
(same shape and dtype as x) it returns ``(normed, x + residual)``, the second being the new
residual stream, so a decoder layer reads its activations once instead of three times.

Arithmetic follows Hugging Face's Llama RMSNorm exactly, so the engine's outputs do not
drift from ``transformers``: the sum ``x + residual`` is rounded to x's dtype, normalised in
float32, rounded to x's dtype again, and only then multiplied by the weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._checks import check_float, check_last_contiguous, check_same_device, checked_once, next_power_of_2

MAX_HIDDEN = 65536  # one row must fit a register tile


@triton.jit
def _rms_norm_kernel(
    X,
    RESIDUAL,
    WEIGHT,
    OUT,
    RESIDUAL_OUT,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(RESIDUAL + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x_rounded = x.to(RESIDUAL_OUT.dtype.element_ty)
        tl.store(RESIDUAL_OUT + row * stride_ro + cols, x_rounded, mask=mask)
        x = x_rounded.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = (x * inv_rms).to(OUT.dtype.element_ty).to(tl.float32)
    weight = tl.load(WEIGHT + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (normed * weight).to(OUT.dtype.element_ty), mask=mask)


@checked_once
def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    check_float("x", x)
    if x.dim() < 1 or not 1 <= x.shape[-1] <= MAX_HIDDEN:
        raise ValueError(f"x must be [..., hidden] with 1 <= hidden <= {MAX_HIDDEN}, got {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{x.shape[-1]}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    check_last_contiguous("x", x)
    check_last_contiguous("weight", weight)
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual must match x ({tuple(x.shape)} {x.dtype}), got {tuple(residual.shape)} {residual.dtype}"
            )
        check_last_contiguous("residual", residual)
        check_same_device(x=x, weight=weight, residual=residual)
    else:
        check_same_device(x=x, weight=weight)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``normed`` or, with ``residual``, ``(normed, x + residual)`` (see the module docstring)."""
    _check(x, weight, residual)
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res2 = residual.reshape(-1, hidden) if residual is not None else x2
    res_out = torch.empty_like(out) if residual is not None else out
    if x2.shape[0]:
        block = next_power_of_2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            res2,
            weight,
            out,
            res_out,
            x2.stride(0),
            res2.stride(0),
            out.stride(0),
            res_out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(max(block // 512, 1), 16),
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (and the CPU path), Hugging Face's arithmetic."""
    _check(x, weight, residual)
    if residual is not None:
        x = x + residual
    shape = (x.shape[-1],)
    if x.dtype == torch.float32:
        normed = F.rms_norm(x, shape, weight, eps)
    else:
        normed = weight * F.rms_norm(x.float(), shape, None, eps).to(x.dtype)
    return normed if residual is None else (normed, x)
