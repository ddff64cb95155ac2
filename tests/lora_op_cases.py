"""Inputs for the `lora_apply` implementations' tests (Triton kernels and the compiled CPU op) and a
float64 loop that spells out the contract's arithmetic independently of `kernels.lora_ref`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

# (num_tokens, num_slots, sub_widths, rank_max, ranks, width_in): odd sizes, ranks below R, J in 1..3.
SHAPES = [
    (1, 1, (23,), 8, (8,), 17),
    (5, 3, (40, 9, 9), 16, (16, 4, 0), 33),
    (9, 2, (31, 31), 64, (7, 64), 70),
    (16, 4, (64,), 16, (16, 8, 1, 12), 64),
    (33, 5, (48, 16, 16), 8, (8, 3, 8, 5, 2), 49),
    (70, 3, (90, 90), 16, (13, 16, 9), 96),
]


def shape_id(shape: tuple) -> str:
    num_tokens, num_slots, widths, rank_max, _, width_in = shape
    return f"T{num_tokens}-S{num_slots}-J{len(widths)}-R{rank_max}-in{width_in}-out{sum(widths)}"


@dataclass
class LoraCase:
    y_storage: torch.Tensor  # [T, out + pad]: y is a column window of it (row stride > out)
    y: torch.Tensor
    x: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    sub_offsets: tuple[int, ...]
    slots: torch.Tensor
    ranks: torch.Tensor


def make_case(
    shape: tuple, dtype: torch.dtype = torch.float32, seed: int = 0, pad: int = 7, per_sub: bool = False
) -> LoraCase:
    """Random inputs in the contract's layout: A/B zero beyond each slot's rank, about a quarter of the
    rows on the base model (-1), y a strided window of a wider buffer. `per_sub`: ranks `[S, J]` instead,
    each sub-target's rank at most its slot's, about a third of them 0 (sub-targets the adapter leaves out)."""
    num_tokens, num_slots, widths, rank_max, ranks, width_in = shape
    gen = torch.Generator().manual_seed(seed)
    out = sum(widths)
    sub_offsets = tuple(int(v) for v in torch.tensor((0, *widths)).cumsum(0))
    a = 0.2 * torch.randn(num_slots, len(widths) * rank_max, width_in, generator=gen)
    b = 0.2 * torch.randn(num_slots, out, rank_max, generator=gen)
    sub_ranks = torch.tensor(ranks)[:, None].repeat(1, len(widths))
    if per_sub:
        sub_ranks = (torch.rand(sub_ranks.shape, generator=gen) * (sub_ranks + 1)).long()
        sub_ranks[torch.rand(sub_ranks.shape, generator=gen) < 0.33] = 0
    for s in range(num_slots):  # the contract's zero padding beyond each rank
        for j, (lo, hi) in enumerate(itertools.pairwise(sub_offsets)):
            rank = int(sub_ranks[s, j])
            b[s, lo:hi, rank:] = 0
            a[s, j * rank_max + rank : (j + 1) * rank_max] = 0
    slots = torch.randint(0, num_slots, (num_tokens,), generator=gen, dtype=torch.int32)
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1
    y_storage = torch.randn(num_tokens, out + pad, generator=gen).to(dtype)
    return LoraCase(
        y_storage=y_storage,
        y=y_storage[:, pad // 2 : pad // 2 + out],
        x=torch.randn(num_tokens, width_in, generator=gen).to(dtype),
        a=a.to(dtype),
        b=b.to(dtype),
        sub_offsets=sub_offsets,
        slots=slots,
        ranks=(sub_ranks if per_sub else torch.tensor(ranks)).to(torch.int32),
    )


def to_device(case: LoraCase, device: torch.device) -> LoraCase:
    y_storage = case.y_storage.to(device)
    start = case.y.data_ptr() - case.y_storage.data_ptr()
    offset = start // case.y.element_size()
    return LoraCase(
        y_storage=y_storage,
        y=y_storage[:, offset : offset + case.y.shape[1]],
        x=case.x.to(device),
        a=case.a.to(device),
        b=case.b.to(device),
        sub_offsets=case.sub_offsets,
        slots=case.slots.to(device),
        ranks=case.ranks.to(device),
    )


def expected_storage(case: LoraCase) -> torch.Tensor:
    """`y_storage` after the apply, in float64, row by row and sub-target by sub-target."""
    want = case.y_storage.double().clone()
    start = (case.y.data_ptr() - case.y_storage.data_ptr()) // case.y.element_size()
    rank_max = case.b.shape[2]
    for t, slot in enumerate(case.slots.tolist()):
        if slot < 0:
            continue
        x = case.x[t].double()
        for j, (lo, hi) in enumerate(itertools.pairwise(case.sub_offsets)):
            h = case.a[slot, j * rank_max : (j + 1) * rank_max].double() @ x
            want[t, start + lo : start + hi] += case.b[slot, lo:hi].double() @ h
    return want
