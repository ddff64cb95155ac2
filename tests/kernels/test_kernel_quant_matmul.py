"""int8 / int4 dequant-matmuls: kernels vs references, references vs dense float64 products of the raw values."""

from __future__ import annotations

import pytest
import torch
from paged_cases import DTYPES, close

from tidepool.kernels.int4_packing import pack_int4

# Relative to the output's largest magnitude: the sums run over K in float32 in different orders.
MATMUL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close_rel(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    scale = float(expected.double().abs().max())
    close(actual, expected, (MATMUL_TOL[dtype] * scale, MATMUL_TOL[dtype]))


def _int8_inputs(m: int, k: int, n: int, dtype: torch.dtype, device):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, generator=gen) * 0.02 + 1e-3).to(dtype)
    return x.to(device), w.to(device), scales.to(device)


def _int4_inputs(m: int, k: int, n: int, group_size: int, dtype: torch.dtype, device):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(m, k, generator=gen).to(dtype)
    q = torch.randint(0, 16, (k, n), generator=gen)
    scales = (torch.rand(k // group_size, n, generator=gen) * 0.02 + 1e-3).to(dtype)
    zeros = (torch.rand(k // group_size, n, generator=gen) * 15).to(dtype)
    return x.to(device), q, pack_int4(q).to(device), scales.to(device), zeros.to(device)


# (M, K, N): M=1 with a long K takes the split-K path; K and N not multiples of the tiles exercise masking.
INT8_SHAPES = [(1, 1024, 96), (33, 200, 72)]
# (M, K, N, group_size): group 128 (one scale row per K tile), 32, and 8 (tiles straddle groups).
INT4_SHAPES = [(1, 1024, 96, 128), (33, 192, 80, 32), (5, 96, 64, 8)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", INT8_SHAPES, ids=str)
def test_int8_kernel_matches_reference(shape, dtype: torch.dtype, device) -> None:
    from tidepool.kernels.int8_matmul import int8_matmul, int8_matmul_ref

    x, w, scales = _int8_inputs(*shape, dtype, device)
    got = int8_matmul(x, w, scales)
    assert got.dtype == dtype and got.shape == (shape[0], shape[2])
    _close_rel(got, int8_matmul_ref(x, w, scales), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", INT4_SHAPES, ids=str)
def test_int4_kernel_matches_reference(shape, dtype: torch.dtype, device) -> None:
    from tidepool.kernels.int4_matmul import int4_matmul, int4_matmul_ref

    x, _, qweight, scales, zeros = _int4_inputs(*shape, dtype, device)
    got = int4_matmul(x, qweight, scales, zeros, shape[3])
    assert got.dtype == dtype and got.shape == (shape[0], shape[2])
    _close_rel(got, int4_matmul_ref(x, qweight, scales, zeros, shape[3]), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_reference_matches_float64(dtype: torch.dtype, device) -> None:
    from tidepool.kernels.int8_matmul import int8_matmul_ref

    x, w, scales = _int8_inputs(3, 40, 24, dtype, device)
    # y[m, n] = sum_k x[m, k] * w[n, k] * s[n], summed elementwise in float64.
    want = (x.double()[:, None, :] * w.double()[None, :, :] * scales.double()[None, :, None]).sum(-1)
    _close_rel(int8_matmul_ref(x, w, scales), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int4_reference_matches_float64(dtype: torch.dtype, device) -> None:
    """The reference unpacks qweight; the expectation uses the raw 4-bit values before packing."""
    from tidepool.kernels.int4_matmul import int4_matmul_ref

    group_size = 16
    x, q, qweight, scales, zeros = _int4_inputs(3, 64, 24, group_size, dtype, device)
    groups = torch.arange(64) // group_size
    w = (q.double() - zeros.double().cpu()[groups]) * scales.double().cpu()[groups]
    want = (x.double().cpu()[:, :, None] * w[None, :, :]).sum(1)
    _close_rel(int4_matmul_ref(x, qweight, scales, zeros, group_size).cpu(), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", INT4_SHAPES, ids=str)
def test_int4_kernel_with_mins_matches_reference(shape, dtype: torch.dtype, device) -> None:
    """The mins form (W = q * s + m, llama.cpp's Q4_1): float16 scales/mins as a GGUF file stores them."""
    from tidepool.kernels.int4_matmul import int4_matmul, int4_matmul_ref

    x, _, qweight, scales, _ = _int4_inputs(*shape, dtype, device)
    gen = torch.Generator().manual_seed(11)
    mins = (torch.randn(scales.shape, generator=gen) * 0.05).half().to(device)
    scales = scales.half()
    got = int4_matmul(x, qweight, scales, None, shape[3], mins=mins)
    assert got.dtype == dtype and got.shape == (shape[0], shape[2])
    _close_rel(got, int4_matmul_ref(x, qweight, scales, None, shape[3], mins=mins), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int4_mins_reference_matches_float64(dtype: torch.dtype, device) -> None:
    from tidepool.kernels.int4_matmul import int4_matmul_ref

    group_size = 32
    x, q, qweight, scales, _ = _int4_inputs(3, 64, 24, group_size, dtype, device)
    mins = torch.randn(scales.shape, generator=torch.Generator().manual_seed(3)).to(dtype).to(device) * 0.1
    groups = torch.arange(64) // group_size
    w = q.double() * scales.double().cpu()[groups] + mins.double().cpu()[groups]
    want = (x.double().cpu()[:, :, None] * w[None, :, :]).sum(1)
    _close_rel(int4_matmul_ref(x, qweight, scales, None, group_size, mins=mins).cpu(), want, dtype)
    with pytest.raises(ValueError, match="exactly one of zeros"):
        int4_matmul_ref(x, qweight, scales, mins, group_size, mins=mins)
