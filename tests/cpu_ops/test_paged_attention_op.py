"""The compiled CPU paged-attention op against dense float64 attention and against the engine's torch path.

Random steps cover GQA ratios 1-8, head dims 64/80/96/128 (and 24/72/100, not multiples of the
vector width), block sizes 16/32, contexts 1-2,000, decodes and prefill chunks (fresh and after a
cached prefix) mixed in one batch, shuffled block ids, sliding windows, and 1-3 threads (with few
work items the op splits long contexts and merges the parts, so thread counts change the code path).
"""

from __future__ import annotations

import random

import pytest
import torch
from cpu_op_steps import Step, dense_reference, kernel_view_metadata, random_seqs, random_step, torch_path_metadata

from tidepool.engine import cpu_ops
from tidepool.engine.layers import attention_backend as backend

pytestmark = pytest.mark.usefixtures("vector_width")

HEAD_DIMS = (64, 80, 96, 128)


def _random_case(seed: int, head_dims: tuple[int, ...] = HEAD_DIMS) -> tuple[Step, int]:
    rng = random.Random(seed)
    step = random_step(
        seed,
        num_kv_heads=rng.choice([1, 2, 3]),
        group=rng.randint(1, 8),
        head_dim=rng.choice(head_dims),
        block_size=rng.choice([16, 32]),
        seqs=random_seqs(rng, rng.randint(1, 6)),
        window=rng.choice([None, None, rng.randint(1, 600)]),
    )
    return step, rng.randint(1, 3)


def _run(paged_attention: cpu_ops.CpuPagedAttention, step: Step) -> torch.Tensor:
    return paged_attention(step.q, step.k_cache, step.v_cache, *step.views, step.scale, step.window)


@pytest.mark.parametrize("seed", range(24))
def test_matches_dense_float64(paged_attention: cpu_ops.CpuPagedAttention, threads: None, seed: int) -> None:
    step, num_threads = _random_case(seed)
    torch.set_num_threads(num_threads)
    got = _run(paged_attention, step)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), dense_reference(step), atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("seed", range(100, 108))
def test_odd_head_dims(paged_attention: cpu_ops.CpuPagedAttention, seed: int) -> None:
    step, _ = _random_case(seed, head_dims=(24, 72, 100))
    torch.testing.assert_close(_run(paged_attention, step).double(), dense_reference(step), atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("seed", range(200, 208))
def test_engine_paths_agree(paged_attention: cpu_ops.CpuPagedAttention, seed: int) -> None:
    """Through `attention_backend.paged_attention` (store_kv included): kernel views vs the torch path."""
    step, _ = _random_case(seed)
    want = backend.paged_attention(
        step.q, step.k, step.v, step.k_cache.clone(), step.v_cache.clone(), torch_path_metadata(step), step.scale
    )
    got = backend.paged_attention(
        step.q, step.k, step.v, step.k_cache, step.v_cache, kernel_view_metadata(step), step.scale
    )
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("seed", range(300, 306))
def test_half_precision_accumulates_in_float32(
    paged_attention: cpu_ops.CpuPagedAttention, seed: int, dtype: torch.dtype, atol: float
) -> None:
    if dtype not in paged_attention.dtypes:
        pytest.skip(f"this compiler has no {dtype} arithmetic type; the engine uses the torch path for it")
    step = _random_case(seed)[0].to(dtype)
    got = _run(paged_attention, step)
    assert got.dtype == dtype
    # The reference sees the same rounded inputs; what is left is output rounding plus accumulation error.
    torch.testing.assert_close(got.double(), dense_reference(step), atol=atol, rtol=1e-2)


def test_long_context_split_and_merge(paged_attention: cpu_ops.CpuPagedAttention, threads: None) -> None:
    step = random_step(7, num_kv_heads=2, group=4, head_dim=64, block_size=16, seqs=[(2000, 1), (1700, 3)])
    want = dense_reference(step)
    for num_threads in (1, 2, 3, 8):
        torch.set_num_threads(num_threads)
        torch.testing.assert_close(_run(paged_attention, step).double(), want, atol=3e-5, rtol=1e-4)


def test_strided_query_and_output(paged_attention: cpu_ops.CpuPagedAttention) -> None:
    """The model hands q as a view of the fused qkv projection; out may be a view too."""
    step = random_step(11, num_kv_heads=2, group=3, head_dim=64, block_size=16, seqs=[(40, 1), (100, 30)])
    tokens, heads, dim = step.q.shape
    fused = torch.randn(tokens, heads + 4, dim)
    fused[:, :heads] = step.q
    q = fused[:, :heads]
    assert not q.is_contiguous()
    buffer = torch.full((tokens, heads + 1, dim), float("nan"))
    out = buffer[:, 1:]
    result = paged_attention(q, step.k_cache, step.v_cache, *step.views, step.scale, None, out=out)
    assert result.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.double(), dense_reference(step), atol=3e-5, rtol=1e-4)
    assert torch.isnan(buffer[:, 0]).all()  # nothing written outside out


def test_empty_step(paged_attention: cpu_ops.CpuPagedAttention) -> None:
    cache = torch.zeros(4, 16, 2, 64)
    q = torch.zeros(0, 4, 64)
    empty = torch.zeros(0, 0, dtype=torch.int32)
    no_seqs = torch.zeros(0, dtype=torch.int32)
    cu_seqlens_q = torch.zeros(1, dtype=torch.int32)
    assert paged_attention(q, cache, cache, empty, no_seqs, cu_seqlens_q, 0.125).shape == (0, 4, 64)


def _bad(step: Step, **change: object) -> dict[str, object]:
    tables, lens, cu = step.views
    args: dict[str, object] = dict(
        q=step.q, k_cache=step.k_cache, v_cache=step.v_cache, block_tables=tables, seq_lens=lens, cu_seqlens_q=cu
    )
    args.update(change)
    return args


def test_rejects_invalid_steps_with_a_reason(paged_attention: cpu_ops.CpuPagedAttention) -> None:
    step = random_step(3, num_kv_heads=2, group=2, head_dim=64, block_size=16, seqs=[(40, 1), (33, 33)])
    tables, lens, cu = step.views
    bad_ids = tables.clone()
    bad_ids[0, 0] = step.k_cache.shape[0]
    cases = {
        "outside the cache": _bad(step, block_tables=bad_ids),
        "shorter than its sequence": _bad(step, block_tables=tables[:, :1].contiguous()),
        "prefix sum": _bad(step, cu_seqlens_q=torch.tensor([0, 1, 40], dtype=torch.int32)),
        "must be int32": _bad(step, seq_lens=lens.long()),
        "GQA group": _bad(step, q=step.q[:, :3]),
        "dtypes": _bad(step, q=step.q.double()),
        "cu_seqlens_q must be": _bad(step, cu_seqlens_q=cu[:2]),
        "contiguous head dimension": _bad(step, q=step.q.transpose(1, 2).contiguous().transpose(1, 2)),
    }
    for reason, args in cases.items():
        with pytest.raises(ValueError, match=reason):
            paged_attention(**args, scale=step.scale)
