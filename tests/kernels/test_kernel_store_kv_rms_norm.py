"""store_kv and fused RMSNorm: kernels vs references, references vs naive loops/float64."""

from __future__ import annotations

import pytest
import torch
from paged_cases import DTYPES, KERNEL_TOL, REF_TOL, close


def _store_inputs(num_kv_heads: int, head_dim: int, dtype: torch.dtype, slot_dtype: torch.dtype, device):
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, num_tokens = 6, 4, 9
    cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    # k and v are views of one fused tensor, as the engine slices them out of its qkv projection.
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype)
    k, v = fused[:, :num_kv_heads], fused[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(slot_dtype)
    return k.to(device), v.to(device), cache.to(device), cache.clone().to(device), slots.to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "slot_dtype"), [(1, 80, torch.int64), (4, 64, torch.int32)])
def test_store_kv_matches_reference(num_kv_heads, head_dim, slot_dtype, dtype: torch.dtype, device) -> None:
    from tidepool.kernels.store_kv import store_kv, store_kv_ref

    k, v, k_cache, v_cache, slots = _store_inputs(num_kv_heads, head_dim, dtype, slot_dtype, device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    store_kv_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_kv_reference_matches_a_loop(device) -> None:
    from tidepool.kernels.store_kv import store_kv_ref

    k, v, k_cache, v_cache, slots = _store_inputs(2, 64, torch.float32, torch.int64, device)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    block_size = k_cache.shape[1]
    for token, slot in enumerate(slots.tolist()):
        k_want[slot // block_size, slot % block_size] = k[token]
        v_want[slot // block_size, slot % block_size] = v[token]
    store_kv_ref(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


def _norm_inputs(hidden: int, dtype: torch.dtype, device):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 5, hidden, generator=gen).to(dtype).to(device)
    residual = torch.randn(3, 5, hidden, generator=gen).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    return x, residual, weight


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [80, 256])
def test_rms_norm_matches_reference(hidden: int, dtype: torch.dtype, device) -> None:
    from tidepool.kernels.rms_norm import rms_norm, rms_norm_ref

    x, residual, weight = _norm_inputs(hidden, dtype, device)
    close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), KERNEL_TOL[dtype])
    normed, new_residual = rms_norm(x, weight, 1e-6, residual)
    normed_ref, new_residual_ref = rms_norm_ref(x, weight, 1e-6, residual)
    close(normed, normed_ref, KERNEL_TOL[dtype])
    close(new_residual, new_residual_ref, KERNEL_TOL[dtype])
    assert normed.dtype == new_residual.dtype == dtype and normed.shape == x.shape


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_reference_matches_float64(dtype: torch.dtype, device) -> None:
    from tidepool.kernels.rms_norm import rms_norm_ref

    x, residual, weight = _norm_inputs(80, dtype, device)
    summed = (x + residual).double()  # rounded like the engine's residual stream
    want = summed / torch.sqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    normed, new_residual = rms_norm_ref(x, weight, 1e-6, residual)
    close(new_residual, summed, (0.0, 0.0))
    # Two roundings to the dtype (before and after the weight) in low precision.
    atol, rtol = REF_TOL[dtype]
    close(normed, want, (2 * atol, 2 * rtol))
