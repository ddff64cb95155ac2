"""The engine's dense projections: `linear(x, weight, bias)`, F.linear's contract, faster at decode on CPU.

A float32 call with 1..`max_batch` (8) rows on the CPU (decode of a few sequences) goes to the compiled GEMV
(`engine/cpu_ops/gemv.py`) when it is available and the weight is a contiguous `[out, in]` tensor;
everything else (prefill, big batches, other dtypes, accelerators, quantized weights, TP-sliced
views) is `F.linear` itself. The two differ only in float summation order.

With the compiled GEMV in use the weights keep their `[out, in]` layout (`weight_layout` stores wide
float32 projections `[in, out]` only for the torch path, where that layout streams faster at one
row); `uses_compiled_gemv()` is what the model runner asks before choosing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidepool.engine import cpu_ops


def uses_compiled_gemv() -> bool:
    """True when float32 decode projections on the CPU run the compiled GEMV in this process."""
    return cpu_ops.gemv_op() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.device.type == "cpu" and x.dtype == torch.float32:  # cheap checks first; the op checks the rest
        op = cpu_ops.gemv_op()
        if op is not None and op.accepts(x, weight):
            y = op(x, weight)
            return y.add_(bias) if bias is not None else y
    return F.linear(x, weight, bias)
