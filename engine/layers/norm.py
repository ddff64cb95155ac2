"""RMSNorm with an optional fused residual add, matching Hugging Face's arithmetic (norm in float32).

On CUDA the add and the norm run as one Triton kernel (`tidepool.kernels.dispatch.rms_norm`,
same arithmetic); on the CPU in float32 as one compiled call (`cpu_ops.fused_op()`, same order of
operations) when it is available; elsewhere torch's `rms_norm`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import dispatch
from .. import cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new residual); with a residual, the input is added to it first."""
        if x.is_cuda:
            if residual is None:
                return dispatch.rms_norm(x, self.weight, self.eps), x
            return dispatch.rms_norm(x, self.weight, self.eps, residual)
        if x.dtype == torch.float32 and x.device.type == "cpu":  # cheap checks first; the op checks the rest
            op = cpu_ops.fused_op()
            fused = None if op is None else op.add_rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
        if residual is not None:
            x = x + residual
        residual = x
        shape = (x.shape[-1],)
        if x.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps), residual
        # Low precision: normalise in float32, round, then scale, exactly as Hugging Face does.
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype), residual
