"""2:4-sparse projections on CUDA: torch's semi-structured sparse tensors behind `SparseWeight`'s F.linear.

Role: `semi_structured_linear(weight, x, bias)` is what a `SparseWeight` (`weight.py`) does with a CUDA input.
The first call unpacks the weight (`format.unpack_2to4`: int8 values times their scales) to the input's dtype and
converts it once with ``torch.sparse.to_sparse_semi_structured`` (the 2:4 pattern is the tidepool-2:4 one: two
kept values in every group of 4 consecutive input columns of a row, which is what NVIDIA's sparse tensor cores
and cuSPARSELt/CUTLASS take); later calls reuse it (`weight.semi`; the unpacked dense weight where the
semi-structured path does not apply).

Constraints (torch's; a weight that does not meet them falls back to a dense F.linear over the unpacked weight,
logged once with the reason, instead of failing mid-step):
- a GPU of compute capability 8.0 or later (Ampere, Hopper, ...);
- float16 or bfloat16 inputs (float32 would take CUTLASS's TF32 path, which changes the arithmetic; it runs
  dense); int8 kept values are dequantized to the input's dtype (weight-only int8 is not an int8 GEMM);
- the weight's [out, in] multiples of the backend's minimum tile: cuSPARSELt (torch's default where it is built
  in) 16 x 16, CUTLASS 32 x 64 for 16-bit types; SmolLM2's and Llama's projections meet both. Checked by
  attempting the conversion (torch's own check), so the rule stays torch's. The input's rows are padded by torch.

Exercised by `bench/gpu_check_sparsity.py` when a GPU is lent (no GPU on the development machine); the tests skip
the CUDA cases with reason "no GPU".
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SEMI_DTYPES = (torch.float16, torch.bfloat16)
_WARNED: set[str] = set()  # weights already logged as running dense (one line each, not one per step)


class SparseWeight(Protocol):
    """What this module needs of `weight.SparseWeight` (a Protocol, so the two modules do not import each other)."""

    name: str
    out_features: int
    semi: torch.Tensor | None

    def dense(self) -> torch.Tensor: ...


def semi_structured_reason(weight: SparseWeight, x: torch.Tensor) -> str | None:
    """Why this weight and input cannot take the semi-structured path, or None when they can."""
    if x.device.type != "cuda":
        return f"the input is on {x.device.type}, not CUDA"
    if x.dtype not in SEMI_DTYPES:
        return f"the input is {x.dtype}; semi-structured sparsity here takes float16 or bfloat16"
    if torch.cuda.get_device_capability(x.device) < (8, 0):
        return "the GPU's compute capability is below 8.0 (no sparse tensor cores)"
    return None


def _to_semi_structured(weight: SparseWeight, x: torch.Tensor) -> torch.Tensor | str:
    """The weight as a semi-structured sparse tensor in x's dtype and device, or why it cannot be one."""
    reason = semi_structured_reason(weight, x)
    if reason is not None:
        return reason
    from torch.sparse import to_sparse_semi_structured

    try:
        return to_sparse_semi_structured(weight.dense().to(device=x.device, dtype=x.dtype).contiguous())
    except RuntimeError as err:  # shape or backend constraints (the message says which)
        return str(err)


def semi_structured_linear(weight: SparseWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for a CUDA input, W as a semi-structured sparse tensor where it qualifies."""
    if weight.semi is None or weight.semi.dtype != x.dtype:
        semi = _to_semi_structured(weight, x)
        if isinstance(semi, str):
            if weight.name not in _WARNED:
                logger.warning("2:4 weight %s runs dense on CUDA: %s", weight.name, semi)
                _WARNED.add(weight.name)
            semi = weight.dense().to(device=x.device, dtype=x.dtype)  # kept, so the unpack runs once
        weight.semi = semi
    shape = x.shape
    y = F.linear(x.reshape(-1, shape[-1]), weight.semi).view(*shape[:-1], weight.out_features)
    return y if bias is None else y + bias
