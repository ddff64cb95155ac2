"""The engine's dense projections: `linear(x, weight, bias)`, F.linear's contract, faster at decode on CPU.

A float32 call with 1..`max_batch` (128) rows on the CPU (a decode batch) goes to the compiled GEMV
(`engine/cpu_ops/gemv.py`) when it is available and the weight is a contiguous `[out, in]` tensor;
everything else (longer prefill chunks, other dtypes, accelerators, quantized weights, TP-sliced
views) is `F.linear` itself, but for the transposed product below. They differ only in float
summation order.

With the compiled GEMV in use the weights keep their `[out, in]` layout (`weight_layout` stores wide
float32 projections `[in, out]` only for the torch path, where that layout streams faster at one
row); `uses_compiled_gemv()` is what the model runner asks before choosing.

Where the compiled GEMV is off (no compiler, ``TIDEPOOL_CPU_GEMV=torch``) or does not take the
call, a float32 CPU projection with a contiguous `[out, in]` weight and up to `TRANSPOSED_MAX_ROWS`
rows (a decode batch of tens of sequences) is computed as `(weight @ x.T).T`: the same products
(equal bit for bit from 16 rows up in bench/gemm_orientation.py, summed in another order at 9), but
MKL's kernel for that orientation (many output rows, few columns) ran 1.1-1.4x faster on the layer projections at
16-96 rows and up to 1.3-1.9x on a 49,152-row LM head (two runs); from 128 rows (prefill) F.linear's
is as fast or faster (bench/README.md, "Decode GEMM orientation").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidepool.engine import cpu_ops


def uses_compiled_gemv() -> bool:
    """True when float32 decode projections on the CPU run the compiled GEMV in this process."""
    return cpu_ops.gemv_op() is not None


TRANSPOSED_MAX_ROWS = 96


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.device.type == "cpu" and x.dtype == torch.float32:  # cheap checks first; the op checks the rest
        op = cpu_ops.gemv_op()
        y = None if op is None else op.try_call(x, weight)
        if y is None and x.dim() == 2 and x.shape[0] <= TRANSPOSED_MAX_ROWS and _plain_f32(weight):
            y = torch.mm(weight, x.t()).t().contiguous()
        if y is not None:
            return y.add_(bias) if bias is not None else y
    return F.linear(x, weight, bias)


def _plain_f32(weight: torch.Tensor) -> bool:
    """A contiguous `[out, in]` float32 CPU matrix (not a quantized weight, which answers F.linear itself, nor
    `weight_layout`'s transposed storage, which is tuned for F.linear)."""
    return (
        type(weight) in (torch.Tensor, torch.nn.Parameter)
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.is_contiguous()
    )
