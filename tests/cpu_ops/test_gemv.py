"""The compiled small-batch GEMV against F.linear, and `layers.linear`'s choice between them; its int8 form
against the dequantized product, and `Int8Weight`'s choice between it and torch's int8 path.

Random shapes cover every batch of the one-pass row kernel (1..8), its groups of 8 and a remainder
(9-23), and the packed-panel kernel from its threshold (24 at 8-float vectors: passes of 6, of 5 and
6, of 4 and 5; 16 at 16-float vectors: passes of 12, of 8 and 8) up to the largest the op takes; row
counts that are and are not multiples of the 16-row panel and of 8; inner sizes that are and are not
multiples of the vector width, of the unrolled chunk and of the panel's 1024-column depth; strided
inputs, and the real model's widths. Values must agree with F.linear to float32 summation-order
tolerance, and from the panel's threshold each input's result must not depend on the batch around it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidepool.engine import cpu_ops
from tidepool.engine.cpu_ops.gemv import MAX_ROWS
from tidepool.engine.layers import linear as linear_mod
from tidepool.engine.quant.runtime import Int8Weight
from tidepool.kernels.dispatch import int8_linear

pytestmark = [pytest.mark.usefixtures("vector_width"), pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def gemv(vector_width: int) -> cpu_ops.CpuGemv:
    found = cpu_ops.gemv_op()
    if found is None:
        pytest.skip("no C++ compiler here: the compiled GEMV is unavailable (the torch path is tested elsewhere)")
    return found


# (rows, inner): 1 and 3 rows (one partial panel), 17 and 33 (a full panel plus one row), 64 and 96
# (whole panels); 2055 columns span three panel depths, the last one 7 wide.
SHAPES = [(1, 1), (3, 7), (17, 8), (64, 31), (96, 33), (960, 576), (5, 1536), (33, 2055)]


def close(got: torch.Tensor, want: torch.Tensor, inner: int) -> None:
    tol = 1e-5 * max(1.0, inner**0.5)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("batch", [*range(1, 9), 9, 15, 16, 17, 23, 24, 25, 31, 64, MAX_ROWS])
@pytest.mark.parametrize(("rows", "inner"), SHAPES)
def test_matches_f_linear(gemv: cpu_ops.CpuGemv, batch: int, rows: int, inner: int) -> None:
    gen = torch.Generator().manual_seed(batch * 1000 + rows + inner)
    w = torch.randn(rows, inner, generator=gen)
    x = torch.randn(batch, inner, generator=gen)
    close(gemv(x, w), F.linear(x, w), inner)


@pytest.mark.parametrize(("rows", "inner"), [(17, 31), (96, 576), (33, 2055)])
def test_wide_batches_give_each_input_the_same_bits_whatever_the_batch(
    gemv: cpu_ops.CpuGemv, rows: int, inner: int
) -> None:
    gen = torch.Generator().manual_seed(rows + inner)
    w = torch.randn(rows, inner, generator=gen)
    w8, scales = torch.randint(-127, 128, (rows, inner), generator=gen).to(torch.int8), torch.rand(rows) + 0.01
    x = torch.randn(40, inner, generator=gen)
    order = torch.randperm(40, generator=gen)
    for run in (lambda x: gemv(x, w), lambda x: gemv.int8(x, w8, scales)):
        whole = run(x)
        assert torch.equal(run(x[order])[order.argsort()], whole)  # every input in another place and pass
        fewest = gemv.panel_min_inputs  # the fewest the panel takes (24 at 8-float vectors, 16 at 16)
        assert torch.equal(run(x[3 : 3 + fewest]), whole[3 : 3 + fewest])
        assert torch.equal(run(x[15:40]), whole[15:40])  # 25: passes of 5 (of 9, 8 and 8 at 16 floats)


def test_benchmarks_can_turn_the_panel_kernel_off(gemv: cpu_ops.CpuGemv) -> None:
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(33, 96, generator=gen), torch.randn(32, 96, generator=gen)
    previous = gemv.set_panel_min_inputs(1 << 30)
    try:
        rows_only = gemv(x, w)
        eights = torch.cat([gemv(x[i : i + 8], w) for i in range(0, 32, 8)])
    finally:
        assert gemv.set_panel_min_inputs(previous) == 1 << 30
    assert previous == gemv.panel_min_inputs
    assert torch.equal(rows_only, eights)  # the row kernel: inputs in groups of 8 from the first
    close(gemv(x, w), rows_only, 96)


def test_strided_rows_and_bias_through_linear(gemv: cpu_ops.CpuGemv) -> None:
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(4, 300, generator=gen)
    x = wide[:, :259]  # row stride 300, unit column stride
    w, b = torch.randn(50, 259, generator=gen), torch.randn(50, generator=gen)
    assert gemv.accepts(x, w)
    close(linear_mod.linear(x, w, b), F.linear(x, w, b), 259)


@pytest.mark.parametrize(
    "case",
    ["too-many-rows", "bfloat16", "transposed-weight", "column-strided-x", "three-dims"],
)
def test_everything_else_is_f_linear(gemv: cpu_ops.CpuGemv, case: str) -> None:
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 40, generator=gen), torch.randn(24, 40, generator=gen)
    if case == "too-many-rows":
        x = torch.randn(gemv.max_batch + 1, 40, generator=gen)
    elif case == "bfloat16":
        x, w = x.bfloat16(), w.bfloat16()
    elif case == "transposed-weight":
        w = w.t().contiguous().t()  # the [in, out] storage weight_layout makes for the torch path
    elif case == "column-strided-x":
        x = torch.randn(2, 80, generator=gen)[:, ::2]
    else:
        x = x.unsqueeze(0)
    assert not gemv.accepts(x if x.dim() == 2 else x[0], w) or case == "three-dims"
    with pytest.raises(ValueError):
        gemv(x, w)
    torch.testing.assert_close(linear_mod.linear(x, w), F.linear(x, w))


def test_torch_mode_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_ops.GEMV_MODE_ENV, "torch")
    cpu_ops.reset()
    try:
        assert cpu_ops.gemv_op() is None and not linear_mod.uses_compiled_gemv()
        x, w = torch.randn(2, 16), torch.randn(8, 16)
        torch.testing.assert_close(linear_mod.linear(x, w), F.linear(x, w))
    finally:
        cpu_ops.reset()


def test_the_op_takes_decode_batches_up_to_its_rows(gemv: cpu_ops.CpuGemv, monkeypatch: pytest.MonkeyPatch) -> None:
    linear_gemv = cpu_ops.gemv_op()  # the instance `linear` asks for (another test may have reset the fixture's)
    assert linear_gemv is not None and linear_gemv.max_batch == MAX_ROWS
    calls: list[int] = []
    real = linear_gemv.try_call

    def spy(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        y = real(x, weight)
        calls.append(-1 if y is None else x.shape[0])
        return y

    monkeypatch.setattr(linear_gemv, "try_call", spy)
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(96, 64, generator=gen)
    for rows in (1, 9, MAX_ROWS, MAX_ROWS + 1):
        x = torch.randn(rows, 64, generator=gen)
        close(linear_mod.linear(x, w), F.linear(x, w), 64)
    assert calls == [1, 9, MAX_ROWS, -1]


@pytest.mark.parametrize("rows", [9, 16, 64, linear_mod.TRANSPOSED_MAX_ROWS, linear_mod.TRANSPOSED_MAX_ROWS + 1, 300])
def test_torch_path_takes_the_transposed_product(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_ops.GEMV_MODE_ENV, "torch")  # the path without a compiler
    cpu_ops.reset()
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=gen), torch.randn(960, 576, generator=gen)
    b = torch.randn(960, generator=gen)
    calls: list[tuple[int, ...]] = []
    real_mm = torch.mm

    def spy(a: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(a.shape))
        return real_mm(a, other)

    monkeypatch.setattr(torch, "mm", spy)
    try:
        y = linear_mod.linear(x, w, b)
    finally:
        monkeypatch.undo()
        cpu_ops.reset()
    assert calls == ([(960, 576)] if rows <= linear_mod.TRANSPOSED_MAX_ROWS else [])
    assert y.shape == (rows, 960) and y.is_contiguous()
    close(y, F.linear(x, w, b), 576)  # MKL sums in another order at some sizes (9 rows here)


@pytest.mark.parametrize("batch", [1, 2, 5, 8, 9, 31, MAX_ROWS])
@pytest.mark.parametrize(("rows", "inner"), SHAPES)
def test_int8_matches_the_dequantized_product(gemv: cpu_ops.CpuGemv, batch: int, rows: int, inner: int) -> None:
    gen = torch.Generator().manual_seed(batch * 1000 + rows + inner)
    w = torch.randint(-127, 128, (rows, inner), generator=gen).to(torch.int8)
    scales = torch.rand(rows, generator=gen) * 0.02 + 0.001
    x = torch.randn(batch, inner, generator=gen)
    got = gemv.int8(x, w, scales)
    assert got is not None
    close(got, F.linear(x, w.float()) * scales, inner)


def test_int8_weight_uses_the_op_where_it_takes_the_call(gemv: cpu_ops.CpuGemv) -> None:
    gen = torch.Generator().manual_seed(11)
    w = torch.randint(-127, 128, (40, 64), generator=gen).to(torch.int8)
    weight = Int8Weight(w, (torch.rand(40, generator=gen) * 0.02).half())  # a GGUF Q8_0's scales are float16
    bias = torch.randn(40, generator=gen)
    assert weight.cpu_int8() is None and weight.prepare_for_cpu() and weight.scales.dtype == torch.float32
    assert weight.cpu_int8() is not None
    for x in (torch.randn(3, 64, generator=gen), torch.randn(2, 4, 64, generator=gen)):
        want = int8_linear(x, w, weight.scales, bias)  # the torch path
        assert gemv.accepts_int8(x.reshape(-1, 64), w, weight.scales)
        close(F.linear(x, weight, bias), want, 64)  # type: ignore[arg-type]
    for x in (torch.randn(gemv.max_batch + 1, 64), torch.randn(2, 64, dtype=torch.bfloat16)):  # torch's path
        assert not gemv.accepts_int8(x, w, weight.scales)
        torch.testing.assert_close(F.linear(x, weight), int8_linear(x, w, weight.scales))  # type: ignore[arg-type]
