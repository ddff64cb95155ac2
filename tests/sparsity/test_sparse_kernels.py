"""`SparseWeight` (engine/sparsity/weight.py) through F.linear, on every path, against a dense matmul over the pruned
weight: the compiled op (batches 1..70 and the op's limit), torch's fallback (longer prefill chunks, the compiled op
switched off, float64 inputs), float16 values widened for the CPU, int8 values, fused projections, bad tensors
named in the error, and CUDA's semi-structured path where a GPU is present.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from tidepool.engine import cpu_ops
from tidepool.engine.sparsity.format import pack_2to4
from tidepool.engine.sparsity.weight import SparseWeight, fuse_sparse


def pruned(out: int, inner: int, seed: int) -> torch.Tensor:
    """A dense weight, magnitude-pruned 2:4 (the largest 2 of every 4 inputs kept)."""
    w = torch.randn(out, inner, generator=torch.Generator().manual_seed(seed))
    groups = w.view(out, inner // 4, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.abs().topk(2, dim=-1).indices, True)
    return (groups * keep).view(out, inner)


def sparse_of(dense: torch.Tensor, name: str = "p") -> SparseWeight:
    values, meta = pack_2to4(dense, name=name)
    return SparseWeight(values, meta, dense.shape[1], None, name)


def int8_of(dense: torch.Tensor) -> tuple[SparseWeight, torch.Tensor]:
    scales = dense.abs().amax(1) / 127
    q = (dense / scales[:, None]).round().clamp(-127, 127)
    values, meta = pack_2to4(q, mask=dense != 0)
    weight = SparseWeight(values.to(torch.int8), meta, dense.shape[1], scales, "p")
    return weight, weight.dense()


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The compiled 2:4 op switched off (TIDEPOOL_CPU_SPARSE24=torch)."""
    monkeypatch.setenv(cpu_ops.SPARSE24_MODE_ENV, "torch")
    cpu_ops.reset()
    yield
    cpu_ops.reset()


@pytest.mark.parametrize("tokens", [1, 2, 7, 8, 9, 16, 33, 70, 128, 129, 300])
def test_f_linear_equals_dense_matmul_over_the_pruned_weight(tokens: int) -> None:
    dense = pruned(52, 580, tokens)
    weight = sparse_of(dense)
    x = torch.randn(tokens, 580)
    bias = torch.randn(52)
    close(F.linear(x, weight, bias), F.linear(x, dense, bias))
    close(F.linear(x.view(1, tokens, 580), weight), F.linear(x, dense).view(1, tokens, 52))  # any leading dims


def test_compiled_op_is_used_and_metadata_relaid_once() -> None:
    if cpu_ops.sparse24_op() is None:
        pytest.skip("no C++ compiler here: the compiled 2:4 op is unavailable")
    dense = pruned(16, 64, 0)
    weight = sparse_of(dense)
    file_meta = weight.meta.clone()
    assert weight.prepare_for_cpu() and weight.cpu_layout and weight.cpu_sparse() is not None
    assert torch.equal(weight.file_meta(), file_meta)  # the file's nibbles recovered from the bitmasks
    close(weight.dense(), dense)


def test_torch_path_and_other_dtypes(torch_path: None) -> None:
    dense = pruned(24, 40, 1)
    weight = sparse_of(dense)
    assert not weight.prepare_for_cpu() and weight.cpu_sparse() is None
    x = torch.randn(3, 40)
    close(F.linear(x, weight), F.linear(x, dense))
    close(F.linear(x.double(), weight), F.linear(x.double(), dense.double()))


def test_float16_values_are_widened_for_the_cpu() -> None:
    dense = pruned(20, 48, 2).half()
    weight = sparse_of(dense)
    x = torch.randn(4, 48)
    close(F.linear(x, weight), F.linear(x, dense.float()))


@pytest.mark.parametrize("tokens", [1, 5, 17, 200])
def test_int8_values_times_scales(tokens: int) -> None:
    dense = pruned(36, 120, 3)
    weight, dequantized = int8_of(dense)
    x = torch.randn(tokens, 120)
    close(F.linear(x, weight), F.linear(x, dequantized))
    torch.testing.assert_close(dequantized, dense, rtol=0, atol=float(dense.abs().max()) / 127)


def test_fused_parts_concatenate_along_n() -> None:
    parts = [pruned(n, 64, n) for n in (32, 8, 8)]
    fused = fuse_sparse([sparse_of(p, f"part{i}") for i, p in enumerate(parts)], "qkv")
    x = torch.randn(3, 64)
    close(F.linear(x, fused), F.linear(x, torch.cat(parts)))
    with pytest.raises(ValueError, match="must share the values' dtype and input width"):
        fuse_sparse([sparse_of(pruned(8, 64, 0), "a"), sparse_of(pruned(8, 32, 0), "b")], "qkv")


def test_only_f_linear() -> None:
    weight = sparse_of(pruned(8, 16, 0))
    with pytest.raises(TypeError, match=r"only supports F\.linear"):
        torch.matmul(torch.randn(2, 16), weight)  # type: ignore[arg-type]


def test_bad_metadata_is_named() -> None:
    values, meta = pack_2to4(pruned(8, 16, 0))
    bad = meta.clone()
    bad[3, 1] = 0x55  # indices (1, 1): not distinct
    with pytest.raises(ValueError, match=r"layers\.0\.q_proj\.meta: row 3"):
        SparseWeight(values, bad, 16, None, "layers.0.q_proj")
    with pytest.raises(ValueError, match=r"layers\.0\.q_proj\.meta is torch.uint8 \(8, 3\)"):
        SparseWeight(values, torch.zeros(8, 3, dtype=torch.uint8), 16, None, "layers.0.q_proj")
    with pytest.raises(ValueError, match=r"layers\.0\.q_proj\.values .*not a multiple of 4"):
        SparseWeight(values, meta, 18, None, "layers.0.q_proj")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_semi_structured_equals_dense(dtype: torch.dtype) -> None:
    dense = pruned(256, 512, 4)
    weight = sparse_of(dense).cuda()
    x = torch.randn(5, 512, device="cuda", dtype=dtype)
    want = F.linear(x.float(), dense.cuda())
    got = F.linear(x, weight)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
