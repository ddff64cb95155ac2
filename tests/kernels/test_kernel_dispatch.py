"""Dispatch and engine wiring: CPU paths of the dispatch functions, launcher input errors, and the engine's
CUDA attention path (run here with the Triton kernels under the interpreter) against its SDPA path."""

from __future__ import annotations

import re

import pytest
import torch
from paged_cases import KERNEL_TOL, close

from tidepool.engine.layers import attention_backend
from tidepool.engine.layers.attention_metadata import AttentionMetadata, PrefillChunk
from tidepool.engine.layers.norm import RMSNorm
from tidepool.kernels import dispatch
from tidepool.kernels.int4_packing import pack_int4


def test_quantized_linears_on_cpu_match_the_references() -> None:
    from tidepool.kernels.int4_matmul import int4_matmul_ref
    from tidepool.kernels.int8_matmul import int8_matmul_ref

    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 3, 64, generator=gen)
    bias = torch.randn(24, generator=gen)
    w8 = torch.randint(-127, 128, (24, 64), generator=gen, dtype=torch.int8)
    s8 = torch.rand(24, generator=gen) * 0.02
    want8 = int8_matmul_ref(x.view(6, 64), w8, s8).view(2, 3, 24) + bias
    close(dispatch.int8_linear(x, w8, s8, bias), want8, (1e-5, 1e-5))
    qweight = pack_int4(torch.randint(0, 16, (64, 24), generator=gen))
    scales, zeros = torch.rand(2, 24, generator=gen) * 0.02, torch.rand(2, 24, generator=gen) * 15
    want4 = int4_matmul_ref(x.view(6, 64), qweight, scales, zeros, 32).view(2, 3, 24) + bias
    close(dispatch.int4_linear(x, qweight, scales, zeros, 32, bias), want4, (1e-5, 1e-5))
    mins = (torch.randn(2, 24, generator=gen) * 0.05).half()  # the mins form, fp16 as in a GGUF file
    want_min = int4_matmul_ref(x.view(6, 64), qweight, scales.half(), None, 32, mins=mins).view(2, 3, 24) + bias
    close(dispatch.int4_linear(x, qweight, scales.half(), None, 32, bias, mins=mins), want_min, (1e-5, 1e-5))


def test_rms_norm_dispatch_matches_the_engine_layer_on_cpu() -> None:
    layer = RMSNorm(48, 1e-5, torch.bfloat16)
    layer.weight.data.normal_(1.0, 0.1)
    x, residual = torch.randn(5, 48).bfloat16(), torch.randn(5, 48).bfloat16()
    normed, new_residual = layer(x, residual)
    got_normed, got_residual = dispatch.rms_norm(x, layer.weight, 1e-5, residual)
    assert torch.equal(got_normed, normed) and torch.equal(got_residual, new_residual)


def _cache(num_kv_heads: int = 2, head_dim: int = 16) -> torch.Tensor:
    return torch.zeros(8, 4, num_kv_heads, head_dim)


