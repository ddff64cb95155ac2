"""Rotary position embedding (Llama/NeoX "rotate half" style) with default, linear and llama3 scaling.

The cos/sin table is computed once in float32 up to the model's max positions and indexed by
each token's position, so chunked prefill and decode give the same values as a full forward.
The sin table is stored sign-folded, ``sin_signed = cat(-sin, sin)``, so that
``rotate_half(x) * sin == swap_halves(x) * sin_signed`` exactly: on CPU the rotation is four
ops in place (roll, two multiplies, an add; the torch form took six and two temporaries), or in
float32 one compiled call (`cpu_ops.fused_op()`, the same products and sum, bit-identical) when it
is available; on CUDA one Triton kernel for q and k together (`tidepool.kernels.rotary`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ...kernels import dispatch
from .. import cpu_ops


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)
        positions = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)
        self.register_buffer("cos_cached", torch.cat((freqs.cos(), freqs.cos()), dim=-1), persistent=False)
        self.register_buffer("sin_cached", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token cos and sign-folded sin rows, [num_tokens, head_dim] in `dtype` (once per step)."""
        return self.cos_cached[positions].to(dtype), self.sin_cached[positions].to(dtype)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] in place (heads contiguous, any token stride); returns x.

    The torch path's arithmetic is bit-identical to Hugging Face's ``x * cos + rotate_half(x) * sin``
    in x's dtype: each product is rounded, then the sum (addcmul would fuse the multiply-add into one
    rounding, more accurate but no longer identical); so is the compiled float32 op's.
    """
    if x.is_cuda:
        return dispatch.rotary_(x, cos, sin_signed)
    if x.dtype == torch.float32:
        op = cpu_ops.fused_op()
        if op is not None and op.rotary_(x, cos, sin_signed) is not None:
            return x
    swapped = x.roll(x.shape[-1] // 2, dims=-1).mul_(sin_signed.unsqueeze(1))
    return x.mul_(cos.unsqueeze(1)).add_(swapped)
