"""SparseGPT 2:4 (Frantar & Alistarh 2023): the mask chosen per block with the OBS second-order update.

Role: prune one projection ``W [out, in]`` given the Hessian ``H = mean(xᵀx)`` of its inputs. Following
the paper's reference algorithm: dead inputs (``H_jj = 0``) are zeroed; ``H += damp · mean(diag H) · I``;
``U`` is the upper Cholesky factor of ``H⁻¹``; columns are processed left to right in blocks of
`block_size`. At the first column of every group of 4 the group's mask is chosen by the OBS saliency
``w² / U_jj²`` (``U_jj² = [H⁻¹]_jj`` of the remaining columns), keeping the 2 most salient; each column's
pruning error ``(w - q) / U_jj`` is then spread over the not-yet-processed columns of the block through
``U``'s row, and each block's errors over the later blocks.

Invariants: float32 throughout (float64 Cholesky); the result holds exactly 2 nonzero-capable positions
per group (the mask), the pruned positions exactly 0; a Hessian that stays singular after raising
the damping raises ValueError naming the tensor.
"""

from __future__ import annotations

import torch

from .format import GROUP, KEPT, check_divisible

DEFAULT_BLOCK_SIZE = 128
DEFAULT_DAMP = 0.01
_DAMP_RETRIES = 4  # x10 each time the Cholesky fails


def inverse_cholesky(hessian: torch.Tensor, damp: float, name: str) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp · mean(diag H) · I)⁻¹``; more damping while H is not positive definite."""
    h = hessian.double()
    mean_diag = float(torch.diag(h).mean()) or 1.0
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    for attempt in range(_DAMP_RETRIES + 1):
        factor, info = torch.linalg.cholesky_ex(h + damp * 10**attempt * mean_diag * eye)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(factor)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0:
                return upper.float()
    raise ValueError(f"{name}: the calibration Hessian is not positive definite even with damping {damp * 10**4}")


def sparsegpt_prune(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    name: str = "weight",
    block_size: int = DEFAULT_BLOCK_SIZE,
    damp: float = DEFAULT_DAMP,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pruned float32 ``W [out, in]`` with the OBS update applied, bool kept-mask ``[out, in]``)."""
    out, in_features = weight.shape
    check_divisible(name, in_features)
    if tuple(hessian.shape) != (in_features, in_features):
        raise ValueError(f"{name}: Hessian has shape {tuple(hessian.shape)}, expected {(in_features, in_features)}")
    if block_size % GROUP:
        raise ValueError(f"block size must be a multiple of {GROUP}, got {block_size}")
    w = weight.detach().float().clone()
    h = hessian.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    u = inverse_cholesky(h, damp, name)
    pruned = torch.zeros(out, in_features, dtype=torch.bool)
    for start in range(0, in_features, block_size):
        end = min(start + block_size, in_features)
        errors = _prune_block(w, u, pruned, start, end)
        w[:, end:] -= errors @ u[start:end, end:]
    w[pruned] = 0.0
    return w, ~pruned


def _prune_block(w: torch.Tensor, u: torch.Tensor, pruned: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Prune columns ``start:end`` of `w` in place (mask into `pruned`); returns the scaled errors ``[out, width]``."""
    block = w[:, start:end]  # a view: updates land in w
    u_block = u[start:end, start:end]
    diag = torch.diag(u_block)
    errors = torch.zeros_like(block)
    for i in range(end - start):
        if i % GROUP == 0:
            saliency = block[:, i : i + GROUP].square() / diag[i : i + GROUP].square()[None, :]
            drop = torch.argsort(saliency, dim=-1, stable=True)[:, : GROUP - KEPT]
            pruned[:, start + i : start + i + GROUP].scatter_(1, drop, True)
        column = block[:, i]
        kept = torch.where(pruned[:, start + i], torch.zeros_like(column), column)
        errors[:, i] = (column - kept) / diag[i]
        block[:, i] = kept
        block[:, i + 1 :] -= errors[:, i : i + 1] @ u_block[i : i + 1, i + 1 :]
    return errors
