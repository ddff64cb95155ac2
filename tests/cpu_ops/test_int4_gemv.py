"""The compiled int4 matmul (`cpu_ops.int4_op()`) against the dense product of the dequantized weight.

Op level: random weights in Tidepool's int4 layout, both offset forms (zero points and mins), the
three scale dtypes, group sizes 8-128, output widths that are and are not whole tiles of 16, batches
of 1 (decode) to a prefill-sized chunk, strided input rows; values agree with `x @ dequantize_int4(...)`
to float32 summation-order tolerance, and `tile_weight` refuses malformed layouts. Module level: an
`Int4Weight` tiled for the CPU (`prepare_for_cpu`) gives what the untiled torch path gives, act-order
included, and the torch mode leaves weights untiled on the torch path.
"""

from __future__ import annotations

import pytest
import torch

from tidepool.engine import cpu_ops
from tidepool.engine.cpu_ops.int4_gemv import TILE, tile_weight
from tidepool.engine.quant.formats import Int4Parts
from tidepool.engine.quant.runtime import Int4Weight, prepare_for_cpu
from tidepool.kernels.int4_packing import dequantize_int4, pack_int4

pytestmark = pytest.mark.usefixtures("vector_width")


@pytest.fixture(scope="module")
def int4_gemv(vector_width: int) -> cpu_ops.CpuInt4Gemv:
    found = cpu_ops.int4_op()
    if found is None:
        pytest.skip("no C++ compiler here: the compiled int4 op is unavailable (the torch path is tested elsewhere)")
    return found


def random_int4(
    n: int, k: int, group: int, dtype: torch.dtype, mins: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    qweight = pack_int4(torch.randint(0, 16, (k, n), generator=gen))
    scales = (torch.rand(k // group, n, generator=gen) * 0.1 + 0.01).to(dtype)
    if mins:
        return qweight, scales, None, (torch.randn(k // group, n, generator=gen) * 0.2).to(dtype)
    return qweight, scales, (torch.rand(k // group, n, generator=gen) * 15).to(dtype), None


def close(got: torch.Tensor, want: torch.Tensor, inner: int) -> None:
    tol = 2e-5 * max(1.0, inner**0.5)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max().clamp(min=1.0)))


CASES = [  # (N, K, group): whole tiles and not, one group and many, SmolLM2's widths
    (16, 8, 8), (37, 64, 32), (100, 256, 64), (960, 576, 32), (576, 1536, 128), (5, 128, 128), (48, 96, 32),
]  # fmt: skip


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 8, 13, 64, 300])
@pytest.mark.parametrize(("n", "k", "group"), CASES)
def test_matches_the_dequantized_product(
    int4_gemv: cpu_ops.CpuInt4Gemv, batch: int, n: int, k: int, group: int
) -> None:
    for mins, dtype in ((True, torch.float16), (False, torch.float32), (True, torch.bfloat16)):
        if not int4_gemv.takes_scales(dtype):
            continue  # float16 scales need the compiler's _Float16; the op says so and the caller keeps torch's path
        qweight, scales, zeros, mins_t = random_int4(n, k, group, dtype, mins, seed=batch * 7 + n + k)
        x = torch.randn(batch, k, generator=torch.Generator().manual_seed(batch))
        want = x @ dequantize_int4(qweight, scales, zeros, group, dtype=torch.float32, mins=mins_t)
        close(int4_gemv(x, tile_weight(qweight, scales, zeros, group, mins_t)), want, k)


def test_strided_rows_and_other_input_dtypes(int4_gemv: cpu_ops.CpuInt4Gemv) -> None:
    qweight, scales, zeros, _ = random_int4(40, 64, 32, torch.float32, False, seed=3)
    tiles = tile_weight(qweight, scales, zeros, 32, None)
    dense = dequantize_int4(qweight, scales, zeros, 32, dtype=torch.float32)
    wide = torch.randn(6, 100)
    close(int4_gemv(wide[:, 10:74], tiles), wide[:, 10:74] @ dense, 64)  # row stride 100
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    close(int4_gemv(x, tiles), x.float() @ dense, 64)  # converted to float32 first
    with pytest.raises(ValueError, match="takes x"):
        int4_gemv(torch.randn(2, 63), tiles)


def test_tiles_pad_the_last_one_with_zeros() -> None:
    qweight, scales, _, mins = random_int4(37, 64, 32, torch.float16, True, seed=4)
    tiles = tile_weight(qweight, scales, None, 32, mins)
    assert tiles.qweight.shape == (3, 8, TILE) and tiles.scales.shape == tiles.offset.shape == (3, 2, TILE)
    assert tiles.mins and tiles.out_features == 37 and tiles.in_features == 64 and tiles.group_size == 32
    assert torch.equal(tiles.qweight[2, :, 37 - 32 :], torch.zeros(8, TILE - 5, dtype=torch.int32))
    assert torch.equal(tiles.qweight[1], qweight[:, 16:32])
    with pytest.raises(ValueError, match="one dtype"):
        tile_weight(qweight, scales, None, 32, mins.float())
    with pytest.raises(ValueError, match="exactly one"):
        tile_weight(qweight, scales, mins, 32, mins)
    with pytest.raises(ValueError, match="multiple of group_size"):
        tile_weight(qweight, scales[:1], None, 48, mins[:1])


def _int4_weight(n: int, k: int, group: int, perm: bool, seed: int) -> Int4Weight:
    qweight, scales, zeros, _ = random_int4(n, k, group, torch.float32, False, seed)
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if perm else None
    return Int4Weight(Int4Parts(qweight, scales, zeros, group, order))


@pytest.mark.parametrize("perm", [False, True])
def test_a_tiled_weight_gives_what_the_torch_path_gives(int4_gemv: cpu_ops.CpuInt4Gemv, perm: bool) -> None:
    module = torch.nn.Module()
    module.add_module("w", _int4_weight(50, 128, 32, perm, seed=5))
    weight: Int4Weight = module.w  # type: ignore[assignment]
    x, bias = torch.randn(2, 3, 128), torch.randn(50)
    want = weight.linear(x, bias)  # untiled: kernels.dispatch.int4_linear, the torch path
    assert prepare_for_cpu(module) == 1 and weight.tiled and weight.qweight.shape == (4, 16, TILE)
    assert prepare_for_cpu(module) == 1  # idempotent
    close(torch.nn.functional.linear(x, weight, bias), want, 128)  # type: ignore[arg-type]
    assert (weight.cpu_tiles() is None) == perm  # act-order inputs need the permutation first: not for the step


def test_torch_mode_keeps_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_ops.INT4_MODE_ENV, "torch")
    cpu_ops.reset()
    try:
        weight = _int4_weight(20, 64, 32, False, seed=6)
        assert cpu_ops.int4_op() is None and not weight.prepare_for_cpu() and weight.qweight.shape == (8, 20)
        assert weight.cpu_tiles() is None
    finally:
        cpu_ops.reset()