BAD_CALLS = {
    "block_tables int64": (
        lambda m: m.paged_attention_decode(
            torch.zeros(1, 2, 16), _cache(), _cache(), torch.zeros(1, 2, dtype=torch.long), torch.ones(1).int(), 1.0
        ),
        "block_tables must be int32",
    ),
    "heads not a multiple": (
        lambda m: m.paged_attention_decode(
            torch.zeros(1, 3, 16), _cache(), _cache(), torch.zeros(1, 2).int(), torch.ones(1).int(), 1.0
        ),
        "multiple of num_kv_heads",
    ),
    "q dtype differs": (
        lambda m: m.flash_attention_varlen(
            torch.zeros(2, 2, 16).half(),
            _cache(),
            _cache(),
            torch.tensor([0, 2]).int(),
            torch.tensor([2]).int(),
            torch.zeros(1, 1).int(),
            1.0,
        ),
        "same dtype",
    ),
    "cu_seqlens length": (
        lambda m: m.flash_attention_varlen(
            torch.zeros(2, 2, 16),
            _cache(),
            _cache(),
            torch.tensor([0, 2]).int(),
            torch.tensor([1, 1]).int(),
            torch.zeros(2, 1).int(),
            1.0,
        ),
        "num_seqs + 1",
    ),
    "head_dim mismatch": (
        lambda m: m.store_kv(torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), _cache(), _cache(), torch.arange(3)),
        "for this cache",
    ),
    "int8 weight dtype": (
        lambda m: m.int8_matmul(torch.zeros(2, 8), torch.zeros(4, 8), torch.ones(4)),
        "w_int8 must be int8",
    ),
    "int4 K mismatch": (
        lambda m: m.int4_matmul(
            torch.zeros(2, 24), torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, 4), torch.ones(2, 4), 8
        ),
        "K=16",
    ),
    "rms weight shape": (lambda m: m.rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-6), "weight must be [8]"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_launchers_reject_bad_input_with_a_named_reason(case: str) -> None:
    import tidepool.kernels.flash_attention_varlen as varlen
    import tidepool.kernels.int4_matmul as int4
    import tidepool.kernels.int8_matmul as int8
    import tidepool.kernels.paged_attention_decode as decode
    import tidepool.kernels.rms_norm as norm
    import tidepool.kernels.store_kv as store

    class Launchers:  # the Triton launchers, by the names the table uses
        paged_attention_decode = decode.paged_attention_decode
        flash_attention_varlen = varlen.flash_attention_varlen
        store_kv = store.store_kv
        int8_matmul = int8.int8_matmul
        int4_matmul = int4.int4_matmul
        rms_norm = norm.rms_norm

    call, message = BAD_CALLS[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        call(Launchers)


def _step(window: int | None):
    """A step of 2 decodes and 2 prefill chunks (one fresh, one after a cached prefix), built like the runner does."""
    gen = torch.Generator().manual_seed(10)
    block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 16
    # (blocks, context_len after this step, new tokens); decodes first, as the scheduler orders them.
    seqs = [([3, 9, 1], 11, 1), ([7, 2, 12, 5], 13, 1), ([0, 14], 5, 5), ([4, 11, 6, 10], 14, 6)]
    k_cache = torch.randn(16, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(16, block_size, num_kv_heads, head_dim, generator=gen)
    slots, prefills, decode_tables = [], [], []
    for blocks, context_len, num_new in seqs:
        query_start = len(slots)
        slots += [
            blocks[p // block_size] * block_size + p % block_size for p in range(context_len - num_new, context_len)
        ]
        if num_new == 1:
            decode_tables.append(blocks)
        else:
            mask = attention_backend.build_prefill_mask(context_len - num_new, num_new, context_len, window, "cpu")
            prefills.append(PrefillChunk(query_start, num_new, context_len, torch.tensor(blocks), mask))
    max_blocks = max(len(t) for t in decode_tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_seqs=len(decode_tables),
        decode_block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in decode_tables]),
        decode_mask=attention_backend.build_decode_mask([11, 13], max_blocks * block_size, window, "cpu"),
        prefills=prefills,
    )
    num_tokens = len(slots)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    kernel_views = ([s[0] for s in seqs], [s[1] for s in seqs], [s[2] for s in seqs])
    return q, k, v, k_cache, v_cache, meta, kernel_views


@pytest.mark.parametrize("window", [None, 6])
def test_engine_kernel_path_matches_the_sdpa_path(window: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's CUDA branch (kernel views, decode rows, absolute cu_seqlens offsets), kernels interpreted."""
    from tidepool.kernels.flash_attention_varlen import flash_attention_varlen
    from tidepool.kernels.paged_attention_decode import paged_attention_decode
    from tidepool.kernels.store_kv import store_kv

    q, k, v, k_cache, v_cache, meta, views = _step(window)
    k_sdpa, v_sdpa = k_cache.clone(), v_cache.clone()
    want = attention_backend.paged_attention(q, k, v, k_sdpa, v_sdpa, meta, 0.25)

    attention_backend.attach_kernel_views(meta, *views, window)
    monkeypatch.setattr(dispatch, "store_kv", store_kv)
    monkeypatch.setattr(dispatch, "paged_attention_decode", paged_attention_decode)
    monkeypatch.setattr(dispatch, "flash_attention_varlen", flash_attention_varlen)
    got = attention_backend._paged_attention_triton(q, k, v, k_cache, v_cache, meta, 0.25)
    close(got, want, KERNEL_TOL[torch.float32])
    assert torch.equal(k_cache, k_sdpa) and torch.equal(v_cache, v_sdpa)
