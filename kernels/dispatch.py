"""The one dispatch point between Tidepool's layers and its kernels.

Each function picks an implementation from the tensors it is given, at call time (never a
device query at import): Triton kernels for CUDA tensors, torch code elsewhere. Layers in
the engine call these and nothing else, so the model code never knows which ran.

Quantized linears take the layouts documented in ``int4_packing`` (int4) and below (int8):
int8 weights are ``[N, K]`` (a ``torch.nn.Linear`` weight) with one float scale per output
channel ``[N]``: ``W[n, k] = w_int8[n, k] * scales[n]``.
"""

from __future__ import annotations

import torch

from .int4_packing import dequantize_int4


def int8_linear(
    x: torch.Tensor, w_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` with per-output-channel int8 weights ``[N, K]`` and scales ``[N]``."""
    # CPU: the scale commutes with the reduction, so convert the int8 weight and scale the
    # (much smaller) output instead of the weight.
    y = torch.nn.functional.linear(x, w_int8.to(x.dtype)) * scales.to(x.dtype)
    return y if bias is None else y + bias


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` with group-wise int4 weights in Tidepool's packing (``int4_packing``)."""
    w = dequantize_int4(qweight, scales, zeros, group_size, dtype=x.dtype)
    y = x @ w
    return y if bias is None else y + bias
