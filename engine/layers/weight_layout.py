"""Per-shape weight layout for CPU decode: store a projection as [in, out] where that streams faster.

Role: a load-time transformation applied to a finished model (the model file is untouched).
The model computes every projection as ``F.linear(x, weight)`` with a ``[out, in]`` weight.
For a given ``[out, in]`` parameter we may instead keep the storage of its transpose
(``[in, out]``, contiguous) and expose it through a transposed view: the parameter still has
shape ``[out, in]``, so model code, checkpoint loading, TP slicing and ``state_dict`` see
nothing different, but ``F.linear`` now multiplies ``x @ W_in_out`` and the BLAS streams the
weight row by row, accumulating a vector of ``out`` values, instead of taking ``out`` short
dot products over ``in``.

Rule (measured on the development CPU with MKL, bench/README.md "Weight layout"): in float32, at
one token ``[in, out]`` is 1.5-1.9x faster when ``out > in`` (fused q/k/v, fused gate/up, the LM
head) and 0.65-0.75x when ``out <= in`` (o_proj, down_proj); from 4 tokens up both layouts are
within noise of each other, so one layout serves prefill and decode alike. In bfloat16/float16
torch's CPU kernels are ~10x slower on ``[in, out]``, so those weights keep ``[out, in]``.

Invariants:
- Only dense floating-point ``nn.Parameter``s with the projection names below change; quantized
  weights (modules) and anything on an accelerator (cuBLAS and the Triton kernels take their own
  layouts) are left alone.
- A parameter shared by two attributes (tied embeddings: the input table is the LM head) is
  converted once and stays shared; an embedding lookup on the transposed view is still exact.
- Idempotent: an already transposed parameter is recognised by its strides and skipped.
- Values are copied exactly; only the summation order inside the matmul changes (float rounding).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Parameters computed as F.linear(x, weight): the Llama layers' fused projections and the LM head.
PROJECTION_NAMES = frozenset({"qkv_weight", "o_weight", "gate_up_weight", "down_weight", "lm_head"})
# An input embedding table that is also the LM head (tied) is read whole by every decode step.
TIED_TABLE_NAME = "embed_tokens"


def prefers_input_major(out_features: int, in_features: int, dtype: torch.dtype = torch.float32) -> bool:
    """True when ``[in, out]`` storage is the faster GEMV on CPU (see the module docstring)."""
    return dtype == torch.float32 and out_features > in_features


def is_input_major(weight: torch.Tensor) -> bool:
    """A ``[out, in]`` tensor stored as the transpose of a contiguous ``[in, out]`` one."""
    return weight.dim() == 2 and weight.shape[0] > 1 and weight.stride() == (1, weight.shape[0])


@dataclass(slots=True)
class LayoutReport:
    converted: list[str] = field(default_factory=list)  # qualified parameter names now [in, out]
    num_bytes: int = 0  # bytes of the converted weights

    def summary(self) -> str:
        return f"{len(self.converted)} projection weights ({self.num_bytes / 2**20:.1f} MiB) stored [in, out]"


def _is_lm_head_table(module: nn.Module, name: str, param: nn.Parameter) -> bool:
    if name != TIED_TABLE_NAME:
        return False
    head = getattr(module, "lm_head", None)
    return head is None or head is param


def apply_weight_layout(model: nn.Module) -> LayoutReport:
    """Store each qualifying projection of `model` as ``[in, out]`` (in place); returns what changed."""
    report = LayoutReport()
    replaced: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) in replaced:  # the other attribute of a tied pair
                module._parameters[name] = replaced[id(param)]
                continue
            if name not in PROJECTION_NAMES and not _is_lm_head_table(module, name, param):
                continue
            if param.dim() != 2 or not param.is_floating_point() or param.device.type != "cpu":
                continue
            if is_input_major(param) or not prefers_input_major(*param.shape, param.dtype):
                continue
            new = nn.Parameter(param.data.t().contiguous().t(), requires_grad=False)
            replaced[id(param)] = new
            module._parameters[name] = new
            report.converted.append(f"{module_name}.{name}" if module_name else name)
            report.num_bytes += new.numel() * new.element_size()
    if report.converted:
        logger.info("weight layout: %s (faster single-token matmuls on CPU)", report.summary())
    return report
