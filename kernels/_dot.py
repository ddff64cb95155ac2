"""``tl.dot`` that also computes correctly under Triton's CPU interpreter.

Triton 3.9's interpreter stores bfloat16 tensors as raw uint16 bits and multiplies those bits
in ``tl.dot`` (numbers off by ~1e10). Under the interpreter the launchers therefore set
``UPCAST`` for bfloat16 inputs, and the operands are widened to float32 first: bfloat16
values are exact in float32 and the GPU accumulates in float32 too, so the result is the
same computation. Compiled kernels keep the native bfloat16 tensor-core path.

The interpreter also rounds float32 -> bfloat16 toward zero where GPUs round to nearest even,
so bfloat16 results under the interpreter may differ from the references by an ulp or two;
the tests' bfloat16 tolerances allow for that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def upcast_dot(dtype: torch.dtype) -> bool:
    """Whether kernels must widen ``dtype`` operands before ``tl.dot`` (read at launch time)."""
    return dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret)


@triton.jit
def mma(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` with float32 accumulation."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc
