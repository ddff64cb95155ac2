"""Varlen flash attention over the paged cache: kernel vs reference, reference vs naive float64 math."""

from __future__ import annotations

import pytest
import torch
from paged_cases import DTYPES, KERNEL_TOL, REF_TOL, close, make_paged_case, naive_attention

# (num_heads, num_kv_heads, head_dim, block_size, [(context_len, num_new_tokens), ...], sliding_window)
# A chunk with num_new == context_len is a fresh prefill; fewer new tokens means a cached prefix
# (chunked prefill or a prefix-cache hit); one new token is a decode through the same kernel.
CASES = {
    "gqa1-hd64": (2, 2, 64, 16, [(20, 20), (37, 5), (16, 1)], None),
    "gqa4-hd80": (8, 2, 80, 8, [(45, 12), (7, 7)], None),
    "gqa8-hd96-window": (16, 2, 96, 16, [(40, 25), (19, 3)], 10),
    "mqa-hd128": (4, 1, 128, 4, [(30, 30), (12, 4)], None),
}


def _inputs(case: str, dtype: torch.dtype, device: torch.device, row_offset: int = 0):
    num_heads, num_kv_heads, head_dim, block_size, chunks, window = CASES[case]
    paged = make_paged_case([c for c, _ in chunks], num_kv_heads, head_dim, block_size, dtype, device)
    bounds = [row_offset]
    for _, num_new in chunks:
        bounds.append(bounds[-1] + num_new)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(bounds[-1], num_heads, head_dim, generator=gen).to(dtype).to(device)
    cu_seqlens_q = torch.tensor(bounds, dtype=torch.int32, device=device)
    return paged, q, cu_seqlens_q, head_dim**-0.5, window


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case: str, dtype: torch.dtype, device: torch.device) -> None:
    from tidepool.kernels.flash_attention_varlen import flash_attention_varlen, flash_attention_varlen_ref

    paged, q, cu, scale, window = _inputs(case, dtype, device)
    args = (q, paged.k_cache, paged.v_cache, cu, paged.seq_lens, paged.block_tables, scale)
    got = flash_attention_varlen(*args, sliding_window=window)
    assert got.dtype == dtype and got.shape == q.shape
    close(got, flash_attention_varlen_ref(*args, sliding_window=window), KERNEL_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_naive(case: str, dtype: torch.dtype, device: torch.device) -> None:
    from tidepool.kernels.flash_attention_varlen import flash_attention_varlen_ref

    paged, q, cu, scale, window = _inputs(case, dtype, device)
    got = flash_attention_varlen_ref(
        q, paged.k_cache, paged.v_cache, cu, paged.seq_lens, paged.block_tables, scale, sliding_window=window
    )
    bounds = cu.tolist()
    for seq, seq_len in enumerate(paged.seq_lens.tolist()):
        rows = slice(bounds[seq], bounds[seq + 1])
        num_new = bounds[seq + 1] - bounds[seq]
        positions = list(range(seq_len - num_new, seq_len))
        want = naive_attention(q[rows], paged.keys[seq], paged.values[seq], scale, positions, window)
        close(got[rows], want, REF_TOL[dtype])


def test_rows_before_the_first_sequence_are_left_alone(device: torch.device) -> None:
    """The engine passes the prefill part of a step (cu_seqlens_q starting past the decode rows) and its own out."""
    from tidepool.kernels.flash_attention_varlen import flash_attention_varlen, flash_attention_varlen_ref

    paged, q, cu, scale, _ = _inputs("gqa4-hd80", torch.float16, device, row_offset=3)
    out = torch.full_like(q, 5.0)
    args = (q, paged.k_cache, paged.v_cache, cu, paged.seq_lens, paged.block_tables, scale)
    flash_attention_varlen(*args, out=out)
    assert bool((out[:3] == 5.0).all())
    close(out[3:], flash_attention_varlen_ref(*args)[3:], KERNEL_TOL[torch.float16])


def test_long_chunk_spans_several_query_tiles(device: torch.device) -> None:
    """More query rows than one BLOCK_M tile, behind a short sequence (exercises the tile-to-sequence search)."""
    from tidepool.kernels.flash_attention_varlen import flash_attention_varlen, flash_attention_varlen_ref

    paged = make_paged_case([3, 150], 1, 64, 16, torch.float16, device, seed=3)
    q = torch.randn(3 + 140, 2, 64, generator=torch.Generator().manual_seed(4)).half().to(device)
    cu = torch.tensor([0, 3, 143], dtype=torch.int32, device=device)
    args = (q, paged.k_cache, paged.v_cache, cu, paged.seq_lens, paged.block_tables, 0.125)
    close(flash_attention_varlen(*args), flash_attention_varlen_ref(*args), KERNEL_TOL[torch.float16])
