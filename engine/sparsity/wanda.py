"""2:4 masks from a score per weight: magnitude (|W|) and Wanda (|W|·‖X_j‖₂, Sun et al. 2023).

Role: the one-shot mask rules that need no weight update. `two_of_four_mask` keeps, in every group of 4
consecutive input columns of each output row, the 2 weights with the highest score; `magnitude_mask`
scores by |W|, `wanda_mask` by |W| times the L2 norm of the input channel over the calibration tokens
(the per-output comparison group of Wanda's paper, restricted to 2:4 groups along the input).

Invariants: masks are bool ``[out, in]`` with exactly 2 True (kept) per group; ties go to the earlier
column; every error names the tensor.
"""

from __future__ import annotations

import torch

from .format import GROUP, KEPT, check_divisible


def two_of_four_mask(scores: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """bool ``[out, in]``: True for the 2 highest `scores` of each group of 4 input columns per row."""
    if scores.dim() != 2:
        raise ValueError(f"{name} must be 2-D [out, in], got shape {tuple(scores.shape)}")
    out, in_features = scores.shape
    check_divisible(name, in_features)
    grouped = scores.float().reshape(out, in_features // GROUP, GROUP)
    keep = torch.argsort(grouped, dim=-1, descending=True, stable=True)[..., :KEPT]  # ties: earlier column
    mask = torch.zeros_like(grouped, dtype=torch.bool).scatter_(-1, keep, True)
    return mask.reshape(out, in_features)


def magnitude_mask(weight: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """Keep the 2 largest |W| of each group of 4."""
    return two_of_four_mask(weight.abs(), name)


def wanda_mask(weight: torch.Tensor, sq_norms: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """Keep the 2 largest |W_ij|·‖X_j‖₂ of each group of 4; `sq_norms` ``[in]`` holds ‖X_j‖₂² (any scale)."""
    if tuple(sq_norms.shape) != (weight.shape[-1],):
        raise ValueError(f"{name}: input statistics have shape {tuple(sq_norms.shape)}, expected ({weight.shape[-1]},)")
    return two_of_four_mask(weight.abs().float() * sq_norms.float().sqrt()[None, :], name)
