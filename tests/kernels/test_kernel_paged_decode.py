"""Paged decode attention: the Triton kernel against its reference, and the reference against naive float64 math."""

from __future__ import annotations

import pytest
import torch
from paged_cases import DTYPES, KERNEL_TOL, REF_TOL, close, make_paged_case, naive_attention

# (num_heads, num_kv_heads, head_dim, block_size, seq_lens, num_splits, sliding_window)
CASES = {
    "gqa1-hd64": (2, 2, 64, 16, [1, 17, 40], None, None),
    "gqa4-hd80-split": (8, 2, 80, 8, [33, 5, 64], 3, None),
    "gqa8-hd96-split-window": (16, 2, 96, 16, [50, 3, 20], 2, 20),
    "mqa-hd128": (4, 1, 128, 4, [9, 30, 2], None, None),
}


def _inputs(case: str, dtype: torch.dtype, device: torch.device):
    num_heads, num_kv_heads, head_dim, block_size, seq_lens, num_splits, window = CASES[case]
    paged = make_paged_case(seq_lens, num_kv_heads, head_dim, block_size, dtype, device)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    return paged, q, head_dim**-0.5, num_splits, window


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case: str, dtype: torch.dtype, device: torch.device) -> None:
    from tidepool.kernels.paged_attention_decode import paged_attention_decode, paged_attention_decode_ref

    paged, q, scale, num_splits, window = _inputs(case, dtype, device)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale)
    got = paged_attention_decode(*args, sliding_window=window, num_splits=num_splits)
    want = paged_attention_decode_ref(*args, sliding_window=window)
    assert got.dtype == dtype and got.shape == q.shape
    close(got, want, KERNEL_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_naive(case: str, dtype: torch.dtype, device: torch.device) -> None:
    from tidepool.kernels.paged_attention_decode import paged_attention_decode_ref

    paged, q, scale, _, window = _inputs(case, dtype, device)
    got = paged_attention_decode_ref(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale, sliding_window=window
    )
    for seq, seq_len in enumerate(paged.seq_lens.tolist()):
        want = naive_attention(q[seq : seq + 1], paged.keys[seq], paged.values[seq], scale, [seq_len - 1], window)
        close(got[seq : seq + 1], want, REF_TOL[dtype])


def test_split_count_does_not_change_the_result(device: torch.device) -> None:
    """Every split count (including more splits than a short sequence has tiles) gives the same answer."""
    from tidepool.kernels.paged_attention_decode import paged_attention_decode

    paged, q, scale, _, _ = _inputs("gqa4-hd80-split", torch.float32, device)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale)
    single = paged_attention_decode(*args, num_splits=1)
    for num_splits in (2, 5):
        close(paged_attention_decode(*args, num_splits=num_splits), single, KERNEL_TOL[torch.float32])


def test_writes_into_a_strided_out_view(device: torch.device) -> None:
    """The engine passes ``out[:num_decode]`` of a larger buffer and q sliced out of a fused qkv tensor."""
    from tidepool.kernels.paged_attention_decode import paged_attention_decode, paged_attention_decode_ref

    paged, q, scale, _, _ = _inputs("gqa1-hd64", torch.float16, device)
    fused = torch.cat([q, torch.zeros_like(q)], dim=1)  # q is a non-contiguous view of this
    q_view = fused[:, : q.shape[1]]
    buffer = torch.full((q.shape[0] + 2, *q.shape[1:]), 7.0, dtype=q.dtype, device=device)
    args = (q_view, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale)
    paged_attention_decode(*args, out=buffer[: q.shape[0]])
    close(buffer[: q.shape[0]], paged_attention_decode_ref(*args), KERNEL_TOL[torch.float16])
    assert bool((buffer[q.shape[0] :] == 7.0).all())
