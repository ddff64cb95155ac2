"""SwiGLU's elementwise half: `silu_mul(gate_up)` = silu(gate) * up for a fused gate/up projection.

The projection's output is `[tokens, 2 * inter]`, gate first (how `LlamaMLP` stores the weights). On
the CPU in float32 one compiled call (`cpu_ops.fused_op()`) when it is available; elsewhere torch's
`silu` and an in-place multiply (one temporary). The two differ only in exp's last bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import cpu_ops


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.dtype == torch.float32 and gate_up.device.type == "cpu":
        op = cpu_ops.fused_op()
        out = None if op is None else op.silu_mul(gate_up)
        if out is not None:
            return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
