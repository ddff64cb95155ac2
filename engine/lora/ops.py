"""``lora_apply``: the one op every LoRA projection site calls (issue #37; layout in ``kernels.lora_ref``).

After a site's base projection ``y = x @ W.T`` has run once for the whole batch, ``lora_apply`` adds
each row's adapter delta in place: ``y[t] += B[s] (A[s] x[t])`` per sub-target, with ``s = slots[t]``
(-1: base model, no delta). ``ranks`` is ``[S]`` (the contract) or ``[S, J]`` (per sub-target, 0 where the
adapter leaves it out: every implementation then skips those weights; ``SiteSlots`` passes this form).
Which implementation runs is decided per call from the tensors:

- CUDA: the Triton shrink/expand kernels through ``kernels.dispatch.lora_apply`` (per-token gather
  for decode-sized batches, segmented by slot for prefill); no host sync, so it can be graph-captured.
- CPU: the compiled op (``engine/cpu_ops/lora.cpp``: the whole apply in one call, each present slot's
  A and B read once, padded rank columns skipped) where it is built and takes the call; else the
  torch reference (one shrink and one expand per present slot and sub-target).

Invariants: ``y`` is the only tensor written; rows whose slot is -1 are left bit-identical.
"""

from __future__ import annotations

import torch

from tidepool.engine import cpu_ops
from tidepool.kernels import dispatch


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    sub_offsets: tuple[int, ...],
    slots: torch.Tensor,
    ranks: torch.Tensor,
) -> None:
    """Add the LoRA deltas of ``x [T, in]`` to ``y [T, out]`` in place (``A [S, J*R, in]``, ``B [S, out, R]``).

    Raises ValueError naming what to change for a layout that breaks the contract."""
    if not x.is_cuda:
        op = cpu_ops.lora_op()
        if op is not None and op.try_apply(y, x, a, b, sub_offsets, slots, ranks):
            return
    dispatch.lora_apply(y, x, a, b, sub_offsets, slots, ranks)
