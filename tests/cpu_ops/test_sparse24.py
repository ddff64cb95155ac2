"""The compiled 2:4-sparse projection (`cpu_ops.sparse24_op()`) against a dense matmul over the same pruned weights.

Random 2:4 weights (a random pair kept in every group of 4, so every one of the 6 patterns occurs) over shapes
with odd output counts, inner sizes that are multiples of 4 but not of 8 (a lone last group, an unused high
nibble), of the vector width and not, across the panel's 1024-column depth; every batch of the row kernel
(1..8), its groups of 8 with a remainder, the packed-panel kernel from its threshold, up to 70 and the op's
limit; float32 kept values and int8 ones with per-row scales. Values must equal F.linear over
`format.unpack_2to4`'s dense weight to float32 summation-order tolerance. Both SIMD widths (conftest).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidepool.engine import cpu_ops
from tidepool.engine.cpu_ops.sparse24 import SparseRows, masks_from_meta, meta_from_masks
from tidepool.engine.sparsity.format import pack_2to4, unpack_2to4

pytestmark = pytest.mark.usefixtures("vector_width")

# (out, in): in % 8 == 4 for 12, 20, 36, 1540 (the lone last group); 2052 spans three panel depths.
SHAPES = [(1, 4), (3, 12), (17, 20), (33, 36), (64, 576), (5, 1536), (31, 1540), (33, 2052)]
BATCHES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 23, 24, 25, 33, 64, 70]


@pytest.fixture(scope="module")
def sparse24(vector_width: int) -> cpu_ops.CpuSparse24:
    found = cpu_ops.sparse24_op()
    if found is None:
        pytest.skip("no C++ compiler here: the compiled 2:4 op is unavailable (the torch path is tested elsewhere)")
    return found


def random_24(out: int, inner: int, gen: torch.Generator) -> torch.Tensor:
    """A dense [out, inner] weight with a random 2 of every 4 columns kept (none of them zero)."""
    w = torch.randn(out, inner, generator=gen).abs() + 0.1
    order = torch.rand(out, inner // 4, 4, generator=gen).argsort(-1)
    keep = torch.zeros(out, inner // 4, 4, dtype=torch.bool).scatter_(-1, order[..., :2], True)
    sign = torch.randint(0, 2, (out, inner), generator=gen) * 2 - 1
    return w * sign * keep.view(out, inner)


def rows_of(dense: torch.Tensor, int8: bool) -> tuple[SparseRows, torch.Tensor]:
    """The op's view of `dense` (int8: quantized per row) and the dense weight it stands for."""
    inner = dense.shape[1]
    if int8:
        scales = dense.abs().amax(1) / 127
        q = (dense / scales[:, None]).round().clamp(-127, 127)  # |kept| >= 0.1 of at most ~4.5: never rounds to 0
        values, meta = pack_2to4(q, mask=dense != 0)
        values = values.to(torch.int8)
    else:
        scales, (values, meta) = None, pack_2to4(dense)
    rows = SparseRows(values, masks_from_meta(meta, inner), scales, inner)
    return rows, unpack_2to4(values, meta, inner, scales)


def close(got: torch.Tensor, want: torch.Tensor, inner: int) -> None:
    tol = 1e-5 * max(1.0, inner**0.5)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize(("out", "inner"), SHAPES)
def test_matches_a_dense_matmul_over_the_pruned_weight(
    sparse24: cpu_ops.CpuSparse24, out: int, inner: int, batch: int, int8: bool
) -> None:
    gen = torch.Generator().manual_seed(batch * 1000 + out + inner + int8)
    rows, dense = rows_of(random_24(out, inner, gen), int8)
    x = torch.randn(batch, inner, generator=gen)
    close(sparse24(x, rows), F.linear(x, dense), inner)


@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
def test_largest_batch_and_strided_inputs(sparse24: cpu_ops.CpuSparse24, int8: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    rows, dense = rows_of(random_24(40, 580, gen), int8)
    wide = torch.randn(sparse24.max_batch, 600, generator=gen)
    x = wide[:, 10:590]  # row stride 600
    close(sparse24(x, rows), F.linear(x, dense), 580)


def test_row_and_panel_kernels_agree(sparse24: cpu_ops.CpuSparse24) -> None:
    gen = torch.Generator().manual_seed(9)
    rows, dense = rows_of(random_24(96, 1540, gen), False)
    x = torch.randn(40, 1540, generator=gen)
    before = sparse24.set_panel_min_inputs(1 << 20)  # the row kernel only
    try:
        by_rows = sparse24(x, rows)
        sparse24.set_panel_min_inputs(1)  # the packed panels from one input
        by_panels = sparse24(x, rows)
    finally:
        sparse24.set_panel_min_inputs(before)
    close(by_rows, F.linear(x, dense), 1540)
    close(by_panels, F.linear(x, dense), 1540)


def test_refuses_what_it_does_not_take(sparse24: cpu_ops.CpuSparse24) -> None:
    gen = torch.Generator().manual_seed(1)
    rows, _ = rows_of(random_24(8, 16, gen), False)
    assert sparse24(torch.randn(2, 16, dtype=torch.float64), rows) is None  # dtype
    assert sparse24(torch.randn(2, 12), rows) is None  # width
    assert sparse24(torch.randn(sparse24.max_batch + 1, 16), rows) is None  # too many rows
    assert sparse24(torch.randn(16, 2).t(), rows) is None  # column stride
    half = SparseRows(rows.values.half(), rows.masks, None, 16)
    assert sparse24(torch.randn(2, 16), half) is None  # float16 values: the caller widens them first
    no_scales = SparseRows(rows.values.to(torch.int8), rows.masks, None, 16)
    assert sparse24(torch.randn(2, 16), no_scales) is None


@pytest.mark.parametrize("inner", [4, 12, 16, 1540])
def test_bitmasks_round_trip_to_the_file_layout(inner: int) -> None:
    gen = torch.Generator().manual_seed(inner)
    _, meta = pack_2to4(random_24(7, inner, gen))
    masks = masks_from_meta(meta, inner)
    assert masks.shape == meta.shape and masks.dtype == torch.uint8
    nibbles = torch.stack([masks & 15, masks >> 4], -1).reshape(7, -1)[:, : inner // 4]
    assert bool((nibbles.bitwise_and(nibbles - 1) != 0).all())  # two bits per group, as the kernel expects
    assert torch.equal(meta_from_masks(masks), meta)
