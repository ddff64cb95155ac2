"""Multi-LoRA shrink/expand kernels (both forms) against the torch reference, and the reference against a
float64 loop, over the contract's layout: several slots, J in 1..3, R in 8/16/64 with ranks below R, odd
widths, base-model rows (-1) mixed in, T from 1 to 70, and a strided y."""

from __future__ import annotations

import pytest
import torch
from lora_op_cases import SHAPES, expected_storage, make_case, shape_id, to_device
from paged_cases import KERNEL_TOL, close


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_reference_matches_float64_loop(shape: tuple) -> None:
    from tidepool.kernels.lora_ref import lora_apply_ref

    case = make_case(shape)
    before, want = case.y_storage.clone(), expected_storage(case)
    lora_apply_ref(case.y, case.x, case.a, case.b, case.sub_offsets, case.slots, case.ranks)
    close(case.y_storage, want, (1e-5, 1e-5))
    base = case.slots < 0
    assert torch.equal(case.y_storage[base], before[base])  # base-model rows untouched, bit for bit


@pytest.mark.parametrize("segmented", [False, True], ids=["bgmv", "sgmv"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_kernels_match_reference(shape: tuple, segmented: bool, device) -> None:
    from tidepool.kernels.lora_ref import lora_apply_ref
    from tidepool.kernels.lora_shrink_expand import lora_apply

    case = to_device(make_case(shape, seed=1), device)
    want = case.y_storage.clone()
    pad = case.y.data_ptr() - case.y_storage.data_ptr()
    y_want = want[:, pad // want.element_size() :][:, : case.y.shape[1]]
    lora_apply_ref(y_want, case.x, case.a, case.b, case.sub_offsets, case.slots, case.ranks)
    lora_apply(case.y, case.x, case.a, case.b, case.sub_offsets, case.slots, case.ranks, segmented=segmented)
    close(case.y_storage, want, KERNEL_TOL[torch.float32])
    base = (case.slots < 0).cpu()
    assert torch.equal(case.y_storage.cpu()[base], want.cpu()[base])


@pytest.mark.parametrize("segmented", [False, True], ids=["bgmv", "sgmv"])
@pytest.mark.parametrize("shape", SHAPES[1:5], ids=shape_id)
def test_per_sub_target_ranks(shape: tuple, segmented: bool, device) -> None:
    """ranks [S, J]: sub-targets an adapter leaves out (rank 0) or has at a lower rank are skipped."""
    from tidepool.kernels.lora_ref import lora_apply_ref
    from tidepool.kernels.lora_shrink_expand import lora_apply

    case = make_case(shape, seed=11, per_sub=True)
    want = expected_storage(case)
    y_ref = case.y_storage.clone()
    start = (case.y.data_ptr() - case.y_storage.data_ptr()) // case.y.element_size()
    lora_apply_ref(y_ref[:, start : start + case.y.shape[1]], case.x, case.a, case.b, case.sub_offsets, case.slots,
                   case.ranks)  # fmt: skip
    close(y_ref, want, (1e-5, 1e-5))
    case = to_device(case, device)
    lora_apply(case.y, case.x, case.a, case.b, case.sub_offsets, case.slots, case.ranks, segmented=segmented)
    close(case.y_storage.cpu(), want, KERNEL_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("segmented", [False, True], ids=["bgmv", "sgmv"])
def test_kernels_half_precision(dtype: torch.dtype, segmented: bool, device) -> None:
    from tidepool.kernels.lora_ref import lora_apply_ref
    from tidepool.kernels.lora_shrink_expand import lora_apply

    case = to_device(make_case(SHAPES[4], dtype=dtype, seed=2, pad=0), device)
    want = case.y.clone()
    lora_apply_ref(want, case.x, case.a, case.b, case.sub_offsets, case.slots, case.ranks)
    lora_apply(case.y, case.x, case.a, case.b, case.sub_offsets, case.slots, case.ranks, segmented=segmented)
    assert case.y.dtype == dtype
    # Both round one float32 sum into y's dtype; the interpreter rounds bfloat16 toward zero (kernels._dot).
    close(case.y, want, KERNEL_TOL[dtype])


def test_all_base_rows_and_empty_batch_leave_y_alone(device) -> None:
    from tidepool.kernels.lora_shrink_expand import lora_apply

    case = to_device(make_case(SHAPES[1], seed=3), device)
    case.slots.fill_(-1)
    before = case.y_storage.clone()
    for segmented in (False, True):
        lora_apply(case.y, case.x, case.a, case.b, case.sub_offsets, case.slots, case.ranks, segmented=segmented)
    assert torch.equal(case.y_storage, before)
    empty = case.y[:0]
    lora_apply(empty, case.x[:0], case.a, case.b, case.sub_offsets, case.slots[:0], case.ranks)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: {"sub_offsets": (0, 5, c.y.shape[1])}, "A has 48 rows"),
        (lambda c: {"sub_offsets": (0, c.y.shape[1] + 1, 5, c.y.shape[1])}, "sub_offsets must rise"),
        (lambda c: {"slots": c.slots.long()}, "slots must be int32"),
        (lambda c: {"x": c.x[:, :-1]}, "A must be"),
        (lambda c: {"ranks": c.ranks[:1]}, "ranks must be"),
        (lambda c: {"ranks": c.ranks[:, None].repeat(1, 2)}, "ranks must be"),
        (lambda c: {"y": c.y_storage}, "columns but B has"),
    ],
)
def test_bad_layouts_are_refused_with_a_reason(change, message: str) -> None:
    from tidepool.kernels.lora_ref import lora_apply_ref

    case = make_case(SHAPES[1])
    args = {"y": case.y, "x": case.x, "a": case.a, "b": case.b, "sub_offsets": case.sub_offsets,
            "slots": case.slots, "ranks": case.ranks}  # fmt: skip
    args.update(change(case))
    with pytest.raises(ValueError, match=message):
        lora_apply_ref(**args)


def test_more_than_three_sub_targets_refused_by_the_kernels(device) -> None:
    from tidepool.kernels.lora_shrink_expand import lora_apply

    case = to_device(make_case((3, 2, (4, 4, 4, 4), 8, (8, 8), 16)), device)
    with pytest.raises(ValueError, match="at most 3 sub-targets"):
        lora_apply(case.y, case.x, case.a, case.b, case.sub_offsets, case.slots, case.ranks)
