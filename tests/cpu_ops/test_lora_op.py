"""The compiled multi-LoRA apply (`cpu_ops.lora_op()`, TIDEPOOL_CPU_LORA=compiled) against the torch reference.

Same shapes as the Triton kernels' tests (`lora_op_cases`: several slots, J in 1..3, R in 8/16/64 with
ranks below R, odd widths, base-model rows mixed in, T from 1 to 70, a strided y), plus SmolLM2's site
shapes at a decode batch of 32 over 8 slots, at both SIMD widths and one or two threads; base-model rows
are left bit-identical; calls it does not take (bfloat16) fall back to the reference through
`engine.lora.ops.lora_apply`; bad slots and layouts are refused with a reason.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from lora_op_cases import SHAPES, expected_storage, make_case, shape_id

from tidepool.engine import cpu_ops
from tidepool.engine.lora.ops import lora_apply
from tidepool.kernels.lora_ref import lora_apply_ref

pytestmark = pytest.mark.usefixtures("vector_width")

# SmolLM2-135M's four sites (qkv, o, gate_up, down) at 32 decodes over 8 adapters of ranks 8-16 (R = 16).
SMOLLM2_SITES = [
    (32, 8, (576, 192, 192), 16, (8, 16, 12, 16, 8, 16, 0, 16), 576),
    (32, 8, (576,), 16, (8, 16, 12, 16, 8, 16, 0, 16), 576),
    (32, 8, (1536, 1536), 16, (8, 16, 12, 16, 8, 16, 0, 16), 576),
    (32, 8, (576,), 16, (8, 16, 12, 16, 8, 16, 0, 16), 1536),
]


@pytest.fixture(scope="module")
def lora(vector_width: int) -> Iterator[cpu_ops.CpuLora]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cpu_ops.LORA_MODE_ENV, "compiled")
        cpu_ops.reset()
        op = cpu_ops.lora_op()
        assert op is not None
        yield op
    cpu_ops.reset()


def _apply(op: cpu_ops.CpuLora, case) -> None:
    assert op.try_apply(case.y, case.x, case.a, case.b, case.sub_offsets, case.slots, case.ranks)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES + SMOLLM2_SITES, ids=shape_id)
def test_matches_reference(lora: cpu_ops.CpuLora, shape: tuple, num_threads: int, threads: None) -> None:
    torch.set_num_threads(num_threads)
    case = make_case(shape, seed=4)
    want = expected_storage(case)
    before = case.y_storage.clone()
    _apply(lora, case)
    torch.testing.assert_close(case.y_storage.double(), want, atol=2e-5, rtol=2e-5)
    base = case.slots < 0
    assert torch.equal(case.y_storage[base], before[base])


@pytest.mark.parametrize("shape", SHAPES + SMOLLM2_SITES[:1], ids=shape_id)
def test_per_sub_target_ranks(lora: cpu_ops.CpuLora, shape: tuple) -> None:
    """ranks [S, J]: a sub-target an adapter leaves out (rank 0) or has at a lower rank is skipped."""
    case = make_case(shape, seed=12, per_sub=True)
    want = expected_storage(case)
    _apply(lora, case)
    torch.testing.assert_close(case.y_storage.double(), want, atol=2e-5, rtol=2e-5)


def test_same_bits_as_one_thread_with_two(lora: cpu_ops.CpuLora, threads: None) -> None:
    results = []
    for num_threads in (1, 2):
        torch.set_num_threads(num_threads)
        case = make_case(SMOLLM2_SITES[0], seed=5)
        _apply(lora, case)
        results.append(case.y_storage)
    assert torch.equal(results[0], results[1])


def test_int64_ranks_and_a_single_row(lora: cpu_ops.CpuLora) -> None:
    case = make_case(SHAPES[0], seed=6)
    want = case.y_storage.clone()
    lora_apply_ref(want[:, 3:26], case.x, case.a, case.b, case.sub_offsets, case.slots, case.ranks)
    assert lora.try_apply(case.y, case.x, case.a, case.b, case.sub_offsets, case.slots, case.ranks.long())
    torch.testing.assert_close(case.y_storage, want, atol=2e-5, rtol=2e-5)


def test_ops_dispatch_uses_the_op_and_falls_back_for_bfloat16(lora: cpu_ops.CpuLora) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        case = make_case(SHAPES[2], dtype=dtype, seed=7, pad=0)
        want = case.y.clone()
        lora_apply_ref(want, case.x, case.a, case.b, case.sub_offsets, case.slots, case.ranks)
        assert lora.try_apply(case.y.clone(), case.x, case.a, case.b, case.sub_offsets, case.slots, case.ranks) == (
            dtype == torch.float32
        )
        lora_apply(case.y, case.x, case.a, case.b, case.sub_offsets, case.slots, case.ranks)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(case.y.float(), want.float(), atol=tol, rtol=tol)


def test_slot_out_of_range_and_bad_layout_refused(lora: cpu_ops.CpuLora) -> None:
    case = make_case(SHAPES[1], seed=8)
    case.slots[0] = case.a.shape[0]
    with pytest.raises(ValueError, match="slots must lie in"):
        _apply(lora, case)
    case = make_case(SHAPES[1], seed=8)
    with pytest.raises(ValueError, match="sub_offsets must rise"):
        lora.try_apply(case.y, case.x, case.a, case.b, (0, 9, 5, 58), case.slots, case.ranks)


def test_site_tensors_changed_in_place_or_replaced_are_read_afresh(lora: cpu_ops.CpuLora) -> None:
    """The op remembers a site's A/B/ranks by identity: an in-place reload (what filling a slot does), a slot
    whose rank changes, and new tensors must all give the reference's result."""
    case = make_case(SHAPES[1], seed=9, pad=0)
    edits = [
        lambda c: c.b[0].mul_(2.0),  # reload slot 0 in place
        lambda c: c.ranks.fill_(4),  # every slot's rank shrinks (its rows beyond 4 are no longer read)
        lambda c: setattr(c, "a", c.a.clone()),  # a new A tensor for the same site
    ]
    for edit in [lambda c: None, *edits]:
        edit(case)
        y = case.y.clone()
        want = case.y.clone()
        lora_apply_ref(want, case.x, case.a, case.b, case.sub_offsets, case.slots, case.ranks)
        assert lora.try_apply(y, case.x, case.a, case.b, case.sub_offsets, case.slots, case.ranks)
        torch.testing.assert_close(y, want, atol=2e-5, rtol=2e-5)


def test_torch_mode_uses_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_ops.LORA_MODE_ENV, "torch")
    cpu_ops.reset()
    try:
        assert cpu_ops.lora_op() is None
        case = make_case(SHAPES[1], seed=10)
        want = expected_storage(case)
        lora_apply(case.y, case.x, case.a, case.b, case.sub_offsets, case.slots, case.ranks)
        torch.testing.assert_close(case.y_storage.double(), want, atol=2e-5, rtol=2e-5)
    finally:
        cpu_ops.reset()
