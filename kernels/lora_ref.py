"""Multi-LoRA layout checks and the torch reference of ``lora_apply`` (torch only, no Triton).

Layout (the multi-LoRA contract, one projection site of a layer):

- ``x [T, in]``: the site's input rows; ``y [T, out]``: its output, updated IN PLACE. ``y`` may be
  a view whose row stride exceeds ``out`` (its rows must be contiguous).
- ``A [S, J*R, in]``, ``B [S, out, R]``: S device slots, R the largest rank, J sub-targets fused in
  the site (qkv: 3, gate_up: 2, o/down: 1). Sub-target j's A rows are ``A[s, j*R:(j+1)*R]``; output
  column o in ``[sub_offsets[j], sub_offsets[j+1])`` uses ``h[:, j*R:(j+1)*R]`` with ``B[s, o, :]``
  where ``h = x @ A[s].T`` (the "shrink"); the product with B is the "expand". The PEFT scaling is
  already folded into B; absent sub-targets and ranks below R are zero-padded.
- ``sub_offsets``: J+1 output columns, ``0 = sub_offsets[0] <= ... <= sub_offsets[J] = out``.
- ``slots [T]`` int32: each row's slot, -1 = base model (no delta). ``ranks [S]``: the largest rank
  of each slot's adapter; columns at or beyond it are zero, so implementations may skip them. Or
  ``ranks [S, J]``: the rank per slot and sub-target (0: the adapter does not target it), so a site
  skips what an adapter leaves out (an extension of the contract's ``[S]``; both int32 or int64).

The reference groups rows by slot and does one shrink and one expand per present slot and
sub-target, in float32, adding the delta to ``y`` in y's dtype. It reads ``slots`` and ``ranks``
on the host (a device sync on CUDA): it is the truth for tests and the fallback, not the GPU path.
"""

from __future__ import annotations

import itertools

import torch

from ._checks import check_dim, check_float, check_int, check_last_contiguous, check_same_device


def check_lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    sub_offsets: tuple[int, ...],
    slots: torch.Tensor,
    ranks: torch.Tensor,
) -> tuple[int, int]:
    """Validate the contract's shapes, dtypes and strides (metadata only); returns ``(J, R)``."""
    check_dim("x", x, 2, "[T, in]")
    check_dim("y", y, 2, "[T, out]")
    check_dim("A", a, 3, "[S, J*R, in]")
    check_dim("B", b, 3, "[S, out, R]")
    for name, t in (("x", x), ("y", y), ("A", a), ("B", b)):
        check_float(name, t)
        check_last_contiguous(name, t)
    num_tokens, width_in = x.shape
    num_slots, out, rank = b.shape
    if y.shape[0] != num_tokens:
        raise ValueError(f"y has {y.shape[0]} rows but x has {num_tokens}")
    if y.shape[1] != out:
        raise ValueError(f"y has {y.shape[1]} columns but B has out={out}")
    if a.shape[0] != num_slots or a.shape[2] != width_in:
        raise ValueError(f"A must be [{num_slots}, J*{rank}, {width_in}], got {tuple(a.shape)}")
    num_sub = len(sub_offsets) - 1
    if num_sub < 1 or a.shape[1] != num_sub * rank:
        raise ValueError(f"A has {a.shape[1]} rows but sub_offsets {sub_offsets} with R={rank} needs {num_sub * rank}")
    if sub_offsets[0] != 0 or sub_offsets[-1] != out or any(p > q for p, q in itertools.pairwise(sub_offsets)):
        raise ValueError(f"sub_offsets must rise from 0 to out={out}, got {sub_offsets}")
    if a.dtype != b.dtype:
        raise ValueError(f"A ({a.dtype}) and B ({b.dtype}) must have the same dtype")
    check_dim("slots", slots, 1, "[T]")
    check_int("slots", slots)
    if slots.shape[0] != num_tokens:
        raise ValueError(f"slots has {slots.shape[0]} entries but x has {num_tokens} rows")
    check_int("ranks", ranks, (torch.int32, torch.int64))
    if tuple(ranks.shape) not in ((num_slots,), (num_slots, num_sub)):
        raise ValueError(f"ranks must be [S={num_slots}] or [S, J={num_sub}], got {tuple(ranks.shape)}")
    check_same_device(y=y, x=x, A=a, B=b, slots=slots, ranks=ranks)
    return num_sub, rank


def lora_apply_ref(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    sub_offsets: tuple[int, ...],
    slots: torch.Tensor,
    ranks: torch.Tensor,
) -> None:
    """``y += delta`` per the module docstring: one shrink and one expand per present slot and sub-target."""
    num_sub, rank = check_lora_apply(y, x, a, b, sub_offsets, slots, ranks)
    present = [s for s in torch.unique(slots).tolist() if s >= 0]
    sub_ranks = (ranks[:, None] if ranks.dim() == 1 else ranks).expand(-1, num_sub).tolist()
    for slot in present:
        if max(sub_ranks[slot]) <= 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        xs = x.index_select(0, rows).float()
        delta = torch.zeros(rows.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
        for j in range(num_sub):
            start, stop, r = sub_offsets[j], sub_offsets[j + 1], min(int(sub_ranks[slot][j]), rank)
            if start == stop or r <= 0:
                continue
            h = xs @ a[slot, j * rank : j * rank + r].float().t()  # shrink: [n, r]
            delta[:, start:stop] = h @ b[slot, start:stop, :r].float().t()  # expand: [n, stop - start]
        y.index_add_(0, rows, delta.to(y.dtype))
